"""The collectives context parallelism uses, each counting the bytes this rank sends.

Counting lives here so the benchmark and `--verbose` see exactly what the attention
functions move, with no second bookkeeping to drift out of date. Collectives inside
torch.compile'd code are not counted (see `Traffic.add`).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from accel.parallel.simulate import SimulatedGroup

Group = dist.ProcessGroup  # or a SimulatedGroup: ranks simulated in one process (accel/parallel/simulate.py)


@dataclass
class Traffic:
    """Bytes this process sent to other ranks, by collective kind."""

    bytes_sent: Counter[str] = field(default_factory=Counter)
    # Simulated ranks (threads of one process) add at once.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_sent.values())

    def add(self, kind: str, nbytes: int) -> None:
        # Not inside compiled code: a graph would guard on the running total and recompile each call.
        if not torch.compiler.is_compiling():
            with self._lock:
                self.bytes_sent[kind] += nbytes

    def reset(self) -> None:
        self.bytes_sent.clear()


TRAFFIC = Traffic()


def group_size(group: Group | None) -> int:
    if isinstance(group, SimulatedGroup):
        return group.size
    return dist.get_world_size(group)


def group_rank(group: Group | None) -> int:
    if isinstance(group, SimulatedGroup):
        return group.rank
    return dist.get_rank(group)


def global_rank(group: Group | None, rank: int) -> int:
    """The global rank of `group`'s rank `rank` (None: the default group, where they coincide)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def all_to_all(chunks: Tensor, group: Group) -> Tensor:
    """Exchange dim 0: chunk i goes to group rank i; returns chunk i from group rank i."""
    world = group_size(group)
    chunks = chunks.contiguous()
    TRAFFIC.add("all_to_all", _nbytes(chunks) * (world - 1) // world)
    if isinstance(group, SimulatedGroup):
        return torch.stack([sent[group.rank] for sent in group.swap(chunks)])
    received = torch.empty_like(chunks)
    dist.all_to_all_single(received, chunks, group=group)
    return received


def all_reduce(tensor: Tensor, group: Group) -> Tensor:
    """The sum over the group (in place on a contiguous tensor, which is returned); counted as a
    ring all-reduce sends: 2 (n - 1) / n of the tensor per rank."""
    world = group_size(group)
    tensor = tensor.contiguous()
    TRAFFIC.add("all_reduce", _nbytes(tensor) * 2 * (world - 1) // world)
    if isinstance(group, SimulatedGroup):
        return tensor.copy_(torch.stack(group.swap(tensor.clone())).sum(0))
    dist.all_reduce(tensor, group=group)
    return tensor


def all_gather(tensor: Tensor, group: Group) -> list[Tensor]:
    """Every group rank's tensor (equal shapes), in group-rank order."""
    world = group_size(group)
    tensor = tensor.contiguous()
    TRAFFIC.add("all_gather", _nbytes(tensor) * (world - 1))
    if isinstance(group, SimulatedGroup):
        return [item.clone() for item in group.swap(tensor)]
    gathered = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(gathered, tensor, group=group)
    return gathered


class RingShift:
    """Send a tensor to the next group rank and receive the previous one's, in the background.

    Eager runs post a point-to-point pair. Under torch.compile, which does not trace P2P, the same
    shift is one all-to-all whose only non-empty chunks go to the next rank and come from the
    previous one: traceable, so a compiled block keeps the ring in its graph."""

    def __init__(self, tensor: Tensor, group: Group) -> None:
        world, rank = group_size(group), group_rank(group)
        tensor = tensor.contiguous()
        self._works: list[Any] = []
        nxt, prev = (rank + 1) % world, (rank - 1) % world
        if isinstance(group, SimulatedGroup):
            self.received = group.swap(tensor)[prev].clone()
        elif torch.compiler.is_compiling():
            send = [tensor.numel() if peer == nxt else 0 for peer in range(world)]
            receive = [tensor.numel() if peer == prev else 0 for peer in range(world)]
            flat = torch.empty(tensor.numel(), dtype=tensor.dtype, device=tensor.device)
            dist.all_to_all_single(flat, tensor.view(-1), receive, send, group=group)
            self.received = flat.view(tensor.shape)
        else:
            self.received = torch.empty_like(tensor)
            ops = [
                dist.P2POp(dist.isend, tensor, global_rank(group, nxt), group),
                dist.P2POp(dist.irecv, self.received, global_rank(group, prev), group),
            ]
            self._works = dist.batch_isend_irecv(ops)
        TRAFFIC.add("ring_p2p", _nbytes(tensor))

    def wait(self) -> Tensor:
        for work in self._works:
            work.wait()
        return self.received
