"""A persistent pool of gloo ranks for multi-rank tests: processes start once per session.

`pool.run(world, fn, *args)` calls `fn(*args)` on the first `world` ranks (fn must be importable, e.g.
a module-level function in tests/) and returns each rank's result in rank order. The ranks form a gloo
group of exactly `world` processes, formed again whenever the next call asks for another size: the
processes, their imports and the pipelines they have built outlive the group. A suite alternating
2, 3, 4 and 6 ranks used to start fresh processes for nearly every test: 829 in one suite.

A rank that raises fails the call with its traceback; the pool is then started again, since the other
ranks may be stuck mid-collective. So is a pool whose ranks grew past RANK_MEMORY_LIMIT.
"""

from __future__ import annotations

import gc
import multiprocessing.forkserver
import os
import queue
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from accel.launch.environment import free_port

# Imported once by the fork server the ranks start from: a spawned rank spent 10 s importing torch,
# diffusers and transformers before its first task.
PRELOAD = ["rank_preload"]
TESTS = str(Path(__file__).parent)

# A rank waiting on its peers gives up after this: long enough that a peer still computing on a machine
# with a load of 4 on 2 cores (its steps 3x slower, a compile far more) is not taken for a hang.
COLLECTIVE_TIMEOUT_S = 180

# Each rank keeps every tiny pipeline it has built; a pool whose largest rank passes this starts
# again before its next call, so two pytest workers' pools stay well inside a 24 GiB machine.
RANK_MEMORY_LIMIT = 2 << 30

_LEAVE = "leave"


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _leave() -> None:
    """Closes this rank's groups as a finished job does (accel's meshes of them go too). The device
    meshes sit in reference cycles, so their gloo groups (threads and sockets) outlive the close until
    a full collection: without one, each regroup left about 15 threads behind, and idle ranks of a few
    hundred threads spent 5 % of a core each for the rest of the suite."""
    from accel.parallel.mesh import leave_distributed

    leave_distributed()
    gc.collect()
    gc.freeze()  # what survived is kept out of the next collection: a full one took 0.7 s a regroup


def _forget_compiled() -> None:
    """Each call compiles as in a fresh process: dynamo keeps graphs per code object across calls, and
    calls that compile the same functions for other inputs would reach its recompile limit and run
    eager unnoticed. The compiler's on-disk caches and its loaded modules stay."""
    if "torch._dynamo" in sys.modules:
        import torch

        torch.compiler.reset()


def _worker(rank: int, tasks: Any, results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    gc.freeze()  # the fork server's imports: a collection need not walk them
    while True:
        task = tasks.get()
        if task is None:
            break
        if task == _LEAVE:  # the pool sends this to every rank of a group before any joins the next
            _leave()
            results.put((rank, True, None, 0))
            continue
        world, port, environment, fn, args = task
        os.environ.clear()  # the test's environment as it calls, not the fork server's from its first start
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
        try:
            if not dist.is_initialized():
                dist.init_process_group(
                    "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S)
                )
            results.put((rank, True, fn(*args), _resident_bytes()))
        except BaseException:  # noqa: BLE001 - reported to the test process
            results.put((rank, False, traceback.format_exc(), 0))
        finally:
            _forget_compiled()
    _leave()


# The environment the fork server imported torch in (None: not started yet): tests/commands.py forks
# only commands whose compile settings are the same.
SERVER_ENVIRONMENT: dict[str, str] | None = None


def start_fork_server() -> None:
    """Starts the session's fork server once, with tests/ on its path for PRELOAD (Python 3.11's fork
    server ignores the parent's sys.path while preloading; the ranks it forks get it back)."""
    global SERVER_ENVIRONMENT
    if SERVER_ENVIRONMENT is None:
        SERVER_ENVIRONMENT = dict(os.environ)
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
    """Rank processes, as many as the largest group asked of them so far."""

    def __init__(self) -> None:
        self._context = mp.get_context("forkserver")
        self._processes: list[Any] = []
        self._tasks: list[Any] = []
        self._results: Any = None
        self._group: tuple[int, int] | None = None  # (world, port) the first `world` ranks are joined in
        self._largest_rank_bytes = 0

    def sized(self, world: int) -> SizedPool:
        return SizedPool(self, world)

    def run(self, world: int, fn: Callable[..., Any], *args: Any, timeout: float = 900) -> list[Any]:
        if self._largest_rank_bytes > RANK_MEMORY_LIMIT:
            self.close()
        if self._results is None:
            start_fork_server()
            self._results = self._context.Queue()
        self._grow(world)
        if self._group is None or self._group[0] != world:
            self._leave_group()
            self._group = (world, free_port())
        port = self._group[1]
        environment = dict(os.environ)
        for tasks in self._tasks[:world]:
            tasks.put((world, port, environment, fn, args))
        outcomes = self._collect(world, timeout)
        failures = [f"rank {rank}:\n{value}" for rank, (ok, value) in sorted(outcomes.items()) if not ok]
        if failures:
            self.close()
            raise AssertionError("\n".join(failures))
        return [outcomes[rank][1] for rank in range(world)]

    def _grow(self, world: int) -> None:
        while len(self._processes) < world:
            rank = len(self._processes)
            tasks = self._context.Queue()
            process = self._context.Process(target=_worker, args=(rank, tasks, self._results), daemon=True)
            process.start()
            self._tasks.append(tasks)
            self._processes.append(process)

    def _leave_group(self) -> None:
        """Every rank of the current group closes it before any joins the next: a gloo peer that closed
        its side while another still waited on it would fail that one."""
        if self._group is None:
            return
        world = self._group[0]
        for tasks in self._tasks[:world]:
            tasks.put(_LEAVE)
        self._collect(world, COLLECTIVE_TIMEOUT_S)
        self._group = None

    def _collect(self, world: int, timeout: float) -> dict[int, tuple[bool, Any]]:
        outcomes: dict[int, tuple[bool, Any]] = {}
        try:
            while len(outcomes) < world:
                rank, ok, value, resident = self._results.get(timeout=timeout)
                outcomes[rank] = (ok, value)
                self._largest_rank_bytes = max(self._largest_rank_bytes, resident)
                if not ok:
                    break
        except queue.Empty:
            self.close()
            silent = sorted(set(range(world)) - set(outcomes))
            raise AssertionError(f"ranks {silent} gave no result in {timeout} s") from None
        return outcomes

    def close(self) -> None:
        for process in self._processes:
            if process.is_alive():
                process.kill()
        for process in self._processes:
            process.join(timeout=10)
        self._processes, self._tasks, self._results = [], [], None
        self._group = None
        self._largest_rank_bytes = 0


class SizedPool:
    """`rank_pools(world)`: the session's pool, asked for `world` ranks."""

    def __init__(self, pool: RankPool, world: int) -> None:
        self._pool = pool
        self.world = world

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 900) -> list[Any]:
        return self._pool.run(self.world, fn, *args, timeout=timeout)
