"""Starting gloo ranks for the benchmark scripts (run as `python benchmarks/X.py`, so this imports as `ranks`)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch


def join_gloo(rank: int, world: int, port: int) -> None:
    """Join a local gloo group as `rank` of `world`, one thread per rank (ranks share the cores)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
