"""`accel plan`'s table and JSON: every candidate layout's busiest rank, and the one chosen."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from accel.memory.candidates import RESERVED, Candidate, GiB
from accel.memory.plan import MemoryPlan


# The phases a rank goes through, in order, each with the working memory it adds.
PHASES = ("text encode", "transformer forward", "VAE decode")


def _gib(value: int) -> str:
    return f"{value / GiB:.2f}"


def headline(plan: MemoryPlan) -> str:
    chosen = plan.chosen
    where = f"{plan.gpus} GPU{'s' if plan.gpus > 1 else ''} of {plan.gpu_memory / GiB:g} GiB"
    if chosen is None:
        smallest = plan.smallest
        return (
            f"no layout of {plan.flagship.title} at {plan.size.describe()} fits {where}: the smallest peak is "
            f"{_gib(smallest.estimate.peak + RESERVED)} GiB ({smallest.describe()}); use more or larger GPUs"
        )
    from accel.memory.fit import layout_flags

    flags = " ".join(layout_flags(chosen))
    return (
        f"{plan.flagship.title} at {plan.size.describe()} on {where}: "
        f"{chosen.describe()}{f' ({flags})' if flags else ''}, "
        f"peak {_gib(chosen.estimate.peak + RESERVED)} GiB per GPU, about {chosen.speedup:.2f}x the step speed of one "
        "GPU "
        f"that holds the whole model"
    )


def quantized(plan: MemoryPlan) -> str:
    quant = plan.quant
    tiles = ", VAE decoding in tiles" if plan.vae_tiling else ""
    return tiles + (
        ""
        if quant.type == "none"
        else f", {'the blocks' if quant.scope == 'blocks' else 'every Linear'} in {quant.type}"
    )


def table(plan: MemoryPlan) -> Table:
    attrs = list(plan.candidates[0].estimate.weights) if plan.candidates else []
    result = Table(
        title=f"accel plan {plan.model}: {plan.flagship.title} ({plan.flagship.repo}), {plan.size.describe()}, "
        f"bf16{quantized(plan)}, GiB on the busiest rank"
    )
    result.add_column("layout")
    for attr in attrs:
        result.add_column(attr, justify="right")
    phases = [phase for phase in PHASES if any(phase in c.estimate.working for c in plan.candidates)]
    for phase in phases:
        result.add_column(phase, justify="right")
    result.add_column("peak", justify="right")
    result.add_column("speed", justify="right")
    result.add_column("verdict")
    chosen = plan.chosen
    for candidate in plan.candidates:
        estimate = candidate.estimate
        verdict = ("chosen" if candidate is chosen else "fits") if candidate.fits else "does not fit"
        result.add_row(
            candidate.describe(),
            *(_gib(estimate.weights[a]) for a in attrs),
            *(_gib(estimate.working[p]) if p in estimate.working else "" for p in phases),
            _gib(estimate.peak + RESERVED),
            f"{candidate.speedup:.2f}x",
            verdict,
        )
    result.caption = (
        f"peak = weights held throughout + the largest phase (under offload: what it moves in and its "
        f"working memory) + {RESERVED / GiB:g} GiB reserved (CUDA context, workspaces, NCCL); limit "
        f"{plan.gpu_memory / GiB:g} GiB; speed: expected step speed against one GPU holding the whole model"
    )
    return result


def _candidate_json(candidate: Candidate) -> dict[str, Any]:
    degrees = candidate.degrees
    return {
        "cfg": degrees.cfg,
        "tp": degrees.tp,
        "ulysses": degrees.ulysses,
        "ring": degrees.ring,
        "text_encoder": candidate.text_encoder,
        "offload": candidate.offload,
        "vae_tiling": candidate.vae_tiling,
        "vae_parallel": candidate.vae_parallel,
        "weights_bytes": candidate.estimate.weights,
        "working_bytes": candidate.estimate.working,
        "peak_bytes": candidate.estimate.peak + RESERVED,
        "fits": candidate.fits,
        "expected_speedup": round(candidate.speedup, 3),
    }


def as_json(plan: MemoryPlan) -> dict[str, Any]:
    chosen = plan.chosen
    return {
        "model": plan.model,
        "checkpoint": plan.flagship.repo,
        "size": plan.size.describe(),
        "quant": plan.quant.type,
        "vae_tiling": plan.vae_tiling,
        "gpus": plan.gpus,
        "gpu_memory_bytes": plan.gpu_memory,
        "reserved_bytes": RESERVED,
        "candidates": [_candidate_json(c) for c in plan.candidates],
        "refused": list(plan.refused),
        "chosen": _candidate_json(chosen) if chosen else None,
    }
