"""Denoising-step events for one pipeline instance, read off its scheduler.

Every diffusers pipeline calls `scheduler.set_timesteps` once at the start of a generation and
`scheduler.step` once per denoising step. Wrapping those two methods on the scheduler *instance*
tells the cache where a call and a step begin (to tell cond from uncond calls, and to reset) and
drives the progress bar, without touching any class or the pipeline's `__call__`.

Diffusion-forcing pipelines (SkyReels-V2 DF) step a deep copy of the scheduler per latent frame
instead: those copies are wrapped too, and the first of them stepped after a denoiser call ends
the step; the other frames' steps in the same iteration pass through.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

from accel import interrupts
from accel.hooks import STEPS, wrap


class StepListener:
    """Receives one pipeline's step events; each event does nothing unless a listener overrides it."""

    def on_generation_start(self, num_steps: int) -> None:
        pass

    def before_step(self, step_index: int) -> None:
        pass

    def on_step_end(self, step_index: int) -> None:
        pass


class StepEvents:
    """Shared by every listener of one scheduler; unwraps it when the last listener leaves."""

    _by_scheduler: weakref.WeakKeyDictionary[Any, StepEvents] = weakref.WeakKeyDictionary()

    def __init__(self, scheduler: Any, denoisers: Iterable[Any] = ()) -> None:
        self.scheduler = scheduler
        self.step_index = 0
        self._listeners: list[StepListener] = []
        self._calls = 0  # denoiser calls since the last step ended
        # The dispatcher keeps each method's signature visible: pipelines inspect it ("takes sigmas?").
        self._undo = [
            wrap(scheduler, "set_timesteps", "accel.steps", STEPS, self._set_timesteps),
            wrap(scheduler, "step", "accel.steps", STEPS, self._step, on_copy=self._adopt),
        ]
        for module in denoisers:
            self._undo.append(module.register_forward_pre_hook(self._count_call).remove)

    @classmethod
    def of(cls, pipe: Any) -> StepEvents:
        scheduler = pipe.scheduler
        events = cls._by_scheduler.get(scheduler)
        if events is None:
            # The denoisers: the pipeline's transformer components (Wan 2.2 has two).
            components = getattr(pipe, "components", {}) or {}
            denoisers = [
                module
                for name, module in components.items()
                if name.startswith("transformer") and hasattr(module, "register_forward_pre_hook")
            ]
            events = cls(scheduler, denoisers)
            cls._by_scheduler[scheduler] = events
        return events

    def _count_call(self, *_: Any) -> None:
        self._calls += 1

    def _adopt(self, duplicate: Any) -> None:
        """A deep copy of the scheduler (one per latent frame in diffusion forcing) reports its steps here too."""
        wrap(duplicate, "step", "accel.steps", STEPS, self._copy_step, on_copy=self._adopt)

    def _copy_step(self, call_next: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._calls == 0:  # another frame's scheduler in the step that has already ended
            return call_next(*args, **kwargs)
        return self._step(call_next, *args, **kwargs)

    def add(self, listener: StepListener) -> None:
        self._listeners.append(listener)

    def remove(self, listener: StepListener) -> None:
        self._listeners.remove(listener)
        if not self._listeners:
            for undo in self._undo:
                undo()
            self._by_scheduler.pop(self.scheduler, None)

    def _set_timesteps(self, call_next: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        result = call_next(*args, **kwargs)
        self.step_index, self._calls = 0, 0
        timesteps = getattr(self.scheduler, "timesteps", None)
        num_steps = len(timesteps) if timesteps is not None else 0
        for listener in list(self._listeners):
            listener.on_generation_start(num_steps)
        return result

    def _step(self, call_next: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._calls = 0
        interrupts.raise_if_pending()
        for listener in list(self._listeners):
            listener.before_step(self.step_index)
        result = call_next(*args, **kwargs)
        finished = self.step_index
        self.step_index += 1
        for listener in list(self._listeners):
            listener.on_step_end(finished)
        return result
