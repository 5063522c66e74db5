"""What every cache method shares: where a pipeline call, a step and a transformer call begin,
which CFG branch a call belongs to, the statistics, and taking the method off again.

A pipeline that calls the transformer twice per step (cond, uncond) gets one state per call index
within the step, so the two never mix; batched CFG is one call and so one branch. Branches are
counted per transformer call (a forward pre-hook), not per block run: under CFG parallelism a rank
skips the other half's call, and its calls keep their single-process index.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Self, TypeVar

from torch import nn

from accel.cache.stats import CacheStats
from accel.models.base import BlockList
from accel.steps import StepEvents, StepListener

State = TypeVar("State")


@dataclass(frozen=True)
class CacheSite:
    """Where a method installs itself: one transformer, its family's block lists, the pipeline's step
    events, and where a deciding method measures its change and over which ranks it sums it
    (accel/cache/sums.py; one process: the primary stream alone)."""

    transformer: nn.Module
    block_lists: Sequence[BlockList]
    events: StepEvents | None
    primary_stream: str = "hidden_states"
    group: Any = None
    real_tokens: Callable[[], int | None] | None = None


class StepCache(StepListener, Generic[State]):
    """Base of the cache methods: per-branch state made by `new_state`, reset at each generation."""

    def __init__(self, transformer: nn.Module, events: StepEvents | None) -> None:
        self.events = events
        self.stats = CacheStats()
        self._calls_marked = False  # begin_call marks where each pipeline call starts
        self._states: dict[int, State] = {}
        self._calls_in_step = 0
        self._branch = 0
        self._undo: list[Callable[[], None]] = []
        self._undo.append(transformer.register_forward_pre_hook(lambda *_: self._count_call()).remove)
        if events is not None:
            events.add(self)

    @classmethod
    def install(cls, site: CacheSite, config: Any) -> Self:
        """The method on `site` as its config (accel/cache/config.py) says: `accel.apply`'s one way in."""
        raise NotImplementedError

    def new_state(self) -> State:
        raise NotImplementedError

    def branch_state(self) -> tuple[int, State]:
        """The current call's branch (0 without step events: every call is one branch) and its state."""
        branch = self._branch if self.events is not None else 0
        state = self._states.get(branch)
        if state is None:
            state = self._states[branch] = self.new_state()
        return branch, state

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

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()
        if self.events is not None:
            self.events.remove(self)
            self.events = None
