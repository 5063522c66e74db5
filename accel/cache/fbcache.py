"""First Block Cache: skip every block after the first while block 0's residual barely changes.

Each block's `forward` is replaced on the block *instance* (state_dict keys and classes stay as
they are). Block 0 always runs; its residual (output − input of the primary stream) is compared
with the one saved at the last fully computed call. When the relative change is below the
threshold the remaining blocks pass their inputs through untouched and the last one returns block
0's output plus the residual those blocks produced at the last computed call, stream by stream
(image and text); anything the transformer adds between blocks (ControlNet residuals) is part of
that residual.

A pipeline that calls the transformer twice per step (cond, uncond) gets one state per call
index within the step, so the two never compare against each other; batched CFG is one call and
so one decision. The decision is reduced over the process group first: every rank must take
the same branch or the next collective deadlocks.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from accel.instance import CACHE, wrap
from accel.models.base import BlockList
from accel.steps import StepEvents, StepListener


@dataclass(frozen=True)
class CallRecord:
    """One transformer call: where it was, how much block 0 moved, and whether it was cached."""

    step: int
    branch: int
    change: float | None
    cached: bool


@dataclass
class CacheStats:
    """Statistics of the last pipeline call (state and statistics reset at each call)."""

    records: list[CallRecord] = field(default_factory=list)

    @property
    def calls(self) -> int:
        return len(self.records)

    @property
    def cached(self) -> int:
        return sum(record.cached for record in self.records)

    @property
    def hit_rate(self) -> float:
        return self.cached / self.calls if self.calls else 0.0

    def __add__(self, other: CacheStats) -> CacheStats:
        return CacheStats(self.records + other.records)

    def as_dict(self) -> dict[str, Any]:
        return {
            "transformer_calls": self.calls,
            "cached_calls": self.cached,
            "hit_rate": self.hit_rate,
            "calls": [record.__dict__ for record in self.records],
        }


@dataclass
class _BranchState:
    first_residual: torch.Tensor | None = None
    rest_residuals: dict[str, torch.Tensor] | None = None
    consecutive_cached: int = 0
    calls: int = 0


@dataclass(frozen=True)
class _Slot:
    spec: BlockList
    signature: inspect.Signature


class FirstBlockCache(StepListener):
    """Installs itself on one transformer's blocks; `remove()` puts the original forwards back."""

    def __init__(
        self,
        transformer: nn.Module,
        block_lists: Sequence[BlockList],
        *,
        threshold: float,
        warmup_steps: int = 0,
        max_consecutive_cached: int = 0,
        primary_stream: str = "hidden_states",
        events: StepEvents | None = None,
        group: dist.ProcessGroup | None = None,
        real_tokens: Callable[[], int | None] | None = None,
    ) -> None:
        self.threshold = threshold
        self.warmup_steps = warmup_steps
        self.max_consecutive_cached = max_consecutive_cached
        self.primary_stream = primary_stream
        self.events = events
        # Ranks that share one sequence (None: decide alone), and how many of this rank's tokens of
        # the primary stream are real (they lead; padding follows), so a parallel run sums what one
        # process would.
        self.group = group
        self.real_tokens = real_tokens
        self.stats = CacheStats()
        self._calls_marked = False  # begin_call marks where each pipeline call starts
        self._states: dict[int, _BranchState] = {}
        self._calls_in_step = 0
        self._branch = 0
        self._skipping = False
        self._start: dict[str, Any] = {}
        self._state = _BranchState()
        self._undo: list[Callable[[], None]] = []

        blocks = [(spec, block) for spec in block_lists for block in getattr(transformer, spec.attr)]
        if len(blocks) < 2:
            raise ValueError("First Block Cache needs a transformer with at least two blocks")
        first, last = block_lists[0], block_lists[-1]
        if primary_stream not in first.returns or not set(last.returns) <= set(first.returns):
            raise ValueError(
                f"block lists {[s.attr for s in block_lists]}: the first must return "
                f"'{primary_stream}' and every stream the last one returns"
            )
        for index, (spec, block) in enumerate(blocks):
            self._wrap(block, spec, first=index == 0, last=index == len(blocks) - 1)
        # Branches are counted per transformer call, not per block-0 run: under CFG parallelism a
        # rank skips the other half's call, and its calls must keep their single-process index.
        self._undo.append(transformer.register_forward_pre_hook(lambda *_: self._count_call()).remove)
        if events is not None:
            events.add(self)

    # -- step events -------------------------------------------------------------------------
    def on_generation_start(self, num_steps: int) -> None:
        self._states.clear()
        if not self._calls_marked:  # else a schedule restarted within one call (segments) keeps its statistics
            self.stats = CacheStats()
        self._calls_in_step = 0

    def begin_call(self) -> None:
        """A pipeline call starts: statistics start afresh here, and cover every schedule it runs."""
        self.stats = CacheStats()
        self._calls_marked = True

    def _count_call(self) -> None:
        self._branch = self._calls_in_step
        self._calls_in_step += 1

    def on_step_end(self, step_index: int) -> None:
        self._calls_in_step = 0

    # -- install / remove --------------------------------------------------------------------
    def _wrap(self, block: nn.Module, spec: BlockList, *, first: bool, last: bool) -> None:
        slot = _Slot(spec, inspect.signature(block.forward))

        def forward(call_next: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            if first:
                return self._first_block(call_next, slot, args, kwargs)
            return self._later_block(call_next, slot, args, kwargs, last)

        # This block only, not its class; outside any compiled forward (CACHE wraps COMPILE).
        self._undo.append(wrap(block, "forward", "accel.cache", CACHE, forward))

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()
        if self.events is not None:
            self.events.remove(self)
            self.events = None

    # -- the two kinds of block --------------------------------------------------------------
    def _first_block(self, original: Callable[..., Any], slot: _Slot, args: Any, kwargs: Any) -> Any:
        before = slot.signature.bind(*args, **kwargs).arguments[self.primary_stream]
        output = original(*args, **kwargs)
        after = _streams(slot.spec, output)
        self._skipping = self._decide(after[self.primary_stream] - before)
        self._start = after
        return output

    @torch.compiler.disable
    def _decide(self, residual: torch.Tensor) -> bool:
        """Skip the later blocks this call? Kept out of compiled code (whole-transformer compile):
        it reads tensor values and step counters, which a graph would have to guard on."""
        branch = self._branch if self.events is not None else 0
        state = self._states.setdefault(branch, _BranchState())
        step = self.events.step_index if self.events is not None else state.calls
        state.calls += 1
        change = None
        if state.first_residual is not None and state.first_residual.shape == residual.shape:
            change = self._relative_change(residual, state.first_residual)
        skipping = (
            change is not None
            and change < self.threshold
            and state.rest_residuals is not None
            and step >= self.warmup_steps
            and (self.max_consecutive_cached == 0 or state.consecutive_cached < self.max_consecutive_cached)
        )
        self.stats.records.append(CallRecord(step, branch, change, skipping))
        if skipping:
            state.consecutive_cached += 1
        else:
            state.consecutive_cached = 0
            state.first_residual = residual
        self._state = state
        return skipping

    def _later_block(self, original: Callable[..., Any], slot: _Slot, args: Any, kwargs: Any, last: bool) -> Any:
        if not self._skipping:
            output = original(*args, **kwargs)
            if last:
                final = _streams(slot.spec, output)
                start = self._start_as(slot.spec)
                self._state.rest_residuals = {
                    name: final[name] - start[name]
                    for name in slot.spec.returns
                    if isinstance(final[name], torch.Tensor) and isinstance(start.get(name), torch.Tensor)
                }
            return output
        inputs = slot.signature.bind(*args, **kwargs).arguments
        values = [inputs[name] for name in slot.spec.returns]
        if last:
            # From the first block's output, not this block's input: what the transformer added
            # between the skipped blocks (a ControlNet's per-block residuals) is already in the
            # stored residual, and would otherwise count twice.
            cached, start = self._state.rest_residuals or {}, self._start_as(slot.spec)
            values = [
                start[name] + cached[name] if name in cached else value
                for name, value in zip(slot.spec.returns, values)
            ]
        return values[0] if len(values) == 1 else tuple(values)

    def _start_as(self, spec: BlockList) -> dict[str, Any]:
        """The first block's output streams as `spec`'s blocks see them (joined where the
        transformer joins them)."""
        if spec.joins:
            return {spec.returns[0]: torch.cat([self._start[name] for name in spec.joins], dim=1)}
        return self._start

    def _relative_change(self, residual: torch.Tensor, previous: torch.Tensor) -> float:
        """mean|r − r_prev| / mean|r_prev| over every rank's shard (sums make unequal shards exact).

        The one host synchronisation of a cached transformer call: a single scalar read, after the
        reduction, for the decision every rank must take alike."""
        real = self.real_tokens() if self.real_tokens is not None else None
        if real is not None:  # tokens along dim -2, as every family's block streams hold them
            residual, previous = residual.narrow(-2, 0, real), previous.narrow(-2, 0, real)
        sums = torch.stack([
            torch.sum(torch.abs(residual - previous), dtype=torch.float32),
            torch.sum(torch.abs(previous), dtype=torch.float32),
        ])
        if self.group is not None:
            dist.all_reduce(sums, group=self.group)
        ratio = torch.where(sums[1] > 0, sums[0] / sums[1], torch.full_like(sums[0], float("inf")))
        return float(ratio.item())


def _streams(spec: BlockList, output: Any) -> dict[str, Any]:
    values = output if isinstance(output, tuple) else (output,)
    return dict(zip(spec.returns, values))

