"""The measures of one model at one size that a plan's candidates share, and each candidate's busiest
rank built from them (accel/memory/weights.py, working.py and flops.py measure; this module adds them up
per layout, placement, offload and decode).
"""

from __future__ import annotations

import functools

from accel.memory.build import build
from accel.memory.candidates import RESERVED, Candidate, GiB, RankEstimate
from accel.memory.flops import transformer_flops
from accel.memory.speed import expected_speedup, group_offload_speedup
from accel.memory.weights import offload_groups, parameter_bytes, sharded_encoder_bytes, weight_bytes
from accel.memory.working import transformer_working, vae_working
from accel.models.flagships import FLAGSHIPS, Size
from accel.models.registry import FAMILIES
from accel.models.vaes import vae_plan_of
from accel.parallel.mesh import Degrees
from accel.recipe.sections import QuantSection


@functools.lru_cache(maxsize=4)
def measure_of(model: str, size: Size, quant: QuantSection, vae_tiling: bool) -> Measure:
    """One measure per model, size, quantization and decode for the process: plans of other GPU counts and cards reuse
    it."""
    return Measure(model, size, quant, vae_tiling)


class Measure:
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
        """Model offload moves each component once per job (no cost per step); group offload copies every
        block of the largest transformer each call (accel/memory/speed.py)."""
        if offload == "model":
            return 1.0
        copied = max(sum(sizes.values()) for sizes in self.parameters(1).values())
        return group_offload_speedup(self.flops, copied, gpu_memory_gib)
