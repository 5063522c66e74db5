"""A persistent pool of gloo ranks for multi-rank tests: processes start once per session.

`pool.run(fn, *args)` calls `fn(*args)` on every rank (fn must be importable, e.g. a module-level
function in tests/) and returns each rank's result in rank order. A rank that raises fails the
call with its traceback; the pool is then rebuilt, since the other ranks may be stuck mid-collective.
"""

from __future__ import annotations

import multiprocessing.forkserver
import os
import queue
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from accel.launch.environment import free_port

# Imported once by the fork server the ranks start from: a spawned rank spent 10 s importing torch,
# diffusers and transformers before its first task, and the suite starts pools dozens of times.
PRELOAD = ["rank_preload"]
TESTS = str(Path(__file__).parent)

# A rank waiting on its peers gives up after this: long enough that a peer still computing on a machine
# with a load of 4 on 2 cores (its steps 3x slower, a compile far more) is not taken for a hang.
COLLECTIVE_TIMEOUT_S = 180


def _worker(rank: int, world: int, port: int, environment: dict[str, str], tasks: Any, results: Any) -> None:
    os.environ.clear()  # the pool's environment as it starts, not the fork server's from its first start
    os.environ.update(environment)
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


def _start_fork_server() -> None:
    """Starts the session's fork server once, with tests/ on its path for PRELOAD (Python 3.11's fork
    server ignores the parent's sys.path while preloading; the ranks it forks get it back)."""
    multiprocessing.forkserver.set_forkserver_preload(PRELOAD)
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (TESTS, before)))
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


class RankPool:
    def __init__(self, world: int) -> None:
        self.world = world
        self._start()

    def _start(self) -> None:
        context = mp.get_context("forkserver")
        _start_fork_server()
        port = free_port()
        self._results = context.Queue()
        self._tasks = [context.Queue() for _ in range(self.world)]
        self._processes = [
            context.Process(
                target=_worker,
                args=(rank, self.world, port, dict(os.environ), self._tasks[rank], self._results),
                daemon=True,
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
