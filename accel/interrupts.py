"""Ctrl-C and SIGTERM in a single-process run: unwind to one line and the shell's exit code.

The handler raises `Interrupted` where Python happens to be. When that is inside a finalizer (a
`__del__`, a weakref callback, garbage collection), Python only prints "Exception ignored" and
carries on, so the run would finish and write its outputs as if never interrupted. The handler
therefore also records the signal, a hook keeps such a lost interruption quiet, and
`raise_if_pending` raises it again at the next safe point: every denoising step, and before an
output file takes its name.
"""

from __future__ import annotations

import signal
import sys
from typing import Any

_pending: int | None = None


class Interrupted(BaseException):
    """Not an Exception, so no `except Exception` in a library swallows it; click would print
    "Aborted!" and exit 1 for a KeyboardInterrupt."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def install() -> None:
    """Turn SIGINT and SIGTERM into `Interrupted` in this (main) thread."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _on_signal)
    default_hook = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, Interrupted):  # ours is raised again at a safe point
            default_hook(unraisable)

    sys.unraisablehook = hook


def raise_if_pending() -> None:
    """Raise an interruption that landed in a finalizer and was lost there."""
    if _pending is not None:
        raise Interrupted(_pending)


def _on_signal(signum: int, _frame: object) -> None:
    global _pending
    _pending = signum
    raise Interrupted(signum)
