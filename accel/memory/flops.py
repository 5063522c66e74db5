"""A transformer call's arithmetic, counted on fake `cuda` before any weight is read: what sets the pace
of a group-offloaded step against its weights' copies (accel/memory/speed.py).
"""

from __future__ import annotations

import torch

from accel.memory.build import block_lists, build, cut_config, on_device
from accel.memory.fake_cuda import fake_or_real
from accel.models.flagships import Flagship, Size


def transformer_flops(flagship: Flagship, size: Size) -> int:
    """Floating-point operations of one whole transformer call at `size` on one GPU. torch's
    FlopCounterMode counts the cut model's forward on fake `cuda` (attention through accel's kernels);
    each repeated block list's per-block count is then scaled to the list's full depth."""
    from torch.utils.flop_counter import FlopCounterMode

    component = flagship.of_kind("transformer")[0]
    full = block_lists(build(component))
    with fake_or_real("cuda"):
        model = build(component, "cuda", cut_config(component))
        with torch.device("cuda"):
            inputs = on_device(flagship.inputs(size), "cuda")
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            model(**inputs)
    counts, root = counter.get_flop_counts(), type(model).__name__
    total = counter.get_total_flops()
    for name, cut in block_lists(model).items():
        per_block = sum(sum(counts.get(f"{root}.{name}.{index}", {}).values()) for index in range(len(cut))) / max(
            len(cut), 1
        )
        total += (len(full[name]) - len(cut)) * per_block
    return int(total)
