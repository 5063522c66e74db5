"""The session's rank pool (tests/rankpool.py): one set of processes regrouped for each size asked."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from rankpool import RankPool

from accel.parallel.mesh import Degrees, build_mesh


def group_seen(layout: dict[str, int]) -> tuple[int, int, int, str | None, int]:
    """(pid, rank, world size, the test's variable, threads) after an accel mesh's collective."""
    mesh = build_mesh(Degrees(**layout), "cpu")
    total = torch.ones(1)
    dist.all_reduce(total, group=mesh.sequence_group)
    with open("/proc/self/status") as status:
        threads = next(int(line.split()[1]) for line in status if line.startswith("Threads:"))
    return os.getpid(), dist.get_rank(), dist.get_world_size(), os.environ.get("ACCEL_POOL_PROBE"), threads


def test_the_first_ranks_form_a_group_of_each_size_asked_and_keep_their_processes(monkeypatch) -> None:
    """Regrouped for 3, 2, 3 and 4 ranks: the same processes (a fourth joins when asked), each call
    sees the test's environment as it is then, and a rank's threads do not grow from one regroup to
    the next (the closed groups' gloo threads are collected: tests/rankpool.py's _leave)."""
    pool = RankPool()
    try:
        runs = []
        for world, layout in (
            (3, {"ring": 3}),
            (2, {"ulysses": 2}),
            (3, {"ulysses": 3}),
            (4, {"ring": 2, "ulysses": 2}),
        ):
            monkeypatch.setenv("ACCEL_POOL_PROBE", f"call {len(runs)}")
            runs.append(pool.sized(world).run(group_seen, layout))
        for index, run in enumerate(runs):
            assert [(rank, world, probe) for _, rank, world, probe, _ in run] == [
                (rank, len(run), f"call {index}") for rank in range(len(run))
            ]
        pids = [pid for pid, *_ in runs[0]]
        assert [pid for pid, *_ in runs[2]] == pids and [pid for pid, *_ in runs[3]][:3] == pids
        again = pool.sized(3).run(group_seen, {"ring": 3})
        assert [threads for *_, threads in again] == [threads for *_, threads in runs[2]]
    finally:
        pool.close()
