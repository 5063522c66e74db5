"""The front's queue: requests wait in one bounded queue and each replica takes the next one when
it is free, so a request always goes to an idle replica when there is one (the least busy).

A replica is a callable running one job to its outcome (on rank 0's own replica it generates, for
another it sends the job to that replica's leader and waits); each runs on its own thread, so the
HTTP loop never waits on a generation.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any

from accel.serve.replica import Outcome
from accel.serve.requests import Job

RunJob = Callable[[Job], Outcome]
STOP = Job(-1, "image", {}, stop=True)


class QueueFull(Exception):
    def __init__(self, waiting: int) -> None:
        super().__init__(f"the queue is full ({waiting} requests waiting); retry later")


class Dispatcher:
    def __init__(self, replicas: list[RunJob], max_queue: int, on_outcome: Callable[[Outcome], None] = lambda _o: None) -> None:
        self.replicas = replicas
        self.max_queue = max_queue
        self.on_outcome = on_outcome
        self._jobs: queue.Queue[tuple[Job, asyncio.Future[Outcome], asyncio.AbstractEventLoop] | None] = queue.Queue()
        self._lock = threading.Lock()
        self.waiting = 0
        self.busy = 0
        self.broken: str | None = None  # why a replica stopped serving (its ranks are gone)
        self._threads = [threading.Thread(target=self._serve, args=(run,), name=f"accel-replica-{index}", daemon=True)
                         for index, run in enumerate(replicas)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    async def submit(self, job: Job) -> Outcome:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Outcome] = loop.create_future()
        with self._lock:
            if self.waiting >= self.max_queue:
                raise QueueFull(self.waiting)
            self.waiting += 1
        self._jobs.put((job, future, loop))
        return await future

    def _serve(self, run: RunJob) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                run(STOP)
                return
            job, future, loop = item
            with self._lock:
                self.waiting -= 1
                self.busy += 1
            try:
                outcome = run(job)
            except Exception as failure:  # the replica's ranks are gone: the launcher ends the job
                self.broken = f"{type(failure).__name__}: {failure}"
                outcome = Outcome(False, error=f"the replica serving this request failed: {self.broken}")
                loop.call_soon_threadsafe(_settle, future, outcome)
                return
            finally:
                with self._lock:
                    self.busy -= 1
            self.on_outcome(outcome)
            loop.call_soon_threadsafe(_settle, future, outcome)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Drop what still waits (its clients are gone), then stop every replica after its current job."""
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                job, future, loop = item
                loop.call_soon_threadsafe(_settle, future, Outcome(False, error="the server is shutting down"))
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join(timeout_s)


def _settle(future: asyncio.Future[Any], outcome: Outcome) -> None:
    if not future.done():
        future.set_result(outcome)
