"""The front's queue: requests wait in one bounded queue and each replica takes the next one when
it is free, so a request always goes to an idle replica when there is one (the least busy).

A replica is a callable running one job to its outcome (on rank 0's own replica it generates, for
another it sends the job to that replica's leader and waits); each runs on its own thread, so the
HTTP loop never waits on a generation.

With `max_batch` > 1 a replica that takes a job also takes the waiting jobs that can share its
pipeline call (accel/serve/batching.py), oldest first, up to `max_batch` outputs; the others keep
their places.

A job can be cancelled at any time: while it waits it leaves the queue at once (its place is free
again); while it runs it is marked on the board and stops at its next step (accel/serve/cancel.py).
On shutdown the dispatcher is closed (new requests are refused), drained, and what is left is
cancelled.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from accel.serve.batching import Batch, batch_key
from accel.serve.cancel import Board, LocalBoard
from accel.serve.replica import Outcome
from accel.serve.requests import Job

RunJob = Callable[[Any], Any]  # a Job to its Outcome, a Batch to its jobs' outcomes
STOP = Job(-1, "image", {}, stop=True)


class QueueFull(Exception):
    def __init__(self, waiting: int) -> None:
        super().__init__(f"the queue is full ({waiting} requests waiting); retry later")


class ShuttingDown(Exception):
    def __init__(self) -> None:
        super().__init__("the server is shutting down and takes no new requests; retry on another server")


@dataclass
class _Pending:
    job: Job
    future: asyncio.Future[Outcome]
    loop: asyncio.AbstractEventLoop
    running_on: int | None = None  # the replica's index once one took it
    started: float = 0.0  # time.monotonic() then


class Dispatcher:
    def __init__(
        self,
        replicas: list[RunJob],
        max_queue: int,
        on_outcome: Callable[[Outcome], None] = lambda _o: None,
        board: Board | None = None,
        max_batch: int = 1,
    ) -> None:
        self.replicas = replicas
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.on_outcome = on_outcome
        self.board: Board = board if board is not None else LocalBoard()
        self._jobs: queue.Queue[int | None] = queue.Queue()
        self._pending: dict[int, _Pending] = {}
        self._lock = threading.Lock()
        self.waiting = 0
        self.busy = 0
        self.closed = False
        self.broken: str | None = None  # why a replica stopped serving (its ranks are gone)
        self._started = False
        self._threads = [
            threading.Thread(target=self._serve, args=(index, run), name=f"accel-replica-{index}", daemon=True)
            for index, run in enumerate(replicas)
        ]

    def start(self) -> None:
        """Let the replicas draw (once; later calls do nothing)."""
        if self._started:
            return
        self._started = True
        for thread in self._threads:
            thread.start()

    async def submit(self, job: Job) -> Outcome:
        return await self.enqueue(job)

    def enqueue(self, job: Job) -> asyncio.Future[Outcome]:
        """Queue `job` now (QueueFull, ShuttingDown) and return the future of its outcome; called on
        the HTTP loop, which the outcome comes back to."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Outcome] = loop.create_future()
        with self._lock:
            if self.closed:
                raise ShuttingDown()
            queued = self.waiting - self._idle_replicas()
            if queued >= self.max_queue:
                raise QueueFull(queued)
            self.waiting += 1
            self._pending[job.id] = _Pending(job, future, loop)
        self._jobs.put(job.id)
        return future

    def _idle_replicas(self) -> int:
        """Replicas that will take a queued job without waiting for one to finish (called under the
        lock). A job they are about to take is not waiting in the queue, so it does not count against
        `max_queue`: requests arriving together at an idle server all find their places, however late
        a replica's thread draws."""
        if not self._started or self.broken is not None:
            return 0
        return max(0, len(self.replicas) - self.busy)

    def running(self, job_id: int) -> bool:
        """Whether a replica has taken `job_id` and not finished it."""
        with self._lock:
            pending = self._pending.get(job_id)
            return pending is not None and pending.running_on is not None

    def progress(self, job_id: int) -> int | None:
        """The share of its denoising steps a running job has done, in % (at most 99: done is its
        answer); None while it waits or once it is answered."""
        if not self.running(job_id):
            return None
        steps = self.board.progress_of(job_id)
        return min(99, steps[0] * 100 // steps[1]) if steps is not None and steps[1] else 0

    def cancel(self, job_id: int, reason: str) -> None:
        """A waiting job is answered now and leaves the queue; a running one stops at its next step."""
        with self._lock:
            pending = self._pending.get(job_id)
            if pending is None:
                return
            if pending.running_on is not None:
                self.board.cancel(job_id, reason)
                return
            del self._pending[job_id]  # its id stays in the queue; the replica that draws it skips it
            self.waiting -= 1
        outcome = Outcome(False, error=f"cancelled while waiting: {reason.replace('_', ' ')}", cancelled=reason)
        self.on_outcome(outcome)
        _answer(pending, outcome)

    def close(self) -> None:
        """Take no new jobs (submit raises ShuttingDown); those accepted still run."""
        with self._lock:
            self.closed = True

    def idle(self) -> bool:
        with self._lock:
            return not self._pending

    def cancel_all(self, reason: str) -> None:
        with self._lock:
            ids = list(self._pending)
        for job_id in ids:
            self.cancel(job_id, reason)

    def running_past(self, seconds: float) -> list[tuple[int, int, float]]:
        """(replica, job id, seconds running) of every job running longer than `seconds`."""
        now = time.monotonic()
        with self._lock:
            return [
                (p.running_on, job_id, now - p.started)
                for job_id, p in self._pending.items()
                if p.running_on is not None and now - p.started > seconds
            ]

    def _serve(self, index: int, run: RunJob) -> None:
        while True:
            job_id = self._jobs.get()
            if job_id is None:
                run(STOP)
                return
            with self._lock:
                pending = self._pending.get(job_id)
                if pending is None or pending.running_on is not None:  # cancelled while it waited, or batched
                    continue
                taken = [pending, *self._batch_mates(pending)]
                now = time.monotonic()
                for one in taken:
                    one.running_on, one.started = index, now
                self.waiting -= len(taken)
                self.busy += 1  # replicas, not jobs: a batch holds one
            try:
                if len(taken) == 1:
                    outcomes = [run(pending.job)]
                else:
                    outcomes = run(Batch(tuple(one.job for one in taken)))
            except Exception as failure:  # the replica's ranks are gone: the launcher ends the job
                self.broken = f"{type(failure).__name__}: {failure}"
                self._free()
                for one in taken:
                    self._finish(one, Outcome(False, error=f"the replica serving this request failed: {self.broken}"))
                return
            self._free()
            for one, outcome in zip(taken, outcomes):
                self.on_outcome(outcome)
                self._finish(one, outcome)

    def _batch_mates(self, first: _Pending) -> list[_Pending]:
        """The waiting jobs that share `first`'s call, oldest first, while the outputs fit `max_batch`
        (called under the lock)."""
        key = batch_key(first.job) if self.max_batch > 1 else None
        if key is None:
            return []
        room = self.max_batch - first.job.count
        mates: list[_Pending] = []
        for pending in self._pending.values():  # in the order they were queued
            if room <= 0:
                break
            if (
                pending is not first
                and pending.running_on is None
                and pending.job.count <= room
                and batch_key(pending.job) == key
            ):
                mates.append(pending)
                room -= pending.job.count
        return mates

    def _free(self) -> None:
        """The replica's call is over (one busy replica less, however many jobs it answered)."""
        with self._lock:
            self.busy -= 1

    def _finish(self, pending: _Pending, outcome: Outcome) -> None:
        with self._lock:
            self._pending.pop(pending.job.id, None)
        self.board.forget(pending.job.id)
        _answer(pending, outcome)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Answer what still waits, then stop every replica after its current job."""
        self.close()
        with self._lock:
            waiting = [job_id for job_id, p in self._pending.items() if p.running_on is None]
        for job_id in waiting:
            self.cancel(job_id, "shutdown")
        self.start()  # a replica that never drew still gets its stop
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join(timeout_s)


def _answer(pending: _Pending, outcome: Outcome) -> None:
    try:
        pending.loop.call_soon_threadsafe(_settle, pending.future, outcome)
    except RuntimeError:  # the HTTP loop has closed: nobody is left to answer
        pass


def _settle(future: asyncio.Future[Any], outcome: Outcome) -> None:
    if not future.done():
        future.set_result(outcome)
