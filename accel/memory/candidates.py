"""A candidate layout's busiest rank (its weights per component and the working memory of its largest
phase), and which candidate a plan picks: the fastest that fits, then the least per-job cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from accel.parallel.mesh import Degrees

GiB = 2**30
# Held on every GPU beside what the tracker sees: the CUDA context, cuBLAS / cuDNN workspaces, NCCL's
# buffers and the caching allocator's slack (about 1 GiB each of context and slack on an H100).
RESERVED = 2 * GiB
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


def fastest_fitting(candidates: tuple[Candidate, ...], gpu_memory: int) -> Candidate | None:
    """The fastest candidate whose peak fits `gpu_memory` bytes; at equal speed the least per-job cost
    (PREFERENCE), then the cheapest decode (`Candidate.decode_cost`), then the lowest peak. None: none fits."""
    fitting = [c for c in candidates if c.estimate.peak + RESERVED <= gpu_memory]
    return (
        max(fitting, key=lambda c: (round(c.speedup, 2), -c.preference, -c.decode_cost, -c.estimate.peak))
        if fitting
        else None
    )
