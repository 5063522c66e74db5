"""MagCache: skip whole transformer calls while the residual's magnitude is predicted to hold.

The ratio of the mean per-token norm of the blocks' residual (last block's output minus block 0's
input) between consecutive steps follows a curve that depends on the model and the schedule, not
on the prompt. `calibrate` measures that curve on one run (`accel tune RECIPE --calibrate` saves it
as `[cache] mag_ratios`); with it, each call multiplies the curve's ratio into an accumulated ratio
and adds |1 − accumulated| to an accumulated error, and skips every block (adding the last
computed residual) while that error stays under the threshold. A computed call resets both.

The decision reads the curve and the step only: every rank takes it alike with no exchange and no
host sync. Calibration reads one scalar per call (the norm, summed over the ranks' real tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from accel.cache.blocks import BlockCache, _BranchState
from accel.models.base import BlockList
from accel.steps import StepEvents


@dataclass
class _MagState(_BranchState):
    ratio: float = 1.0  # accumulated since the last computed call
    error: float = 0.0
    previous_norm: float | None = None  # calibration: the last computed call's mean residual norm


class MagCache(BlockCache):
    least_first_blocks = 0

    def __init__(
        self,
        transformer: nn.Module,
        block_lists: Sequence[BlockList],
        *,
        threshold: float,
        mag_ratios: Sequence[Sequence[float]] = (),
        calibrate: bool = False,
        warmup_steps: int = 0,
        max_consecutive_cached: int = 0,
        max_cached_steps: int = 0,
        primary_stream: str = "hidden_states",
        events: StepEvents | None = None,
        group: dist.ProcessGroup | None = None,
        real_tokens: Callable[[], int | None] | None = None,
    ) -> None:
        if not calibrate and not any(mag_ratios):
            raise ValueError(
                "magcache needs mag_ratios, this pipeline's per-step magnitude ratios (accel tune RECIPE --calibrate "
                "measures them)"
            )
        self.mag_ratios = [list(curve) for curve in mag_ratios]
        self.calibrate = calibrate
        self.recorded: list[tuple[int, int, float]] = []  # calibration: (branch, step, ratio) of each call
        self._num_steps = 0
        super().__init__(
            transformer,
            block_lists,
            threshold=threshold,
            first_blocks=0,
            last_blocks=0,
            warmup_steps=warmup_steps,
            max_consecutive_cached=max_consecutive_cached,
            max_cached_steps=max_cached_steps,
            primary_stream=primary_stream,
            events=events,
            group=group,
            real_tokens=real_tokens,
        )

    def new_state(self) -> _MagState:
        return _MagState(self._new_calibrator())

    def on_generation_start(self, num_steps: int) -> None:
        super().on_generation_start(num_steps)
        self._num_steps = num_steps
        if self.calibrate:
            self.recorded = []

    def curve_ratio(self, branch: int, step: int) -> float:
        """The calibrated ratio at `step` of a run of `_num_steps`; a curve measured over another step
        count is read at the same fraction of the schedule, interpolating linearly."""
        curve = self.mag_ratios[min(branch, len(self.mag_ratios) - 1)]
        steps = self._num_steps or len(curve)
        if steps == len(curve) or len(curve) == 1 or steps == 1:
            return curve[min(step, len(curve) - 1)]
        position = step * (len(curve) - 1) / (steps - 1)
        low = min(int(position), len(curve) - 2)
        return curve[low] + (curve[low + 1] - curve[low]) * (position - low)

    def _decide_at_start(self) -> bool:
        branch, state, step = self._position()
        assert isinstance(state, _MagState)
        if self.calibrate:
            return self._conclude(branch, state, step, None, False)
        state.ratio *= self.curve_ratio(branch, step)
        state.error += abs(1.0 - state.ratio)
        skipping = self._conclude(branch, state, step, state.error, state.error < self.threshold)
        if not skipping:
            state.ratio, state.error = 1.0, 0.0
        return skipping

    def _computed(self, spec: BlockList, final: dict[str, Any], start: dict[str, Any]) -> None:
        if not self.calibrate:
            return
        residual = self._primary(spec, final) - self._primary(spec, start)
        real = self.real_tokens() if self.real_tokens is not None else None
        if real is not None:
            residual = residual.narrow(-2, 0, real)
        norms = torch.linalg.vector_norm(residual.float(), dim=-1)
        sums = torch.stack([norms.sum(), torch.tensor(float(norms.numel()), device=norms.device)])
        if self.group is not None:
            dist.all_reduce(sums, group=self.group)
        norm = float((sums[0] / sums[1]).item())
        state = self._state
        assert isinstance(state, _MagState)
        branch = self.stats.records[-1].branch
        self.recorded.append((branch, self._step, 1.0 if state.previous_norm is None else norm / state.previous_norm))
        state.previous_norm = norm
