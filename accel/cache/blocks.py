"""The block cache installer: DBCache's split of a transformer's blocks, with First Block Cache as
its `first_blocks = 1, last_blocks = 0` case.

The blocks, counted across the family's block lists in the order the transformer runs them, play
one of three roles on each call:

- head (the first Fn): always run. Their residual on the primary stream (output of block Fn − 1
  minus the input of block 0) is compared with the one saved at the branch's last fully computed
  call; a relative change below the threshold makes this call a cached one.
- middle: on a computed call they run and the last one saves their residual (its output minus
  the head's output), stream by stream. On a cached call they pass their inputs through, and the
  last one returns the head's output plus the residual the calibrator gives for this step (the
  saved one, or TaylorSeer's extrapolation). Anything the transformer adds between middle blocks
  (ControlNet residuals) is part of that residual.
- tail (the last Bn): always run, on whatever the middle returned.

Each block's `forward` is replaced on the block *instance* (state_dict keys and classes stay as
they are). A pipeline that calls the transformer twice per step (cond, uncond) gets one state per
call index within the step, so the two never compare against each other; batched CFG is one call
and so one decision. The change is reduced over the process group first: every rank must take the
same branch or the next collective deadlocks, and every other input to the decision (step, counts
of cached calls) is the same on every rank by construction.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self

import torch
import torch.distributed as dist
from torch import nn

from accel.cache.calibrate import Calibrator, Reuse, TaylorSeer
from accel.cache.calls import CacheSite, StepCache
from accel.cache.stats import CallRecord
from accel.hooks import CACHE, wrap
from accel.models.base import BlockList
from accel.models.parts import listed_blocks
from accel.steps import StepEvents

if TYPE_CHECKING:
    from accel.cache.config import DecidingConfig


@dataclass
class _BranchState:
    calibrator: Calibrator
    head_residual: torch.Tensor | None = None
    computed: bool = False  # a middle residual exists to stand in for the skipped blocks
    consecutive_cached: int = 0
    cached: int = 0
    calls: int = 0


@dataclass(frozen=True)
class _Slot:
    spec: BlockList
    signature: inspect.Signature
    role: str  # "head", "middle" or "tail"
    first: bool  # block 0
    head_end: bool  # the last head block: the decision is taken after it
    middle_end: bool  # the last middle block: the residual is saved or added here


@dataclass
class _Call:
    """What one transformer call has seen so far."""

    skipping: bool = False
    before: dict[str, Any] = field(default_factory=dict)  # block 0's input streams
    start: dict[str, Any] = field(default_factory=dict)  # the head's output streams
    start_spec: BlockList | None = None


class BlockCache(StepCache[_BranchState]):
    """Installs itself on one transformer's blocks; `remove()` puts the original forwards back.

    A subclass that decides before any block runs (MagCache, from a calibrated curve) sets
    `least_first_blocks = 0` and overrides `_decide_at_start`."""

    least_first_blocks = 1

    def __init__(
        self,
        transformer: nn.Module,
        block_lists: Sequence[BlockList],
        *,
        threshold: float,
        first_blocks: int = 1,
        last_blocks: int = 0,
        calibrator: str = "none",
        taylor_order: int = 1,
        warmup_steps: int = 0,
        max_consecutive_cached: int = 0,
        max_cached_steps: int = 0,
        primary_stream: str = "hidden_states",
        events: StepEvents | None = None,
        group: dist.ProcessGroup | None = None,
        real_tokens: Callable[[], int | None] | None = None,
    ) -> None:
        blocks = listed_blocks(transformer, block_lists)
        if first_blocks < self.least_first_blocks:
            raise ValueError(
                f"first_blocks must be at least {self.least_first_blocks} (the decision reads their residual), got "
                f"{first_blocks}"
            )
        if last_blocks < 0:
            raise ValueError(f"last_blocks must be 0 or more, got {last_blocks}")
        if first_blocks + last_blocks >= len(blocks):
            raise ValueError(
                f"the transformer has {len(blocks)} blocks: first_blocks ({first_blocks}) + last_blocks "
                f"({last_blocks}) must leave at least one to cache"
            )
        first, last = block_lists[0], block_lists[-1]
        if primary_stream not in first.returns or not set(last.returns) <= set(first.returns):
            raise ValueError(
                f"block lists {[s.attr for s in block_lists]}: the first must return "
                f"'{primary_stream}' and every stream the last one returns"
            )
        if calibrator not in ("none", "taylorseer"):
            raise ValueError(f"calibrator must be 'none' or 'taylorseer', got {calibrator!r}")
        if calibrator == "taylorseer":
            TaylorSeer(taylor_order)  # an order it cannot use fails here, not at the first cached call
        self._new_calibrator: Callable[[], Calibrator] = (
            Reuse if calibrator == "none" else lambda: TaylorSeer(taylor_order)
        )
        self.threshold = threshold
        self.first_blocks = first_blocks
        self.last_blocks = last_blocks
        self.warmup_steps = warmup_steps
        self.max_consecutive_cached = max_consecutive_cached
        self.max_cached_steps = max_cached_steps
        self.primary_stream = primary_stream
        # Ranks that share one sequence (None: decide alone), and how many of this rank's tokens of
        # the primary stream are real (they lead; padding follows), so a parallel run sums what one
        # process would.
        self.group = group
        self.real_tokens = real_tokens
        self._call = _Call()
        self._state = self.new_state()
        self._step = 0
        super().__init__(transformer, events)
        middle_end = len(blocks) - last_blocks - 1
        for index, (spec, block) in enumerate(blocks):
            role = "head" if index < first_blocks else "middle" if index <= middle_end else "tail"
            slot = _Slot(
                spec, inspect.signature(block.forward), role, index == 0, index == first_blocks - 1, index == middle_end
            )
            self._wrap(block, slot)

    @classmethod
    def install(cls, site: CacheSite, config: DecidingConfig) -> Self:
        """The method `config` names on `site`, its fields as keywords (dbcache, fbcache, magcache)."""
        return cls(
            site.transformer,
            site.block_lists,
            **config.keywords(),
            primary_stream=site.primary_stream,
            events=site.events,
            group=site.group,
            real_tokens=site.real_tokens,
        )

    def new_state(self) -> _BranchState:
        return _BranchState(self._new_calibrator())

    # -- install / remove --------------------------------------------------------------------
    def _wrap(self, block: nn.Module, slot: _Slot) -> None:
        def forward(call_next: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            if slot.role == "head":
                return self._head_block(call_next, slot, args, kwargs)
            if slot.role == "middle":
                if slot.first:  # no head: the call is decided before block 0
                    self._start_call(slot, args, kwargs)
                return self._middle_block(call_next, slot, args, kwargs)
            return call_next(*args, **kwargs)

        # This block only, not its class; outside any compiled forward (CACHE wraps COMPILE).
        self._undo.append(wrap(block, "forward", "accel.cache", CACHE, forward))

    # -- the roles ---------------------------------------------------------------------------
    def _head_block(self, original: Callable[..., Any], slot: _Slot, args: Any, kwargs: Any) -> Any:
        if slot.first:
            bound = slot.signature.bind(*args, **kwargs).arguments
            self._call = _Call(before={name: bound[name] for name in slot.spec.returns})
        output = original(*args, **kwargs)
        if slot.head_end:
            after = _streams(slot.spec, output)
            self._call.start, self._call.start_spec = after, slot.spec
            before = self._call.before[self.primary_stream]
            self._call.skipping = self._decide(self._primary(slot.spec, after) - before)
        return output

    def _start_call(self, slot: _Slot, args: Any, kwargs: Any) -> None:
        bound = slot.signature.bind(*args, **kwargs).arguments
        before = {name: bound[name] for name in slot.spec.returns}
        self._call = _Call(before=before, start=before, start_spec=slot.spec)
        self._call.skipping = self._decide_at_start()

    def _decide_at_start(self) -> bool:
        raise NotImplementedError("a cache without head blocks decides before block 0")

    def _computed(self, spec: BlockList, final: dict[str, Any], start: dict[str, Any]) -> None:
        """A computed call's middle ended with `final` from `start`, both `spec`'s streams (a subclass may measure
        it)."""

    def _primary(self, spec: BlockList, streams: dict[str, Any]) -> torch.Tensor:
        """The primary stream out of `spec`'s streams: its own tensor, or its stretch of a joined
        one (FLUX.2's single blocks run on text then image), cut by block 0's input lengths."""
        if self.primary_stream not in spec.joins:
            return streams[self.primary_stream]
        joined = streams[spec.returns[0]]
        offset = 0
        for name in spec.joins:
            length = self._call.before[name].shape[1]
            if name == self.primary_stream:
                return joined.narrow(1, offset, length)
            offset += length
        raise AssertionError("unreachable: the primary stream is one of the joins")

    @torch.compiler.disable
    def _decide(self, residual: torch.Tensor) -> bool:
        """Skip the middle blocks this call? Kept out of compiled code (whole-transformer compile):
        it reads tensor values and step counters, which a graph would have to guard on."""
        branch, state, step = self._position()
        change = None
        if state.head_residual is not None and state.head_residual.shape == residual.shape:
            change = self._relative_change(residual, state.head_residual)
        skipping = self._conclude(branch, state, step, change, change is not None and change < self.threshold)
        if not skipping:
            state.head_residual = residual
        return skipping

    def _position(self) -> tuple[int, _BranchState, int]:
        """This call's branch, its state and its step (the call count without step events)."""
        branch, state = self.branch_state()
        step = self.events.step_index if self.events is not None else state.calls
        state.calls += 1
        return branch, state, step

    def _conclude(self, branch: int, state: _BranchState, step: int, change: float | None, below: bool) -> bool:
        """The decision once the method's own rule says `below`: only with a computed residual to
        stand in, past the warm-up and within the limits; recorded and counted for the branch."""
        skipping = (
            below
            and state.computed
            and step >= self.warmup_steps
            and (self.max_consecutive_cached == 0 or state.consecutive_cached < self.max_consecutive_cached)
            and (self.max_cached_steps == 0 or state.cached < self.max_cached_steps)
        )
        self.stats.records.append(CallRecord(step, branch, change, skipping))
        if skipping:
            state.consecutive_cached += 1
            state.cached += 1
        else:
            state.consecutive_cached = 0
        self._state, self._step = state, step
        return skipping

    def _middle_block(self, original: Callable[..., Any], slot: _Slot, args: Any, kwargs: Any) -> Any:
        if not self._call.skipping:
            output = original(*args, **kwargs)
            if slot.middle_end:
                final = _streams(slot.spec, output)
                start = self._start_as(slot.spec)
                self._state.calibrator.record(
                    self._step,
                    {
                        name: final[name] - start[name]
                        for name in slot.spec.returns
                        if isinstance(final[name], torch.Tensor) and isinstance(start.get(name), torch.Tensor)
                    },
                )
                self._state.computed = True
                self._computed(slot.spec, final, start)
            return output
        inputs = slot.signature.bind(*args, **kwargs).arguments
        values = [inputs[name] for name in slot.spec.returns]
        if slot.middle_end:
            # From the head's output, not this block's input: what the transformer added between
            # the skipped blocks (a ControlNet's per-block residuals) is already in the stored
            # residual, and would otherwise count twice.
            residuals, start = self._state.calibrator.predict(self._step), self._start_as(slot.spec)
            values = [
                start[name] + residuals[name] if name in residuals else value
                for name, value in zip(slot.spec.returns, values)
            ]
        return values[0] if len(values) == 1 else tuple(values)

    def _start_as(self, spec: BlockList) -> dict[str, Any]:
        """The head's output streams as `spec`'s blocks see them (joined where the transformer
        joins them between the lists)."""
        if spec.joins and self._call.start_spec is not None and not self._call.start_spec.joins:
            return {spec.returns[0]: torch.cat([self._call.start[name] for name in spec.joins], dim=1)}
        return self._call.start

    def _relative_change(self, residual: torch.Tensor, previous: torch.Tensor) -> float:
        """mean|r − r_prev| / mean|r_prev| over every rank's shard (sums make unequal shards exact).

        The one host synchronisation of a cached transformer call: a single scalar read, after the
        reduction, for the decision every rank must take alike."""
        real = self.real_tokens() if self.real_tokens is not None else None
        if real is not None:  # tokens along dim -2, as every family's block streams hold them
            residual, previous = residual.narrow(-2, 0, real), previous.narrow(-2, 0, real)
        sums = torch.stack(
            [
                torch.sum(torch.abs(residual - previous), dtype=torch.float32),
                torch.sum(torch.abs(previous), dtype=torch.float32),
            ]
        )
        if self.group is not None:
            dist.all_reduce(sums, group=self.group)
        ratio = torch.where(sums[1] > 0, sums[0] / sums[1], torch.full_like(sums[0], float("inf")))
        return float(ratio.item())


def _streams(spec: BlockList, output: Any) -> dict[str, Any]:
    values = output if isinstance(output, tuple) else (output,)
    return dict(zip(spec.returns, values))
