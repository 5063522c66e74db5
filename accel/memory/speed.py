"""A layout's expected step speed against one GPU that holds the whole model, for ordering the layouts
that fit: each parallel dimension's efficiency per doubling, and group offload's pace on a GPU class
(the slower of its arithmetic and its copies over PCIe).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from accel.parallel.mesh import Degrees

# Step-time efficiency of each parallel dimension per doubling, for ordering layouts that fit: from
# this repo's measurements (BENCHMARKS.md: Ulysses 0.97-1.0 and Ring 0.83-0.95 of ideal per rank on
# H100 at video lengths; TP 0.84-1.06x of Ulysses on CPU ranks; CFG halves independent).
EFFICIENCY = {"cfg": 0.98, "ulysses": 0.95, "ring": 0.85, "tp": 0.85}


@dataclass(frozen=True)
class Card:
    """What decides group offload's cost on a GPU class: its bf16 tensor throughput as accel reaches it,
    and host-to-device bandwidth."""

    name: str
    min_memory_gib: float  # the class is taken from the memory per GPU: the plan is not told the model
    flops_per_second: float
    pcie_bytes_per_second: float


# Dense bf16 peaks (H100 SXM 989, L40S 362, RTX 4090 165 TFLOP/s with fp32 accumulation) at the share an
# eager FLUX.1-dev step reaches on an H100 (74.4 TFLOP counted in 182.5 ms: 0.41, BENCHMARKS.md); pinned
# host-to-device copies at about 50 GB/s on PCIe 5 x16 and 25 GB/s on PCIe 4 x16.
REACHED = 0.41
CARDS = (
    Card("H100", 64, 989e12 * REACHED, 50e9),
    Card("L40S", 40, 362e12 * REACHED, 25e9),
    Card("RTX 4090", 0, 165e12 * REACHED, 25e9),
)


def card_for(gpu_memory_gib: float) -> Card:
    return next(card for card in CARDS if gpu_memory_gib >= card.min_memory_gib)


def expected_speedup(degrees: Degrees) -> float:
    value = 1.0
    for name in EFFICIENCY:
        degree = getattr(degrees, name)
        value *= degree * EFFICIENCY[name] ** math.log2(degree)
    return value


def group_offload_speedup(flops: int, copied_bytes: int, gpu_memory_gib: float | None) -> float:
    """Group offload's step against one GPU holding everything: each call's arithmetic (`flops`) overlaps
    the copy of every block's weights (`copied_bytes`) on a side stream, so the slower of the two sets
    the pace."""
    card = card_for(gpu_memory_gib if gpu_memory_gib is not None else 0)
    compute = flops / card.flops_per_second
    copy = copied_bytes / card.pcie_bytes_per_second
    return compute / max(compute, copy)
