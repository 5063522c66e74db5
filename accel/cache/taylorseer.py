"""TaylorSeer inside the blocks: the attention and feed-forward outputs of every block are computed
every `interval` steps and extrapolated in between, the high-fidelity end of caching.

Where First Block Cache and DBCache skip whole blocks on a data-dependent decision, this method
runs every block on every call and replaces only its most expensive parts: each block's children
whose class is an attention or a feed-forward module (diffusers names them so: `FluxAttention`,
`WanAttention`, `MochiAttention`, `FeedForward`, `Flux2FeedForward`, …). Norms, modulations and
residual adds still see this step's input. A module's outputs (a tensor or a tuple of them) are
extrapolated from its last `taylor_order + 1` computed ones by the same divided differences as the
calibrator (accel/cache/calibrate.py).

The schedule depends on the step alone, so every rank computes and skips the same calls with no
exchange; under context parallelism each rank extrapolates its own shard. The wrapped modules run
outside compiled code (a compiled block calls them as an opaque function): their history lives in
Python, which a graph would otherwise guard on.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self

import torch
from torch import Tensor, nn

from accel.cache.calibrate import TaylorSeer
from accel.cache.calls import CacheSite, StepCache
from accel.cache.stats import CallRecord
from accel.hooks import CACHE, wrap
from accel.models.base import BlockList
from accel.models.parts import blocks_of
from accel.steps import StepEvents

if TYPE_CHECKING:
    from accel.cache.config import TaylorSeerConfig

# diffusers' naming of the modules worth extrapolating (the rest of a block is cheap).
CACHED_MODULE = re.compile(r".*(Attention|FeedForward)$")


@dataclass
class _ModuleHistory:
    """One module's computed outputs in one branch, and the shape of what it returns."""

    seer: TaylorSeer
    layout: tuple[Any, ...] | None = None  # None: a bare tensor; else per item True (a tensor) or the constant it was

    def record(self, step: int, output: Any) -> None:
        values = output if isinstance(output, tuple) else (output,)
        self.layout = tuple(True if isinstance(v, Tensor) else v for v in values) if isinstance(output, tuple) else None
        self.seer.record(step, {str(i): v for i, v in enumerate(values) if isinstance(v, Tensor)})

    def predict(self, step: int) -> Any:
        values = self.seer.predict(step)
        if self.layout is None:
            return values["0"]
        return tuple(values[str(i)] if kind is True else kind for i, kind in enumerate(self.layout))


@dataclass
class _BranchState:
    order: int
    modules: dict[int, _ModuleHistory] = field(default_factory=dict)
    calls: int = 0

    def history(self, index: int) -> _ModuleHistory:
        if index not in self.modules:
            self.modules[index] = _ModuleHistory(TaylorSeer(self.order))
        return self.modules[index]


class TaylorSeerCache(StepCache[_BranchState]):
    """Installs itself on the attention and feed-forward modules of one transformer's blocks."""

    def __init__(
        self,
        transformer: nn.Module,
        block_lists: Sequence[BlockList],
        *,
        interval: int,
        taylor_order: int = 1,
        disable_before: int = 0,
        disable_after: int = 0,
        interval_offset: int = 0,
        extrapolate_early: bool = False,
        events: StepEvents | None = None,
    ) -> None:
        if interval < 2:
            raise ValueError(f"interval must be at least 2 (1 computes every step), got {interval}")
        if not 0 <= interval_offset < interval:
            raise ValueError(f"interval_offset must be in [0, interval = {interval}), got {interval_offset}")
        TaylorSeer(taylor_order)  # an order it cannot use fails here
        modules = [
            child
            for block in blocks_of(transformer, block_lists)
            for child in block.children()
            if CACHED_MODULE.fullmatch(type(child).__name__)
        ]
        if not modules:
            raise ValueError(
                f"{type(transformer).__name__}'s blocks have no attention or feed-forward module to extrapolate"
            )
        self.interval = interval
        self.taylor_order = taylor_order
        self.disable_before = disable_before
        self.disable_after = disable_after
        self.interval_offset = interval_offset
        # How many computed outputs a module needs before it is extrapolated: taylor_order + 1 (the
        # full order from the first extrapolation), or one (the order drops to what there is, the
        # first extrapolated call reuses the output: diffusers' TaylorSeer schedule, one call fewer).
        self._needed = 1 if extrapolate_early else taylor_order + 1
        self._computing = True
        self._armed = False  # a transformer call began; its first cached module decides for the call
        self._step = 0
        self._state = self.new_state()
        super().__init__(transformer, events)
        # Decided where the call's first module runs, not at the call: under CFG parallelism this
        # rank's transformer is called for the other half too, and skips it without a block.
        self._undo.append(transformer.register_forward_pre_hook(lambda *_: setattr(self, "_armed", True)).remove)
        for index, module in enumerate(modules):
            self._undo.append(wrap(module, "forward", "accel.cache.taylorseer", CACHE, self._module_forward(index)))

    @classmethod
    def install(cls, site: CacheSite, config: TaylorSeerConfig) -> Self:
        """TaylorSeer on `site` as `config` says; its schedule needs no sums (the step alone decides)."""
        return cls(site.transformer, site.block_lists, **config.keywords(), events=site.events)

    def new_state(self) -> _BranchState:
        return _BranchState(self.taylor_order)

    def _decide(self) -> None:
        """Compute this call or extrapolate it? The step alone says, the same on every rank: the
        steps outside [disable_before, disable_after), every `interval`-th step from
        disable_before + interval_offset, and any call whose modules have too few computed outputs to extrapolate
        (fewer than taylor_order + 1, or none with extrapolate_early)."""
        branch, state = self.branch_state()
        step = self.events.step_index if self.events is not None else state.calls
        state.calls += 1
        computed = min((history.seer.computed for history in state.modules.values()), default=0)
        self._computing = (
            step < self.disable_before
            or (self.disable_after > 0 and step >= self.disable_after)
            or (step - self.disable_before - self.interval_offset) % self.interval == 0
            or computed < self._needed
        )
        self._state, self._step = state, step
        self.stats.records.append(CallRecord(step, branch, None, not self._computing))

    def _module_forward(self, index: int) -> Callable[..., Any]:
        @torch.compiler.disable
        def forward(call_next: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            if self._armed:
                self._armed = False
                self._decide()
            history = self._state.history(index)
            if self._computing:
                output = call_next(*args, **kwargs)
                history.record(self._step, output)
                return output
            return history.predict(self._step)

        return forward
