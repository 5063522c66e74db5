"""How a process `accel` started as a rank ends: at once after a failure, in Python's order after success.

A finished rank must not go through interpreter finalization: gloo's threads still holding tensors
can abort it there with SIGABRT ("terminate called without an active exception") after its work
succeeded. So it does what CPython's exit does before finalization, in CPython's order, and then
leaves with `os._exit`:

1. the threading-level exit hooks, newest first (`threading._shutdown` runs them before it joins
   anything: `concurrent.futures` uses one to tell its idle workers to leave, so an executor left
   running, such as torch inductor's compile pool, would otherwise be waited for forever);
2. every non-daemon thread joined, again until no new one has appeared;
3. the process groups closed (`mesh.leave_distributed`), then the `atexit` handlers.

Each step is bounded: a thread that has not finished after `THREADS_BOUND_S` is named in one line
and left behind, and a backstop thread ends the rank with a line naming where its exit stuck if a
hook or handler blocks past its bound. The launcher's own grace for a rank that reported success
but did not leave (`LaunchSpec.finish_grace_s`) is longer than both together.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn

THREADS_BOUND_S = 10.0  # threading exit hooks and the joins together
HANDLERS_BOUND_S = 10.0  # closing the process groups and the atexit handlers together
JOIN_SLACK_S = 2.0  # past THREADS_BOUND_S: the bounded joins return and report before the backstop ends the rank


def exit_now(code: int) -> NoReturn:
    """Leave at once: interpreter shutdown (process groups, threads, CUDA) can take seconds, and the
    launcher ends the job only when a failed rank is gone."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def warn(line: str) -> None:
    """One line on stderr in one write: the ranks share it, and print's two writes can interleave."""
    sys.stderr.flush()
    os.write(2, f"warning: {line}\n".encode())


def threading_exit_hooks() -> list[Callable[[], object]]:
    """The hooks `threading._shutdown` runs before joining threads, in the order it runs them. The one
    place we read CPython's private list; without it (another Python) there are none to run, and an
    idle executor's workers are left behind by the bounded join instead."""
    hooks = getattr(threading, "_threading_atexits", None)
    return list(reversed(hooks)) if isinstance(hooks, list) else []


def exit_handlers() -> Callable[[], object] | None:
    """CPython's step that runs the `atexit` handlers (None where this Python has none to call)."""
    return getattr(atexit, "_run_exitfuncs", None)


class Verdict(SystemExit):
    """A command's work ended as designed, with a non-zero exit code that is its answer, not a
    failure (`accel batch` with items that failed: 1; stopped by Ctrl-C: 130): a rank leaves it in
    order, as after success, and the launcher passes the code on without diagnosing a failure."""


def end_process(code: int, on_rank: bool, verdict: bool = False) -> NoReturn:
    """The end of `accel`'s entry points: a rank our launcher started leaves at once on failure (the
    launcher ends the job when it is gone) and in order on success or a verdict; any other process
    closes its groups after success and exits as usual."""
    if on_rank:
        if code and not verdict:
            exit_now(code)
        leave_finished(verdict=code)
    elif not code:
        from accel.parallel.mesh import leave_distributed

        leave_distributed()
    sys.exit(code)


def leave_finished(
    threads_bound_s: float = THREADS_BOUND_S, handlers_bound_s: float = HANDLERS_BOUND_S, verdict: int = 0
) -> NoReturn:
    """Leave a rank whose work succeeded: hooks, threads, groups, handlers (see the module's note),
    never waiting longer than the bounds, then `os._exit(verdict)`."""
    from accel.launch.environment import rank
    from accel.launch.reports import report_finished
    from accel.parallel.mesh import leave_distributed

    report_finished(verdict)  # the launcher's grace for this exit starts now
    backstop = Backstop(rank())
    deadline = time.monotonic() + threads_bound_s
    # The joins bound themselves; the backstop is for a hook that blocks, so it gives them time to return first.
    backstop.arm(threads_bound_s + JOIN_SLACK_S, "a threading exit hook")
    for hook in threading_exit_hooks():
        try:
            hook()
        except Exception as error:  # noqa: BLE001 - as CPython: one failing hook does not stop the exit
            warn(f"rank {rank()}: a threading exit hook failed: {type(error).__name__}: {error}")
    left = join_threads(deadline)
    if left:
        warn(
            f"rank {rank()} leaves {describe_threads(left)} still running after {threads_bound_s:.0f} s (its work is "
            "done)"
        )
    backstop.arm(handlers_bound_s, "closing the process groups or an atexit handler")
    leave_distributed()
    run_handlers = exit_handlers()
    if run_handlers is None:  # not CPython: its ordinary exit runs them (the backstop still bounds it)
        sys.exit(verdict)
    run_handlers()
    exit_now(verdict)


def join_threads(deadline: float) -> list[threading.Thread]:
    """Join every non-daemon thread, newly started ones too (as `threading._shutdown` does), until
    `deadline` (a `time.monotonic` time); the threads still running then."""
    while True:
        running = _non_daemon_threads()
        for thread in running:
            thread.join(max(0.0, deadline - time.monotonic()))
        left = _non_daemon_threads()
        if not left or time.monotonic() >= deadline:
            return left


def _non_daemon_threads() -> list[threading.Thread]:
    current = threading.current_thread()
    return [t for t in threading.enumerate() if t is not current and not t.daemon and t.is_alive()]


def describe_threads(threads: list[threading.Thread]) -> str:
    """'2 threads: 'spin' at job.py:7 in spin, 'pool_0' at thread.py:81 in _worker'."""
    from accel.watchdog import describe

    frames = sys._current_frames()
    places = ", ".join(f"'{t.name}' at {describe(frames.get(t.ident or 0))[1]}" for t in threads)
    return f"{len(threads)} thread{'s' if len(threads) > 1 else ''}: {places}"


class Backstop:
    """A daemon thread that ends the rank (exit 0: its work succeeded) with one line naming where the
    main thread stuck, if a step of the exit outlasts its bound."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.deadline = float("inf")
        self.bound_s = 0.0
        self.step = ""
        self.main = threading.current_thread()
        threading.Thread(target=self._watch, name="accel-exit-backstop", daemon=True).start()

    def arm(self, bound_s: float, step: str) -> None:
        self.bound_s, self.step = bound_s, step
        self.deadline = time.monotonic() + bound_s

    def _watch(self) -> None:
        while (left_s := self.deadline - time.monotonic()) > 0:  # re-armed meanwhile: wait on
            time.sleep(min(0.1, left_s))
        from accel.watchdog import describe

        where = describe(sys._current_frames().get(self.main.ident or 0))[1]
        left = [t for t in _non_daemon_threads() if t is not self.main]
        others = f"; {describe_threads(left)} still running" if left else ""
        warn(
            f"rank {self.rank} left without finishing its exit: {self.step} was still running after "
            f"{self.bound_s:.0f} s at {where}{others}"
        )
        exit_now(0)
