"""A caller's progress bar (the CLI's rich bar) driven by a pipeline's denoising steps."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from accel.steps import StepEvents, StepListener


def step_progress(pipe: Any, progress: Callable[[str], Any] | None) -> Callable[[str], Any] | None:
    """`measure`'s progress argument: the caller's bar per label, advanced by this pipeline's steps."""
    if progress is None:
        return None
    return lambda label: _progress_over_steps(pipe, progress, label)


@contextmanager
def _progress_over_steps(pipe: Any, progress: Callable[[str], Any], label: str) -> Iterator[None]:
    """Feeds the caller's progress bar from the scheduler's step events."""
    with progress(label) as bar:
        listener = _BarListener(bar)
        events = StepEvents.of(pipe)
        events.add(listener)
        try:
            yield
        finally:
            events.remove(listener)


class _BarListener(StepListener):
    def __init__(self, bar: Any) -> None:
        self.bar = bar

    def on_generation_start(self, num_steps: int) -> None:
        self.bar.start(num_steps)

    def on_step_end(self, step_index: int) -> None:
        self.bar.advance()
