"""Patch-parallel VAE decode: every rank decodes a band of latent rows, and the pixels meet on rank 0.

Each call of the VAE's `decoder` (once per image, per tile under tiling, per frame batch for the
video VAEs) is split afresh, so slicing, tiling and frame-by-frame decoding work unchanged and
the result equals the single-process decode, not a blend of tiles. Per-call state a decoder
keeps between calls (causal convolution caches) holds this rank's rows and stays local.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from accel.errors import UserError
from accel.hooks import VAE, wrap
from accel.models.vaes import VAE_PLANS, VaePlan, vae_plan_of
from accel.parallel.agree import rank0_object
from accel.parallel.comm import global_rank
from accel.parallel.outputs import map_sample
from accel.parallel.matching import glob_modules
from accel.vae.exchange import gather_rows
from accel.vae.functions import SplitDecode, WholeRegion
from accel.vae.rows import RowSplit


def plan_for(vae: Any) -> VaePlan:
    """The plan of this VAE's class (or the nearest supported base class), or a one-line refusal."""
    plan = vae_plan_of(vae)
    if plan is not None:
        return plan
    raise UserError(
        f"[vae] parallel: accel has no parallel decode for {type(vae).__name__} "
        f"(it has for {', '.join(VAE_PLANS)}); set parallel = false"
    )


def _draws_noise(vae: Any, plan: VaePlan) -> bool:
    """Whether this VAE instance's decoder adds spatial noise (its config switch, per the plan)."""
    if plan.noise_rows is None:
        return False
    value = getattr(getattr(vae, "config", None), plan.noise_rows, None)
    return any(value) if isinstance(value, (list, tuple)) else bool(value)


class ParallelDecode:
    """Puts one VAE's decoder under the row split on the ranks of `group`; `remove()` undoes it.

    `all_ranks`: every rank gets the decoded pixels. Otherwise only global rank 0 does and the
    others get zeros of the same shape, so the pipeline's post-processing still runs everywhere."""

    def __init__(
        self, vae: Any, plan: VaePlan, group: dist.ProcessGroup | None = None, all_ranks: bool = False
    ) -> None:
        decoder = getattr(vae, "decoder", None)
        if not isinstance(decoder, torch.nn.Module):
            raise UserError(
                f"[vae] parallel: {type(vae).__name__} has no `decoder` module to split; set parallel = false"
            )
        self.plan = plan
        self.group = group
        self.all_ranks = all_ranks
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.calls = 0  # decoder calls split so far, for reports and tests
        self.noise = _draws_noise(vae, plan)
        self._mode: SplitDecode | None = None
        self._undo: list[Callable[[], None]] = []
        modules = dict(decoder.named_modules())
        for pattern in plan.whole:
            for module in glob_modules(modules, pattern):
                self._undo.append(module.register_forward_pre_hook(self._enter_whole, with_kwargs=True).remove)
                self._undo.append(module.register_forward_hook(self._leave_whole).remove)
        self._undo.append(wrap(decoder, "forward", "accel.parallel_decode", VAE, self._decode))

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _decode(self, original: Callable[..., Any], latents: Tensor, *args: Any, **kwargs: Any) -> Any:
        rows = latents.shape[-2]
        if latents.dim() not in (4, 5) or rows < self.world:  # too few rows to share: every rank decodes all
            return original(latents, *args, **kwargs)
        split = RowSplit(rows, self.world, self.rank)
        start, stop = split.span(1)
        if self.noise:
            self._agree_on_random_state(latents.device)
        self._mode = SplitDecode(split, self.group, self.noise)
        try:
            with self._mode:
                output = original(latents[..., start:stop, :], *args, **kwargs)
        finally:
            self._mode = None
        self.calls += 1
        return map_sample(output, lambda sample: self._collect(sample, split))

    def _agree_on_random_state(self, device: torch.device) -> None:
        """Noise the decoder draws from the global generator is drawn whole on every rank and cut, so
        every rank must start from the same state: rank 0's, as if it decoded alone."""
        if device.type == "cuda":
            torch.cuda.set_rng_state(rank0_object(torch.cuda.get_rng_state(device), self.group), device)
        else:
            torch.set_rng_state(rank0_object(torch.get_rng_state(), self.group))

    def _collect(self, sample: Tensor, split: RowSplit) -> Tensor:
        to = None if self.all_ranks else global_rank(self.group, 0)
        whole = gather_rows(sample, split, self.group, to)
        if whole is not None:
            return whole
        rows = split.rows * split.scale_of_local(sample.shape[-2])
        return sample.new_zeros((*sample.shape[:-2], rows, sample.shape[-1]))

    # -- modules that see every position ------------------------------------------------------
    def _enter_whole(self, _module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        mode = self._mode
        if mode is None or not args or not isinstance(args[0], Tensor):
            return None
        whole = gather_rows(args[0], mode.split, self.group, to=None)
        assert whole is not None
        mode.regions.append(WholeRegion(whole.shape[-2], whole.shape[-1], mode.split))
        return (whole, *args[1:]), kwargs

    def _leave_whole(self, _module: Any, _args: Any, output: Any) -> Any:
        mode = self._mode
        if mode is None or not mode.regions:
            return None
        start, stop = mode.regions.pop().own
        return map_sample(output, lambda sample: sample[..., start:stop, :].contiguous())
