"""The automatic context-parallel plan against each family's hand plan, side by side in one run.

For every family's tiny pipeline, the transformer's first call of a probe at 128 px (and, with
--size, larger) runs on N simulated ranks (accel/parallel/simulate.py) under the hand plan and under
the automatic plan learned from the model: the bytes each rank sends per forward (deterministic: what
the collectives move) and the wall time of the simulated forward (threads of one process: noisy, a
ratio only). A ratio above 1 means the automatic plan moves more than the hand one; where it keeps
the text whole on every rank (the fallback when cutting it is not exact) the bytes can be lower but
each rank computes the whole text. "first sight" is the plan the same class gets where no family
names it: its own diffusers `_cp_plan` (streams learned) where it ships one accel can follow and that
is exact, else the automatic plan; its bytes are given against the hand plan's too.

    python benchmarks/automatic_plan.py [--families flux,wan] [--ulysses 2] [--ring 1] [--size 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import torch


def measure(transformer: Any, plan: Any, call: Any, ulysses: int, ring: int, repeats: int) -> tuple[float, float]:
    """(bytes one rank sends per forward, median seconds of the simulated forward)."""
    from accel.parallel.comm import TRAFFIC
    from accel.parallel.verify import _split_run

    times = []
    for _ in range(repeats):
        TRAFFIC.reset()
        start = time.perf_counter()
        _split_run(transformer, plan, call, ulysses, ring)
        times.append(time.perf_counter() - start)
    return TRAFFIC.total_bytes / (ulysses * ring), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="", help="comma-separated family names (default: all)")
    parser.add_argument("--ulysses", type=int, default=2)
    parser.add_argument("--ring", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--size", type=int, default=128, help="probe width in pixels (the height stays 128)")
    args = parser.parse_args()
    os.environ.setdefault("ACCEL_CACHE_DIR", tempfile.mkdtemp(prefix="accel-bench-"))
    torch.set_num_threads(1)

    import accel
    from accel.models.pipeline_probe import first_transformer_call, other_transformer_call
    from accel.models.registry import FAMILIES
    from accel.errors import NotAvailableError
    from accel.parallel.derive import DIFFUSERS
    from accel.parallel.plan import resolve_plan
    from accel.parallel.choose import automatic_plan

    names = [n for n in args.families.split(",") if n] or list(FAMILIES)
    print(
        f"{'family':<12} {'text':<6} {'hand KiB':>9} {'auto KiB':>9} {'bytes':>6} {'hand ms':>8} {'auto ms':>8} "
        f"{'time':>6} "
        f"{'first sight':<11} {'KiB':>7} {'bytes':>6}"
    )
    for name in names:
        family = FAMILIES[name]
        pipe = accel.load_pipeline(f"tiny-{name}")
        pipe.set_progress_bar_config(disable=True)
        transformer = pipe.transformer
        call = first_transformer_call(pipe, transformer, args.size)
        other = other_transformer_call(pipe, transformer)
        try:
            auto = automatic_plan(
                transformer, call, other, family.blocks, family.primary_stream, args.ulysses, args.ring, name
            )
            first = automatic_plan(
                transformer,
                call,
                other,
                family.blocks,
                family.primary_stream,
                args.ulysses,
                args.ring,
                name,
                diffusers_first=True,
            )
        except NotAvailableError as refused:
            print(f"{name:<12} refused: {str(refused)[:100]}")
            continue
        hand = resolve_plan(family.plan_for(transformer), transformer)
        hand_bytes, hand_time = measure(transformer, hand, call, args.ulysses, args.ring, args.repeats)
        auto_bytes, auto_time = measure(transformer, auto, call, args.ulysses, args.ring, args.repeats)
        first_bytes, _ = measure(transformer, first, call, args.ulysses, args.ring, 1)
        text = "whole" if auto.whole_streams else "cut"
        source = "diffusers" if first.origin == DIFFUSERS else first.origin
        print(
            f"{name:<12} {text:<6} {hand_bytes / 1024:9.1f} {auto_bytes / 1024:9.1f} "
            f"{auto_bytes / max(hand_bytes, 1):6.2f} "
            f"{hand_time * 1e3:8.1f} {auto_time * 1e3:8.1f} {auto_time / hand_time:6.2f} "
            f"{source:<11} {first_bytes / 1024:7.1f} {first_bytes / max(hand_bytes, 1):6.2f}"
        )


if __name__ == "__main__":
    main()
