"""Stopping a request that is already on a replica's ranks, at its next denoising step.

The front marks a job on a board when its client has gone, when the server shuts down; the
replica's leader checks the board (and the request's time limit) before every scheduler step,
and the replica's ranks agree on what the leader saw (a MAX over their job group) before any of
them stops, so all of them leave the pipeline call at the same step and no rank is left waiting
in a collective. The replica then takes the next job as if the stopped one had finished.

Those verdicts are rounds of one shape, and so is the end of a job: every rank ends it with a
round saying DONE or FAILED. A rank that fails mid-step therefore meets the others in the next
round wherever they are (a step's verdict or the end), and all of them learn of it at once.

With one process the board is a dict; with several it is a TCPStore hosted by rank 0, which the
other replicas' leaders read (their jobs are sent to them over pair groups, which are busy
waiting for the outcome).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Protocol

from accel.steps import StepEvents, StepListener

# A round's codes, the largest wins: go on, stop for a reason, the job's end, a rank failed.
REASONS = ("", "client_gone", "time_limit", "shutdown", "deleted")
DONE = len(REASONS)
FAILED = DONE + 1
_KEY = "accel-serve/cancel/{}"
_PROGRESS = "accel-serve/progress/{}"


class Cancelled(Exception):
    """Raised on every rank of a replica at the same step; caught by the replica."""

    def __init__(self, reason: str, step: int) -> None:
        super().__init__(f"stopped at step {step}: {reason}")
        self.reason = reason
        self.step = step


class PeerFailed(Exception):
    """Raised on the ranks that did not fail, at the round where another rank said FAILED."""


class Board(Protocol):
    """Where the front marks jobs to stop, and a replica's leader notes each job's steps done."""

    def cancel(self, job_id: int, reason: str) -> None: ...

    def reason(self, job_id: int) -> str | None: ...

    def forget(self, job_id: int) -> None: ...

    def progress(self, job_id: int, done: int, total: int) -> None: ...

    def progress_of(self, job_id: int) -> tuple[int, int] | None: ...


class LocalBoard:
    """One process's board: the front and its own replica share it."""

    def __init__(self) -> None:
        self._reasons: dict[int, str] = {}
        self._steps: dict[int, tuple[int, int]] = {}
        self._lock = threading.Lock()

    def cancel(self, job_id: int, reason: str) -> None:
        with self._lock:
            self._reasons.setdefault(job_id, reason)

    def reason(self, job_id: int) -> str | None:
        with self._lock:
            return self._reasons.get(job_id)

    def forget(self, job_id: int) -> None:
        with self._lock:
            self._reasons.pop(job_id, None)
            self._steps.pop(job_id, None)

    def progress(self, job_id: int, done: int, total: int) -> None:
        with self._lock:
            self._steps[job_id] = (done, total)

    def progress_of(self, job_id: int) -> tuple[int, int] | None:
        with self._lock:
            return self._steps.get(job_id)


class StoreBoard:
    """The board of a job of several processes: keys in a TCPStore of rank 0's."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def _write(self, key: str, value: str) -> None:
        """A TCPStore `set` gets no reply, so another client could still read the old value; a read on
        this connection returns only after the server applied the set, and every client sees it from then."""
        self.store.set(key, value)
        self.store.check([key])

    def cancel(self, job_id: int, reason: str) -> None:
        key = _KEY.format(job_id)
        if not self.store.check([key]):  # the first reason stands
            self._write(key, reason)

    def reason(self, job_id: int) -> str | None:
        key = _KEY.format(job_id)
        return self.store.get(key).decode() if self.store.check([key]) else None

    def forget(self, job_id: int) -> None:
        self.store.delete_key(_KEY.format(job_id))
        self.store.delete_key(_PROGRESS.format(job_id))

    def progress(self, job_id: int, done: int, total: int) -> None:
        self._write(_PROGRESS.format(job_id), f"{done}/{total}")

    def progress_of(self, job_id: int) -> tuple[int, int] | None:
        key = _PROGRESS.format(job_id)
        if not self.store.check([key]):
            return None
        done, _, total = self.store.get(key).decode().partition("/")
        return int(done), int(total)


def shared_board(rank: int, address: str) -> StoreBoard:
    """Collective over the default group: rank 0 hosts a store on a free port, every rank connects."""
    import torch.distributed as dist

    store = (
        dist.TCPStore(address, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        if rank == 0
        else None
    )
    box: list[Any] = [store.port if store is not None else None]
    dist.broadcast_object_list(box, src=0)
    if store is None:
        store = dist.TCPStore(address, int(box[0]), is_master=False, timeout=timedelta(seconds=60))
    return StoreBoard(store)


class StepGate(StepListener):
    """Before each step of the current job: on the leader, the board's mark or the time limit;
    on every rank of the replica, the agreed verdict, raised as `Cancelled`."""

    def __init__(self, pipe: Any, board: Board | None, group: Any, time_limit_s: float | None) -> None:
        self.board = board  # None on ranks that only follow the leader
        self.group = group
        self.time_limit_s = time_limit_s
        self._jobs: tuple[int, ...] = ()  # the job, or a batch's jobs, whose steps these are
        self._limited = False
        self._started = 0.0
        self._steps = 0  # of the current generation
        self._events = StepEvents.of(pipe)
        self._events.add(self)

    def watch(self, job_ids: tuple[int, ...], limited: bool = True) -> None:
        """Gate the steps of a job, or of a batch's jobs run as one call, from now (none: of no job)."""
        self._jobs = job_ids
        self._limited = limited
        self._started = time.monotonic()

    def close(self) -> None:
        self._events.remove(self)

    def on_generation_start(self, num_steps: int) -> None:
        self._steps = num_steps

    def on_step_end(self, step_index: int) -> None:
        """The leader notes the steps done, which a video job's status reports as its progress."""
        if self.board is not None and self._steps:
            for job_id in self._jobs:
                self.board.progress(job_id, step_index + 1, self._steps)

    def before_step(self, step_index: int) -> None:
        if not self._jobs:
            return
        code = self.round(REASONS.index(self._verdict()) if self.board is not None else 0)
        if code == FAILED:
            raise PeerFailed()
        if code:
            raise Cancelled(REASONS[code], step_index)

    def round(self, code: int) -> int:
        """The largest of the replica's ranks' codes (`code` itself with one rank)."""
        if self.group is None:
            return code
        import torch
        import torch.distributed as dist

        agreed = torch.tensor([code], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
        return int(agreed.item())

    def _verdict(self) -> str:
        """A batch stops only when each of its jobs is marked (the first one's reason): the others'
        outputs are still wanted. The time limit is the call's."""
        assert self.board is not None and self._jobs
        marked = [self.board.reason(job_id) for job_id in self._jobs]
        if all(marked):
            return str(marked[0])
        if self._limited and self.time_limit_s is not None and time.monotonic() - self._started > self.time_limit_s:
            return "time_limit"
        return ""
