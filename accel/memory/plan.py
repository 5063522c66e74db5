"""`accel plan`: which layouts of a model fit N GPUs of a given memory, and the fastest that does.

Each candidate is a set of degrees over all N GPUs: CFG halves (families that run guidance), then a
TP degree that splits every planned width, then the largest Ulysses degree the TP rank's heads allow
with Ring for the rest (accel's own preference for sequence ranks). Its busiest rank's peak is
measured by accel/memory/weights.py and working.py; it fits when that peak plus RESERVED is within the card.

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
import functools
import math
from dataclasses import dataclass, field

from accel.errors import UserError
from accel.memory.build import build
from accel.memory.flops import transformer_flops
from accel.memory.weights import offload_groups, parameter_bytes, sharded_encoder_bytes, tp_problem, weight_bytes
from accel.memory.working import transformer_working, vae_working
from accel.models.base import Family
from accel.models.flagships import FLAGSHIPS, Flagship, Size, flagship_heads
from accel.models.registry import FAMILIES
from accel.models.vaes import vae_plan_of
from accel.models.variants import variant_of
from accel.parallel.mesh import Degrees, resolve_degrees
from accel.recipe.sections import ParallelSection, QuantSection

GiB = 2**30
# Held on every GPU beside what the tracker sees: the CUDA context, cuBLAS / cuDNN workspaces, NCCL's
# buffers and the caching allocator's slack (about 1 GiB each of context and slack on an H100).
RESERVED = 2 * GiB
# Step-time efficiency of each parallel dimension per doubling, for ordering layouts that fit: from
# this repo's measurements (BENCHMARKS.md: Ulysses 0.97-1.0 and Ring 0.83-0.95 of ideal per rank on
# H100 at video lengths; TP 0.84-1.06x of Ulysses on CPU ranks; CFG halves independent).
EFFICIENCY = {"cfg": 0.98, "ulysses": 0.95, "ring": 0.85, "tp": 0.85}


# Where the text encoders can live ([memory] text_encoder): on the GPU ("replicated" and "rank0" both
# put them on the busiest rank), split over the layout's ranks by transformers' plan ("sharded": more
# than one GPU, encoders that have a plan), or in host memory ("cpu"), which costs CPU time per prompt.
PLACEMENTS = ("replicated", "sharded", "cpu")
# One GPU's offloaded layouts: (offload, text encoders' place). Model offload with the encoders in host
# memory is what model offload already does between uses.
OFFLOADED = (("model", "replicated"), ("group", "replicated"), ("group", "cpu"))
# At equal expected step speed, the layout with the least per-job cost wins: encoders on the GPU, then
# model offload (each component's weights cross PCIe once per job: seconds), then encoding on the CPU
# (a multi-billion-parameter encoder costs tens of seconds per prompt there).
PREFERENCE = (
    ("none", "replicated"),
    ("none", "sharded"),
    ("model", "replicated"),
    ("group", "replicated"),
    ("none", "cpu"),
    ("group", "cpu"),
)


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


@dataclass(frozen=True)
class RankEstimate:
    """What the busiest rank (rank 0) of a layout holds: weights per component, and the working memory
    of the largest phase on top of them."""

    weights: dict[str, int]
    working: dict[str, int] = field(default_factory=dict)  # phase ("transformer forward", "VAE decode") → bytes

    @property
    def peak(self) -> int:
        return sum(self.weights.values()) + max(self.working.values(), default=0)

    @property
    def largest_phase(self) -> str | None:
        return max(self.working, key=lambda phase: self.working[phase]) if self.working else None


@dataclass(frozen=True)
class Candidate:
    degrees: Degrees
    estimate: RankEstimate
    fits: bool
    speedup: float  # expected step speed against one GPU that holds the whole model
    text_encoder: str = "replicated"
    offload: str = "none"
    vae_tiling: bool = False  # the decode in tiles
    vae_parallel: bool = False  # the decode's rows split over the layout's ranks

    def describe(self) -> str:
        offload = {"none": "", "model": ", model offload", "group": ", group offload"}[self.offload]
        encoders = {"replicated": "", "sharded": ", text encoders sharded", "cpu": ", text encoders on the CPU"}[
            self.text_encoder
        ]
        decode = {
            (False, False): "",
            (False, True): ", VAE split over the ranks",
            (True, False): ", VAE in tiles",
            (True, True): ", VAE in tiles split over the ranks",
        }[self.vae_tiling, self.vae_parallel]
        return self.degrees.describe() + offload + encoders + decode

    @property
    def decode_cost(self) -> int:
        """At equal speed: the whole decode, then split over the ranks (same pixels, exchanges rows), then
        in tiles (blended seams, a little time per job), then both."""
        return 2 * self.vae_tiling + self.vae_parallel

    @property
    def preference(self) -> int:
        return PREFERENCE.index((self.offload, self.text_encoder))


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


def fastest_fitting(candidates: tuple[Candidate, ...], gpu_memory: int) -> Candidate | None:
    """The fastest candidate whose peak fits `gpu_memory` bytes; at equal speed the least per-job cost
    (PREFERENCE), then the cheapest decode (`Candidate.decode_cost`), then the lowest peak. None: none fits."""
    fitting = [c for c in candidates if c.estimate.peak + RESERVED <= gpu_memory]
    return (
        max(fitting, key=lambda c: (round(c.speedup, 2), -c.preference, -c.decode_cost, -c.estimate.peak))
        if fitting
        else None
    )


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
    measure = _measure(name, size or flagship.size, quant, vae_tiling)
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


def _decode_twins(measure: _Measure, candidate: Candidate, gpu_memory_gib: float, split_asked: bool) -> list[Candidate]:
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
    return _measure(model, size or FLAGSHIPS[model].size, quant, vae_tiling).candidate(
        degrees, placement, gpu_memory_gib, offload, vae_parallel=vae_parallel
    )


@functools.lru_cache(maxsize=4)
def _measure(model: str, size: Size, quant: QuantSection, vae_tiling: bool) -> _Measure:
    """One measure per model, size, quantization and decode for the process: plans of other GPU counts and cards reuse
    it."""
    return _Measure(model, size, quant, vae_tiling)


class _Measure:
    """The measures a plan shares across its candidates: the transformers built on meta once, weights
    per component, the VAE decode once, the forward once per (tp, ulysses, ring)."""

    def __init__(self, model: str, size: Size, quant: QuantSection, vae_tiling: bool) -> None:
        self.family, self.flagship, self.size, self.quant = FAMILIES[model], FLAGSHIPS[model], size, quant
        self.transformers = {c.attr: build(c) for c in self.flagship.of_kind("transformer")}
        self.encoders = {
            c.attr: build(c) for c in self.flagship.of_kind("text_encoder")
        }  # on meta: for the split's checks
        self.others = {
            c.attr: weight_bytes(self.encoders[c.attr] if c.attr in self.encoders else build(c))
            for c in self.flagship.components
            if not c.attr.startswith("transformer")
        }
        self.vae_tiling = vae_tiling
        self.vae = {
            (vae_tiling, 1): vae_working(self.flagship, size, tiling=vae_tiling)
        }  # (tiled, ranks) → working bytes
        vae = build(self.flagship.of_kind("vae")[0])
        # Whether tiling is a choice the plan has (the recipe did not ask for it and the VAE can tile), and
        # splitting the decode over the ranks (accel has a row split for the VAE's class).
        self.tiles = not vae_tiling and hasattr(vae, "enable_tiling")
        self.splits_decode = vae_plan_of(vae) is not None
        self.working: dict[tuple[int, int, int], int] = {}
        self.split: dict[int, dict[str, dict[str, int]]] = {}  # tp → transformer → parameter → bytes on a rank
        self._flops: int | None = None
        self._sharded: dict[int, dict[str, int]] = {}

    def vae_decode(self, tiled: bool, ranks: int = 1) -> int:
        """The decode's working bytes on rank 0, whole or in tiles, on one rank or split over `ranks`
        (each measured when a plan first needs it)."""
        key = (tiled or self.vae_tiling, ranks)
        if key not in self.vae:
            self.vae[key] = vae_working(self.flagship, self.size, tiling=key[0], ranks=ranks)
        return self.vae[key]

    def forward_working(self, degrees: Degrees) -> int:
        key = (degrees.tp, degrees.ulysses, degrees.ring)
        if key not in self.working:
            self.working[key] = transformer_working(self.family, self.flagship, self.size, degrees)
        return self.working[key]

    @property
    def flops(self) -> int:
        if self._flops is None:
            self._flops = transformer_flops(self.flagship, self.size)
        return self._flops

    def sharded(self, ranks: int) -> dict[str, int]:
        """Each text encoder's bytes on a rank when "sharded" splits them over `ranks` (whole: no plan)."""
        if ranks not in self._sharded:
            split = {c.attr: sharded_encoder_bytes(c, ranks) for c in self.flagship.of_kind("text_encoder")}
            self._sharded[ranks] = {attr: self.others[attr] if size is None else size for attr, size in split.items()}
        return self._sharded[ranks]

    def shards_encoders(self, ranks: int) -> bool:
        """Whether "sharded" splits any encoder over `ranks` (a run refuses it where it splits none or
        an encoder's heads do not divide)."""
        if ranks < 2:
            return False
        from accel.parallel.encoders import heads_problem, tp_plan_of

        planned = [e for e in self.encoders.values() if tp_plan_of(e)]
        return bool(planned) and all(heads_problem(e, ranks) is None for e in planned)

    def parameters(self, tp: int) -> dict[str, dict[str, int]]:
        if tp not in self.split:
            self.split[tp] = {
                attr: parameter_bytes(self.family, model, tp, self.quant) for attr, model in self.transformers.items()
            }
        return self.split[tp]

    def candidate(
        self,
        degrees: Degrees,
        placement: str,
        gpu_memory_gib: float | None,
        offload: str = "none",
        vae_tiling: bool = False,
        vae_parallel: bool = False,
    ) -> Candidate:
        """One layout's busiest rank; `vae_tiling`: decoding in tiles where the recipe did not ask for it;
        `vae_parallel`: the decode split over the layout's ranks."""
        tiling = vae_tiling or self.vae_tiling
        decode_split = vae_parallel and degrees.world_size > 1
        if offload != "none":
            return self._offloaded(placement, gpu_memory_gib, offload, tiling)
        split = {attr: sum(sizes.values()) for attr, sizes in self.parameters(degrees.tp).items()}
        held = dict(self.others)
        if placement == "cpu":
            held |= {attr: 0 for attr in held if attr.startswith("text_encoder")}
        elif placement == "sharded":
            held |= self.sharded(degrees.world_size)
        decode = self.vae_decode(tiling, degrees.world_size if decode_split else 1)
        estimate = RankEstimate(
            split | held, {"transformer forward": self.forward_working(degrees), "VAE decode": decode}
        )
        fits = gpu_memory_gib is None or estimate.peak + RESERVED <= gpu_memory_gib * GiB
        return Candidate(
            degrees, estimate, fits, expected_speedup(degrees), placement, vae_tiling=tiling, vae_parallel=decode_split
        )

    def _offloaded(self, placement: str, gpu_memory_gib: float | None, offload: str, tiling: bool) -> Candidate:
        """One process under diffusers' offloading: nothing stays on the GPU; each phase holds what it runs
        on (model: the whole component; group: the transformer's non-block weights and two blocks, the one
        running and the one prefetched) plus its working memory. The encoders, which have no block list
        diffusers' group offload streams, move whole in both modes; "cpu" keeps them in host memory."""
        encoders = [size for attr, size in self.others.items() if attr.startswith("text_encoder")]
        vae = sum(size for attr, size in self.others.items() if attr.startswith("vae"))
        sizes = self.parameters(1)
        if offload == "model":
            transformer = max(sum(sizes[attr].values()) for attr in self.transformers)
        else:
            groups = [offload_groups(model, sizes[attr]) for attr, model in self.transformers.items()]
            transformer = max(outside + 2 * block for outside, block in groups)
        working = {
            "text encode": 0 if placement == "cpu" else max(encoders, default=0),
            "transformer forward": transformer + self.forward_working(Degrees()),
            "VAE decode": vae + self.vae_decode(tiling),
        }
        estimate = RankEstimate({attr: 0 for attr in [*self.transformers, *self.others]}, working)
        fits = gpu_memory_gib is None or estimate.peak + RESERVED <= gpu_memory_gib * GiB
        return Candidate(
            Degrees(), estimate, fits, self._offload_speed(offload, gpu_memory_gib), placement, offload, tiling
        )

    def _offload_speed(self, offload: str, gpu_memory_gib: float | None) -> float:
        """Group offload's step against one GPU holding everything: each call's arithmetic overlaps the
        copy of every block's weights on a side stream, so the slower of the two sets the pace."""
        if offload == "model":
            return 1.0
        card = card_for(gpu_memory_gib if gpu_memory_gib is not None else 0)
        compute = self.flops / card.flops_per_second
        copy = max(sum(sizes.values()) for sizes in self.parameters(1).values()) / card.pcie_bytes_per_second
        return compute / max(compute, copy)
