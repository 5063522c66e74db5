"""How `accel serve` stops: SIGINT / SIGTERM are noted on rank 0's main thread while HTTP keeps
answering; the first drains the accepted requests for `drain_s`, then cancels what is left; a second
cancels at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from accel.launch.supervisor import CANCEL_GRACE_S

if TYPE_CHECKING:
    from accel.serve.dispatch import Dispatcher


class Signals:
    """SIGINT / SIGTERM noted, not raised: the first drains, a second cancels at once."""

    def __init__(self) -> None:
        self.first = threading.Event()
        self.again = threading.Event()

    def note(self, _signum: int, _frame: object) -> None:
        (self.again if self.first.is_set() else self.first).set()


def drain(dispatcher: Dispatcher, drain_s: float, signals: Signals, announce: Callable[[str], None]) -> None:
    """Take no new requests; give the accepted ones `drain_s`; then cancel the rest: waiting ones
    are answered now, running ones stop at their next step (CANCEL_GRACE_S allowed for it)."""
    dispatcher.close()
    if not dispatcher.idle():
        announce(f"stopping: the requests accepted have {drain_s:g} s to finish (a second Ctrl-C cancels them)")
    if _idle_within(dispatcher, drain_s, signals.again):
        return
    dispatcher.cancel_all("shutdown")
    if not _idle_within(dispatcher, CANCEL_GRACE_S):
        announce(
            f"a request did not reach its next step within {CANCEL_GRACE_S:g} s of its cancellation; stopping without "
            "it"
        )


def _idle_within(dispatcher: Dispatcher, seconds: float, interrupted: threading.Event | None = None) -> bool:
    """Whether every accepted request is answered within `seconds` (sooner false once `interrupted` is set)."""
    deadline = time.monotonic() + seconds
    while not dispatcher.idle():
        if time.monotonic() >= deadline or (interrupted is not None and interrupted.is_set()):
            return False
        time.sleep(0.05)
    return True
