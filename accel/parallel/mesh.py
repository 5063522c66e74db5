"""Parallel degrees (cfg × ring × ulysses), their checks, and the device mesh that carries them.

Degree problems are user errors: they are found here from numbers alone, so the CLI can refuse
them before any rank starts.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from accel.errors import UserError
from accel.recipe import ParallelSection

MESH_DIMS = ("cfg", "ring", "ulysses")


@dataclass(frozen=True)
class Degrees:
    ulysses: int = 1
    ring: int = 1
    cfg: int = 1

    @property
    def world_size(self) -> int:
        return self.ulysses * self.ring * self.cfg

    @property
    def sequence(self) -> int:
        """Ranks that share one sequence (Ulysses × Ring)."""
        return self.ulysses * self.ring

    def describe(self) -> str:
        parts = [f"{name} {getattr(self, name)}" for name in ("ulysses", "ring", "cfg") if getattr(self, name) > 1]
        return " × ".join(parts) or "single process"


# With only `gpus` given, full Ulysses over a head count it does not divide is chosen while at
# most this share of the padded head slots are padding (see `chosen_ulysses`).
MAX_HEAD_PADDING = 0.25


def largest_ulysses(sequence_ranks: int, heads: int | None) -> int:
    """The largest Ulysses degree that divides both the sequence ranks and the head count."""
    if heads is None:
        return sequence_ranks
    return max(d for d in range(1, sequence_ranks + 1) if sequence_ranks % d == 0 and heads % d == 0)


def head_padding(heads: int, ulysses: int) -> float:
    """The share of head slots that are zero padding when `heads` split over `ulysses` ranks."""
    padded = -(-heads // ulysses) * ulysses
    return (padded - heads) / padded


def chosen_ulysses(sequence_ranks: int, heads: int | None) -> int:
    """The Ulysses degree for `sequence_ranks` ranks (the rest is Ring), decided on the host:

    - all of them when the head count is unknown or they divide it;
    - all of them too when they do not divide it but there are at least as many heads as ranks and
      the padding to a multiple, (padded - heads) / padded, is at most MAX_HEAD_PADDING (25 %):
      24 heads on 16 ranks pad to 32 (25 %), 40 heads on 16 to 48 (17 %), 3 heads on 2 to 4 (25 %);
    - otherwise the largest degree that divides both, Ring taking the rest: 40 heads on 32 ranks
      (padding 64, 38 %) run Ulysses 8 × Ring 4, 4 heads on 6 ranks Ulysses 2 × Ring 3."""
    if heads is None or heads % sequence_ranks == 0:
        return sequence_ranks
    if sequence_ranks <= heads and head_padding(heads, sequence_ranks) <= MAX_HEAD_PADDING:
        return sequence_ranks
    return largest_ulysses(sequence_ranks, heads)


def resolve_degrees(settings: ParallelSection, heads: int | None, model: str = "the model") -> Degrees:
    """Degrees from a recipe's [parallel]: given ones are checked, and with only `gpus` they are chosen
    (Ulysses by `chosen_ulysses`, the rest Ring). A given Ulysses degree need not divide the heads
    (they are padded, see accel.parallel.attention) but may not exceed them: a rank would hold no
    real head. `heads=None` skips the head check."""
    ulysses, ring, cfg, gpus = settings.ulysses, settings.ring, settings.cfg, settings.gpus
    if settings.chooses_degrees:
        if gpus % cfg:
            raise UserError(f"[parallel] gpus = {gpus} does not split into cfg = {cfg} halves; use an even number of GPUs")
        sequence = gpus // cfg
        best = chosen_ulysses(sequence, heads)
        return Degrees(ulysses=best, ring=sequence // best, cfg=cfg)
    degrees = Degrees(ulysses=ulysses, ring=ring, cfg=cfg)
    if gpus and degrees.world_size != gpus:
        raise UserError(
            f"[parallel] ulysses {ulysses} × ring {ring} × cfg {cfg} = {degrees.world_size} processes, but gpus = {gpus}; "
            f"make the product {gpus} or leave the degrees out to have them chosen"
        )
    check_heads(degrees, heads, model)
    return degrees


def check_heads(degrees: Degrees, heads: int | None, model: str = "the model") -> None:
    """Refuses a Ulysses degree above the head count (some rank would compute padding only)."""
    if heads is None or degrees.ulysses <= heads:
        return
    best = chosen_ulysses(degrees.sequence, heads)
    raise UserError(
        f"[parallel] ulysses = {degrees.ulysses} is more than the {heads} attention heads of {model}; "
        f"use ulysses = {best}, ring = {degrees.sequence // best} for {degrees.sequence} sequence-parallel ranks"
    )


def under_distributed_launcher() -> bool:
    """True inside torchrun / torch.distributed.run (or any launcher that sets the env:// variables)."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def init_distributed(device_type: str, timeout_s: float) -> tuple[int, int]:
    """Join the job's process group (NCCL, one GPU per rank, on CUDA; gloo on CPU); (rank, world)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        if not under_distributed_launcher():
            raise UserError(
                "[parallel] asks for several processes, but this is a single process: use "
                "`accel run … --gpus N`, or start your script with `accel launch --gpus N` or torchrun"
            )
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def leave_distributed() -> None:
    """Close this process's groups at the end of a finished job, as torch asks (NCCL warns about a
    group left to interpreter shutdown). Closing is local (no collective), so a rank that finished
    never waits for another here; a failure to close is not the job's failure and is ignored. It
    does not by itself stop gloo's rare abort at interpreter exit: see rank_exit.leave_finished."""
    if "torch.distributed" not in sys.modules:  # nothing imported it (accel models, --help): no group, and torch stays unloaded
        return
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        _meshes.clear()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - teardown after success must not turn it into a failure
        pass


@dataclass
class ParallelMesh:
    """The process groups one parallel layout needs; all of them exist on every rank of the layout."""

    degrees: Degrees
    device_mesh: Any  # None for a layout over only the first ranks of the job (see build_mesh)
    ulysses_group: Any
    ring_group: Any
    sequence_group: Any
    cfg_group: Any
    # This rank's index among the ranks sharing its sequence: which shard it holds.
    sequence_rank: int
    # Every rank of the layout: the whole job (WORLD), or a group of its first ranks.
    group: Any = None


# None records a layout this rank took part in creating but is not a member of. Keyed by the
# job's default group too: a process group destroyed and started again needs new meshes.
_meshes: dict[tuple[Any, str, Degrees], ParallelMesh | None] = {}


def build_mesh(degrees: Degrees, device_type: str, first_ranks: bool = False) -> ParallelMesh | None:
    """The named (cfg, ring, ulysses) mesh over the current world; built once per layout and reused.

    `first_ranks=True` allows a layout smaller than the job, over its first ranks (`accel bench`
    runs a 2-GPU variant inside an 8-GPU job). Creating groups is collective, so every rank of the
    job calls it; the others get None. A later call for the same layout, on a member rank, finds
    the mesh again without `first_ranks`."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    key = (dist.group.WORLD, device_type, degrees)
    if key in _meshes and (_meshes[key] is not None or first_ranks):
        return _meshes[key]
    world = dist.get_world_size()
    if world != degrees.world_size and not (first_ranks and degrees.world_size < world):
        raise UserError(
            f"[parallel] {degrees.describe()} needs {degrees.world_size} processes, but this job has "
            f"{world}; change the degrees or the number of processes"
        )
    if world == degrees.world_size:
        mesh = init_device_mesh(device_type, (degrees.cfg, degrees.ring, degrees.ulysses), mesh_dim_names=MESH_DIMS)
        sequence = flattened_group(mesh, ("ring", "ulysses"))
        _meshes[key] = ParallelMesh(
            degrees=degrees,
            device_mesh=mesh,
            ulysses_group=mesh.get_group("ulysses"),
            ring_group=mesh.get_group("ring"),
            sequence_group=sequence,
            cfg_group=mesh.get_group("cfg"),
            sequence_rank=dist.get_rank(sequence),
            group=dist.group.WORLD,
        )
    else:
        _meshes[key] = _first_ranks_mesh(degrees)
    return _meshes[key]


def _first_ranks_mesh(degrees: Degrees) -> ParallelMesh | None:
    """The layout over ranks 0 … n-1 from public group enumerations, created in one fixed order on
    every rank of the job (new_group is collective); None on the ranks outside it."""
    import torch
    import torch.distributed as dist

    grid = torch.arange(degrees.world_size).reshape(degrees.cfg, degrees.ring, degrees.ulysses)

    def groups(order: tuple[int, int, int], size: int) -> Any:
        return dist.new_subgroups_by_enumeration(grid.permute(*order).reshape(-1, size).tolist())[0]

    ulysses = groups((0, 1, 2), degrees.ulysses)
    ring = groups((0, 2, 1), degrees.ring)
    cfg = groups((1, 2, 0), degrees.cfg)
    sequence = groups((0, 1, 2), degrees.sequence)
    everyone = dist.new_group(list(range(degrees.world_size)))
    if dist.get_rank() >= degrees.world_size:
        return None
    return ParallelMesh(degrees, None, ulysses, ring, sequence, cfg, dist.get_rank(sequence), everyone)


def build_replica_meshes(degrees: Degrees, device_type: str, replicas: int) -> ParallelMesh:
    """`replicas` copies of one layout side by side (`accel serve --replicas`): a replica dimension
    outside cfg × ring × ulysses, ranks r·n … r·n + n − 1 in replica r. Every rank creates every
    replica's groups (new_group is collective) and keeps its own replica's mesh, where `build_mesh`
    (and so `accel.apply`) finds it."""
    import torch
    import torch.distributed as dist

    size = degrees.world_size
    if dist.get_world_size() != replicas * size:
        raise UserError(f"{replicas} replicas of {degrees.describe()} need {replicas * size} processes, not {dist.get_world_size()}")
    grid = torch.arange(replicas * size).reshape(replicas, degrees.cfg, degrees.ring, degrees.ulysses)

    def groups(order: tuple[int, int, int], length: int) -> Any:
        return dist.new_subgroups_by_enumeration(grid.permute(0, *(o + 1 for o in order)).reshape(-1, length).tolist())[0]

    ulysses = groups((0, 1, 2), degrees.ulysses)
    ring = groups((0, 2, 1), degrees.ring)
    cfg = groups((1, 2, 0), degrees.cfg)
    sequence = groups((0, 1, 2), degrees.sequence)
    everyone = dist.new_subgroups_by_enumeration(grid.reshape(replicas, size).tolist())[0]
    mesh = ParallelMesh(degrees, None, ulysses, ring, sequence, cfg, dist.get_rank(sequence), everyone)
    _meshes[(dist.group.WORLD, device_type, degrees)] = mesh
    return mesh


def flattened_group(mesh: Any, dims: tuple[str, ...]) -> Any:
    """One process group over several mesh dims. DeviceMesh._flatten is private, so it sits behind
    this function with a public fallback (new_subgroups_by_enumeration over the mesh's rank grid)."""
    try:
        return mesh[dims]._flatten("_".join(dims)).get_group()
    except (AttributeError, NotImplementedError, RuntimeError, TypeError):
        return flattened_group_fallback(mesh, dims)


def flattened_group_fallback(mesh: Any, dims: tuple[str, ...]) -> Any:
    import torch.distributed as dist

    names = list(mesh.mesh_dim_names)
    grid = mesh.mesh.permute(*[names.index(n) for n in names if n not in dims], *[names.index(n) for n in dims])
    size = math.prod(mesh.mesh.shape[names.index(n)] for n in dims)
    ranks = grid.reshape(-1, size).tolist()
    group, _ = dist.new_subgroups_by_enumeration(ranks)
    return group
