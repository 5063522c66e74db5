"""`accel plan`: which layouts of a model fit N GPUs of a given memory, and the fastest that does.

Each candidate is a set of degrees over all N GPUs: CFG halves (families that run guidance), then a
TP degree that splits every planned width, then the largest Ulysses degree the TP rank's heads allow
with Ring for the rest (accel's own preference for sequence ranks). Its busiest rank's peak is
measured by accel/memory/measure.py; it fits when that peak plus RESERVED is within the card.

On one GPU the plan also weighs diffusers' offloading ([memory] offload): "model" holds one whole
component at a time (no cost per step; the weights cross PCIe once per job), "group" streams the
transformer's blocks one at a time with prefetch, so a step costs the larger of its arithmetic and
moving every block's weights over PCIe. Where a layout's largest phase is the VAE's whole decode
(long videos: HunyuanVideo, Mochi, CogVideoX) and it does not fit, the plan also weighs the same
layout with the decode's rows split over its ranks ([vae] parallel: the same pixels), in tiles
([vae] tiling, as those pipelines' own docs advise), and both. The plan never picks
quantization: that changes the output, and is the user's call.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from accel.errors import UserError
from accel.memory.candidates import RESERVED, Candidate, GiB, fastest_fitting
from accel.memory.measure import Measure, measure_of
from accel.memory.weights import tp_problem
from accel.models.base import Family
from accel.models.flagships import FLAGSHIPS, Flagship, Size, flagship_heads
from accel.models.registry import FAMILIES
from accel.models.variants import variant_of
from accel.parallel.mesh import Degrees, resolve_degrees
from accel.recipe.sections import ParallelSection, QuantSection

# Where the text encoders can live ([memory] text_encoder): on the GPU ("replicated" and "rank0" both
# put them on the busiest rank), split over the layout's ranks by transformers' plan ("sharded": more
# than one GPU, encoders that have a plan), or in host memory ("cpu"), which costs CPU time per prompt.
PLACEMENTS = ("replicated", "sharded", "cpu")
# One GPU's offloaded layouts: (offload, text encoders' place). Model offload with the encoders in host
# memory is what model offload already does between uses.
OFFLOADED = (("model", "replicated"), ("group", "replicated"), ("group", "cpu"))


@dataclass(frozen=True)
class MemoryPlan:
    model: str
    flagship: Flagship
    size: Size
    quant: QuantSection
    vae_tiling: bool
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


def make_plan(
    model: str,
    gpus: int,
    gpu_memory_gib: float,
    size: Size | None = None,
    quant: QuantSection = QuantSection(),
    vae_tiling: bool = False,
    vae_parallel: bool = False,
) -> MemoryPlan:
    """Measure every candidate layout of `model` on `gpus` GPUs of `gpu_memory_gib` GiB at `size`, its
    transformers quantized as `quant` says, its VAE decoding in tiles or whole, split over the ranks or not."""
    if not gpu_memory_gib > 0:
        raise UserError(f"accel plan: --gpu-memory must be a positive number of GiB, got {gpu_memory_gib:g}")
    if gpus < 1:
        raise UserError(f"accel plan: --gpus must be at least 1, got {gpus}")
    name, flagship = flagship_of(model)
    family = FAMILIES[name]
    measure = measure_of(name, size or flagship.size, quant, vae_tiling)
    candidates, refused = [], []
    transformer = next(iter(measure.transformers.values()))
    heads = flagship_heads(name)
    # A flagship without text encoders (Cosmos 3's transformer embeds the prompt's token ids) has none to place.
    placements = [
        p
        for p in PLACEMENTS
        if (p != "sharded" or measure.shards_encoders(gpus)) and (p == "replicated" or measure.encoders)
    ]
    for cfg in (1, 2) if _runs_guidance(family) else (1,):
        for tp in _divisors(gpus // cfg) if gpus % cfg == 0 else []:
            problem = tp_problem(family, transformer, tp)
            if problem:
                refused.append(f"cfg {cfg} x tp {tp}: {problem}")
                continue
            # Ulysses and Ring for the ranks left, as `--gpus` alone chooses them in a run.
            degrees = resolve_degrees(ParallelSection(gpus=gpus, cfg=cfg, tp=tp), heads, name)
            not_split = variant_of(family, family.pipeline_class).not_split
            if degrees.sequence > 1 and not_split:  # Qwen-Image 2.1: its sequence is not cut
                refused.append(f"cfg {cfg} x tp {tp}: ulysses × ring {degrees.sequence}: {not_split}")
                continue
            candidates += [
                measure.candidate(degrees, placement, gpu_memory_gib, vae_parallel=vae_parallel)
                for placement in placements
            ]
    if gpus == 1:  # offload runs one process (accel.recipe.refusals.offload_refusal)
        candidates += [
            measure.candidate(Degrees(), placement, gpu_memory_gib, offload)
            for offload, placement in OFFLOADED
            if placement in placements
        ]
    # Measuring another decode of a long video takes minutes on fake CUDA (Wan's tiled decode: hundreds of
    # decoder calls): only where it alone can make a layout fit.
    candidates += [twin for c in list(candidates) for twin in _decode_twins(measure, c, gpu_memory_gib, vae_parallel)]
    return MemoryPlan(
        name,
        flagship,
        measure.size,
        quant,
        vae_tiling,
        gpus,
        int(gpu_memory_gib * GiB),
        tuple(candidates),
        tuple(refused),
    )


def _decode_twins(measure: Measure, candidate: Candidate, gpu_memory_gib: float, split_asked: bool) -> list[Candidate]:
    """`candidate` decoding another way, where only its whole decode keeps it from fitting: split over
    its ranks, in tiles, then both (`Candidate.decode_cost`), up to the first that fits."""
    estimate = candidate.estimate
    if candidate.fits or estimate.largest_phase != "VAE decode":
        return []
    rest = sum(estimate.weights.values()) + max(
        (v for k, v in estimate.working.items() if k != "VAE decode"), default=0
    )
    if rest + RESERVED > gpu_memory_gib * GiB:
        return []  # it does not fit for other reasons
    can_split = measure.splits_decode and candidate.degrees.world_size > 1
    split_asked = split_asked and can_split  # on one GPU [vae] parallel changes nothing
    twins = []
    for tiling, split in ((False, True), (True, False), (True, True)):  # by decode_cost
        possible = (can_split or not split) and (measure.tiles or not tiling)
        changes_something = tiling or split != split_asked
        if not possible or not changes_something or (split_asked and not split):  # an asked split stays
            continue
        twins.append(
            measure.candidate(
                candidate.degrees,
                candidate.text_encoder,
                gpu_memory_gib,
                candidate.offload,
                vae_tiling=tiling,
                vae_parallel=split,
            )
        )
        if twins[-1].fits:
            break
    return twins


def estimate_of(
    model: str,
    degrees: Degrees,
    placement: str,
    size: Size | None = None,
    offload: str = "none",
    gpu_memory_gib: float | None = None,
    quant: QuantSection = QuantSection(),
    vae_tiling: bool = False,
    vae_parallel: bool = False,
) -> Candidate:
    """One layout's busiest rank, as given (a layout the plan would not consider: Ring over heads that divide)."""
    return measure_of(model, size or FLAGSHIPS[model].size, quant, vae_tiling).candidate(
        degrees, placement, gpu_memory_gib, offload, vae_parallel=vae_parallel
    )
