"""N ranks of one sequence in one process: threads that share one transformer's weights and exchange
tensors through memory instead of a process group.

What a plan's verification needs (accel/parallel/verify.py): run the engine exactly as N GPUs would,
collectives included, before any rank starts and without a second copy of the weights. Each
simulated rank gets its own shallow copy of the transformer (the module objects copied, every
parameter and buffer shared), so the engine's hooks and per-call state stay per rank, and its own
`SimulatedGroup` handles, which `accel.parallel.comm` serves from memory. Torch function modes and
grad mode are per thread, so each rank's attention routing stays its own.
"""

from __future__ import annotations

import copy
import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# A simulated rank that waits longer than this for the others has lost one (a deadlock in the plan):
# the exchange breaks and every rank raises instead of hanging.
EXCHANGE_TIMEOUT_S = 120.0


class _Exchange:
    """One group's meeting point: each member posts a value, all wait, each reads every member's."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._slots: list[Any] = [None] * size
        self._barrier = threading.Barrier(size, timeout=EXCHANGE_TIMEOUT_S)

    def swap(self, rank: int, value: Any) -> list[Any]:
        self._slots[rank] = value
        self._barrier.wait()
        values = list(self._slots)
        self._barrier.wait()  # nobody posts the next round's value before everyone has read this one
        return values

    def abort(self) -> None:
        self._barrier.abort()


@dataclass(frozen=True, eq=False)
class SimulatedGroup:
    """One member's handle on a simulated group (what a process group is to a real rank)."""

    exchange: _Exchange
    rank: int

    @property
    def size(self) -> int:
        return self.exchange.size

    def swap(self, value: Any) -> list[Any]:
        return self.exchange.swap(self.rank, value)


def simulated_meshes(ulysses: int, ring: int) -> list[Any]:
    """One ParallelMesh per sequence rank of a (ring × ulysses) layout, laid out as build_mesh lays
    real ranks out: shard p is held by ring rank p // ulysses, Ulysses rank p % ulysses."""
    from accel.parallel.mesh import Degrees, ParallelMesh

    world = ulysses * ring
    sequence = _Exchange(world)
    by_ring = [_Exchange(ulysses) for _ in range(ring)]  # the Ulysses group of each ring index
    by_ulysses = [_Exchange(ring) for _ in range(ulysses)]  # the Ring group of each Ulysses index
    meshes = []
    for rank in range(world):
        ring_rank, ulysses_rank = divmod(rank, ulysses)
        group = SimulatedGroup(sequence, rank)
        meshes.append(
            ParallelMesh(
                degrees=Degrees(ulysses=ulysses, ring=ring),
                device_mesh=None,
                ulysses_group=SimulatedGroup(by_ring[ring_rank], ulysses_rank),
                ring_group=SimulatedGroup(by_ulysses[ulysses_rank], ring_rank),
                sequence_group=group,
                cfg_group=None,
                sequence_rank=rank,
                group=group,
                call_group=group,
            )
        )
    return meshes


def _exchanges(meshes: Sequence[Any]) -> list[_Exchange]:
    groups = itertools.chain.from_iterable((m.ulysses_group, m.ring_group, m.sequence_group) for m in meshes)
    return list({id(g.exchange): g.exchange for g in groups}.values())


def weight_sharing_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of `module` whose parameters and buffers are the original's own tensors: new module
    objects (hooks and instance wrappers can differ per copy), no second copy of the weights."""
    memo = {id(tensor): tensor for tensor in itertools.chain(module.parameters(), module.buffers())}
    return copy.deepcopy(module, memo)


def run_ranks(meshes: Sequence[Any], work: Callable[[int, Any], Any]) -> list[Any]:
    """`work(rank, mesh)` on one thread per simulated rank; every rank's result, or the first
    failure raised (a failing rank breaks the exchanges, so the others raise instead of waiting)."""
    results: list[Any] = [None] * len(meshes)
    errors: list[BaseException | None] = [None] * len(meshes)

    def run(rank: int) -> None:
        try:
            with torch.no_grad():
                results[rank] = work(rank, meshes[rank])
        except BaseException as error:  # noqa: BLE001 - handed to the caller below
            errors[rank] = error
            for exchange in _exchanges(meshes):
                exchange.abort()

    threads = [
        threading.Thread(target=run, args=(rank,), name=f"accel-simulated-rank-{rank}") for rank in range(len(meshes))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # The first real failure, not another rank's broken exchange that it caused.
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results
