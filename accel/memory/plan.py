"""`accel plan`: which layouts of a model fit N GPUs of a given memory, and the fastest that does.

Each candidate is a set of degrees over all N GPUs: CFG halves (families that run guidance), then a
TP degree that splits every planned width, then the largest Ulysses degree the TP rank's heads allow
with Ring for the rest (accel's own preference for sequence ranks). Its busiest rank's peak is
measured by accel/memory/estimate.py; it fits when that peak plus RESERVED is within the card.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from accel.errors import UserError
from accel.memory.estimate import RankEstimate, build, transformer_weights, transformer_working, tp_problem, vae_working, weight_bytes
from accel.models.base import Family
from accel.models.flagships import FLAGSHIPS, Flagship, Size
from accel.models.registry import FAMILIES
from accel.parallel.mesh import Degrees, resolve_degrees
from accel.recipe import ParallelSection

GiB = 2**30
# Held on every GPU beside what the tracker sees: the CUDA context, cuBLAS / cuDNN workspaces, NCCL's
# buffers and the caching allocator's slack (about 1 GiB each of context and slack on an H100).
RESERVED = 2 * GiB
# Step-time efficiency of each parallel dimension per doubling, for ordering layouts that fit: from
# this repo's measurements (BENCHMARKS.md: Ulysses 0.97-1.0 and Ring 0.83-0.95 of ideal per rank on
# H100 at video lengths; TP 0.84-1.06x of Ulysses on CPU ranks; CFG halves independent).
EFFICIENCY = {"cfg": 0.98, "ulysses": 0.95, "ring": 0.85, "tp": 0.85}


# Where the text encoders can live ([memory] text_encoder): on the GPU ("replicated" and "rank0" both
# put them on the busiest rank), or in host memory ("cpu"), which costs CPU time once per prompt.
PLACEMENTS = ("replicated", "cpu")


@dataclass(frozen=True)
class Candidate:
    degrees: Degrees
    estimate: RankEstimate
    fits: bool
    speedup: float  # expected step speedup over one GPU
    text_encoder: str = "replicated"

    def describe(self) -> str:
        return self.degrees.describe() + (", text encoders on the CPU" if self.text_encoder == "cpu" else "")


@dataclass(frozen=True)
class MemoryPlan:
    model: str
    flagship: Flagship
    size: Size
    gpus: int
    gpu_memory: int  # bytes per GPU
    candidates: tuple[Candidate, ...]
    refused: tuple[str, ...]  # degrees considered and not possible, with the reason

    @property
    def chosen(self) -> Candidate | None:
        return fastest_fitting(self.candidates, self.gpu_memory)

    @property
    def smallest(self) -> Candidate:
        return min(self.candidates, key=lambda c: c.estimate.peak)


def fastest_fitting(candidates: tuple[Candidate, ...], gpu_memory: int) -> Candidate | None:
    """The fastest candidate whose peak fits `gpu_memory` bytes; at equal speed the encoders on the GPU
    (no CPU encoding), then the lowest peak. None: none fits."""
    fitting = [c for c in candidates if c.estimate.peak + RESERVED <= gpu_memory]
    return max(fitting, key=lambda c: (round(c.speedup, 6), c.text_encoder != "cpu", -c.estimate.peak)) if fitting else None


def expected_speedup(degrees: Degrees) -> float:
    value = 1.0
    for name in EFFICIENCY:
        degree = getattr(degrees, name)
        value *= degree * EFFICIENCY[name] ** math.log2(degree)
    return value


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _runs_guidance(family: Family) -> bool:
    """Whether the family's default call runs classifier-free guidance (only then do CFG ranks help)."""
    defaults = dataclasses.asdict(family.defaults)
    return family.cfg_off({key: value for key, value in defaults.items() if value is not None}) is None


def flagship_of(model: str) -> tuple[str, Flagship]:
    if model not in FLAGSHIPS:
        known = ", ".join(sorted(FLAGSHIPS))
        raise UserError(f"accel plan: no flagship config for {model!r}; plan knows: {known}")
    return model, FLAGSHIPS[model]


def make_plan(model: str, gpus: int, gpu_memory_gib: float, size: Size | None = None) -> MemoryPlan:
    """Measure every candidate layout of `model` on `gpus` GPUs of `gpu_memory_gib` GiB at `size`."""
    if not gpu_memory_gib > 0:
        raise UserError(f"accel plan: --gpu-memory must be a positive number of GiB, got {gpu_memory_gib:g}")
    if gpus < 1:
        raise UserError(f"accel plan: --gpus must be at least 1, got {gpus}")
    name, flagship = flagship_of(model)
    family = FAMILIES[name]
    measure = _Measure(name, size or flagship.size)
    candidates, refused = [], []
    transformer = next(iter(measure.transformers.values()))
    # The flagship's own heads: a family's `heads` is its default checkpoint's (Kandinsky 5 Lite 28, Pro 32).
    heads = family.heads_in(transformer.config) or family.heads
    for cfg in (1, 2) if _runs_guidance(family) else (1,):
        for tp in _divisors(gpus // cfg) if gpus % cfg == 0 else []:
            problem = tp_problem(family, transformer, tp)
            if problem:
                refused.append(f"cfg {cfg} x tp {tp}: {problem}")
                continue
            # Ulysses and Ring for the ranks left, as `--gpus` alone chooses them in a run.
            degrees = resolve_degrees(ParallelSection(gpus=gpus, cfg=cfg, tp=tp), heads, name)
            candidates += [measure.candidate(degrees, placement, gpu_memory_gib) for placement in PLACEMENTS]
    return MemoryPlan(name, flagship, measure.size, gpus, int(gpu_memory_gib * GiB), tuple(candidates), tuple(refused))


def estimate_of(model: str, degrees: Degrees, placement: str, size: Size | None = None) -> Candidate:
    """One layout's busiest rank, as given (a layout the plan would not consider: Ring over heads that divide)."""
    measure = _Measure(model, size or FLAGSHIPS[model].size)
    return measure.candidate(degrees, placement, None)


class _Measure:
    """The measures a plan shares across its candidates: the transformers built on meta once, weights
    per component, the VAE decode once, the forward once per (tp, ulysses, ring)."""

    def __init__(self, model: str, size: Size) -> None:
        self.family, self.flagship, self.size = FAMILIES[model], FLAGSHIPS[model], size
        self.transformers = {c.attr: build(c) for c in self.flagship.of_kind("transformer")}
        self.others = {c.attr: weight_bytes(build(c)) for c in self.flagship.components if not c.attr.startswith("transformer")}
        self.vae = vae_working(self.flagship, size)
        self.working: dict[tuple[int, int, int], int] = {}
        self.split: dict[int, dict[str, int]] = {}

    def candidate(self, degrees: Degrees, placement: str, gpu_memory_gib: float | None) -> Candidate:
        key = (degrees.tp, degrees.ulysses, degrees.ring)
        if key not in self.working:
            self.working[key] = transformer_working(self.family, self.flagship, self.size, degrees)
        if degrees.tp not in self.split:
            self.split[degrees.tp] = {attr: transformer_weights(self.family, model, degrees.tp) for attr, model in self.transformers.items()}
        held = {attr: 0 if placement == "cpu" and attr.startswith("text_encoder") else size for attr, size in self.others.items()}
        estimate = RankEstimate(self.split[degrees.tp] | held, {"transformer forward": self.working[key], "VAE decode": self.vae})
        fits = gpu_memory_gib is None or estimate.peak + RESERVED <= gpu_memory_gib * GiB
        return Candidate(degrees, estimate, fits, expected_speedup(degrees), placement)
