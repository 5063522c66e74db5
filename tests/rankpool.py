"""A persistent pool of gloo ranks for multi-rank tests: processes start once per session.

`pool.run(fn, *args)` calls `fn(*args)` on every rank (fn must be importable, e.g. a module-level
function in tests/) and returns each rank's result in rank order. A rank that raises fails the
call with its traceback; the pool is then rebuilt, since the other ranks may be stuck mid-collective.
"""

from __future__ import annotations

import os
import queue
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

from accel.launch.environment import free_port

# A rank waiting on its peers gives up after this: long enough that a peer still computing on a machine
# with a load of 4 on 2 cores (its steps 3x slower, a compile far more) is not taken for a hang.
COLLECTIVE_TIMEOUT_S = 180


def _worker(rank: int, world: int, port: int, tasks: Any, results: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        HF_HUB_OFFLINE="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(*args)))
        except BaseException:  # noqa: BLE001 - reported to the test process
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    def __init__(self, world: int) -> None:
        self.world = world
        self._start()

    def _start(self) -> None:
        context = mp.get_context("spawn")
        port = free_port()
        self._results = context.Queue()
        self._tasks = [context.Queue() for _ in range(self.world)]
        self._processes = [
            context.Process(
                target=_worker, args=(rank, self.world, port, self._tasks[rank], self._results), daemon=True
            )
            for rank in range(self.world)
        ]
        for process in self._processes:
            process.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 900) -> list[Any]:
        for tasks in self._tasks:
            tasks.put((fn, args))
        outcomes: dict[int, tuple[bool, Any]] = {}
        try:
            while len(outcomes) < self.world:
                rank, ok, value = self._results.get(timeout=timeout)
                outcomes[rank] = (ok, value)
                if not ok:
                    break
        except queue.Empty:
            self._restart()
            raise AssertionError(
                f"ranks {sorted(set(range(self.world)) - set(outcomes))} gave no result in {timeout} s"
            ) from None
        failures = [f"rank {rank}:\n{value}" for rank, (ok, value) in sorted(outcomes.items()) if not ok]
        if failures:
            self._restart()
            raise AssertionError("\n".join(failures))
        return [outcomes[rank][1] for rank in range(self.world)]

    def _restart(self) -> None:
        self.close()
        self._start()

    def close(self) -> None:
        for process in self._processes:
            if process.is_alive():
                process.kill()
        for process in self._processes:
            process.join(timeout=10)
