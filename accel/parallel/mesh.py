"""Parallel degrees (cfg × ring × ulysses × tp), their checks, and the device mesh that carries them.

The nesting, outermost first, is cfg, ring, ulysses, tp: tensor parallelism is innermost because
it communicates most (an all-reduce of the whole activation after every row-wise layer, twice a
block), so its ranks are neighbours (one node, the fastest links); Ulysses' all-to-alls come
next, Ring's overlapped passes next, and the CFG halves, which exchange one output per step, are
outermost. A Ulysses group holds ranks of one TP index, so it exchanges the TP group's local heads.

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
from accel.recipe.sections import ParallelSection

MESH_DIMS = ("cfg", "ring", "ulysses", "tp")


@dataclass(frozen=True)
class Degrees:
    ulysses: int = 1
    ring: int = 1
    cfg: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.ulysses * self.ring * self.cfg * self.tp

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The mesh's extent along MESH_DIMS."""
        return (self.cfg, self.ring, self.ulysses, self.tp)

    @property
    def sequence(self) -> int:
        """Ranks that share one sequence (Ulysses × Ring)."""
        return self.ulysses * self.ring

    def describe(self) -> str:
        parts = [
            f"{name} {getattr(self, name)}" for name in ("tp", "ulysses", "ring", "cfg") if getattr(self, name) > 1
        ]
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
    """Degrees from a recipe's [parallel]: given ones are checked, and with `gpus` but no Ulysses or
    Ring those two are chosen for the ranks left after CFG and TP (Ulysses by `chosen_ulysses` over
    each TP rank's heads, the rest Ring). TP must divide the heads; a given Ulysses degree need not
    divide a TP rank's heads (they are padded, see accel.parallel.attention) but may not exceed
    them: a rank would hold no real head. `heads=None` skips the head checks."""
    ulysses, ring, cfg, tp, gpus = settings.ulysses, settings.ring, settings.cfg, settings.tp, settings.gpus
    check_tp(tp, heads, model)
    local_heads = heads // tp if heads is not None else None
    if settings.chooses_degrees:
        if gpus % (cfg * tp):
            if tp == 1:
                raise UserError(
                    f"[parallel] gpus = {gpus} does not split into cfg = {cfg} halves; use an even number of GPUs"
                )
            halves = f"cfg = {cfg} halves of " if cfg > 1 else ""
            raise UserError(
                f"[parallel] gpus = {gpus} does not split into {halves}tp = {tp} ranks; use a multiple of {cfg * tp} "
                "GPUs"
            )
        sequence = gpus // (cfg * tp)
        best = chosen_ulysses(sequence, local_heads)
        return Degrees(ulysses=best, ring=sequence // best, cfg=cfg, tp=tp)
    degrees = Degrees(ulysses=ulysses, ring=ring, cfg=cfg, tp=tp)
    if gpus and degrees.world_size != gpus:
        product = f"ulysses {ulysses} × ring {ring} × cfg {cfg}" + (f" × tp {tp}" if tp > 1 else "")
        leave = "ulysses and ring" if tp > 1 else "the degrees"
        raise UserError(
            f"[parallel] {product} = {degrees.world_size} processes, but gpus = {gpus}; make the product {gpus} or "
            f"leave {leave} "
            "out to have them chosen"
        )
    check_heads(degrees, heads, model)
    return degrees


def parallel_degrees(pipe: Any, settings: ParallelSection) -> Degrees:
    """The layout [parallel] asks for on this pipeline, its degrees checked against the loaded heads."""
    from accel.models.parts import transformers_of
    from accel.models.registry import family_of

    family = family_of(pipe)
    counts = [family.heads_in(t.config) for t in transformers_of(pipe, family).values()]
    heads = min((count for count in counts if count is not None), default=None)
    return resolve_degrees(settings, heads, family.title)


def divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


def degrees_that_divide(width: int, limit: int = 64) -> str:
    """'2, 3, 4 or 6': the TP degrees above 1 (up to `limit`) that split `width` evenly."""
    choices = [str(d) for d in divisors(width) if 1 < d <= limit]
    if not choices:
        return "none above 1 (run it with tp = 1)"
    return ", ".join(choices[:-1]) + " or " + choices[-1] if len(choices) > 1 else choices[0]


def check_tp(tp: int, heads: int | None, model: str = "the model") -> None:
    """Refuses a TP degree that does not divide the head count: each TP rank holds whole heads."""
    if tp == 1 or heads is None or heads % tp == 0:
        return
    raise UserError(
        f"[parallel] tp = {tp} does not divide the {heads} attention heads of {model}; use tp = "
        f"{degrees_that_divide(heads)}"
    )


def check_heads(degrees: Degrees, heads: int | None, model: str = "the model") -> None:
    """Refuses a Ulysses degree above the heads a TP rank holds (some rank would compute padding only)."""
    if heads is None:
        return
    local = heads // degrees.tp
    if degrees.ulysses <= local:
        return
    best = chosen_ulysses(degrees.sequence, local)
    held = (
        f"the {heads} attention heads of {model}"
        if degrees.tp == 1
        else f"the {local} attention heads each of tp = {degrees.tp} ranks holds of {model}'s {heads}"
    )
    raise UserError(
        f"[parallel] ulysses = {degrees.ulysses} is more than {held}; "
        f"use ulysses = {best}, ring = {degrees.sequence // best} for {degrees.sequence} sequence-parallel ranks"
    )


def tp_slice(settings: ParallelSection) -> tuple[int, int] | None:
    """(degree, index) of the tensor-parallel slice this rank holds under [parallel] (None: no TP).
    TP is the mesh's innermost dimension, so a rank's index in its TP group is its rank modulo tp."""
    from accel.launch.environment import rank

    tp = settings.tp
    return (tp, rank() % tp) if tp > 1 and settings.world_size > 1 else None


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
    if (
        "torch.distributed" not in sys.modules
    ):  # nothing imported it (accel models, --help): no group, and torch stays unloaded
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
    # The ranks that split one sequence's weights, and which slice this rank holds.
    tp_group: Any = None
    tp_rank: int = 0
    # The ranks that share one transformer call (sequence × tp): a decision about the call is theirs.
    call_group: Any = None


# None records a layout this rank took part in creating but is not a member of. Keyed by the
# job's default group too: a process group destroyed and started again needs new meshes.
_meshes: dict[tuple[Any, str, Degrees], ParallelMesh | None] = {}

# Each group of a layout, as the mesh dims it runs along.
_GROUP_DIMS = {
    "ulysses": ("ulysses",),
    "ring": ("ring",),
    "cfg": ("cfg",),
    "tp": ("tp",),
    "sequence": ("ring", "ulysses"),
    "call": ("ring", "ulysses", "tp"),
}


def build_mesh(degrees: Degrees, device_type: str, first_ranks: bool = False) -> ParallelMesh | None:
    """The named (cfg, ring, ulysses, tp) mesh over the current world; built once per layout and reused.

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
        mesh = init_device_mesh(device_type, degrees.shape, mesh_dim_names=MESH_DIMS)
        groups = {
            name: mesh.get_group(dims[0]) if len(dims) == 1 else flattened_group(mesh, dims)
            for name, dims in _GROUP_DIMS.items()
        }
        _meshes[key] = _mesh_of(degrees, mesh, groups, dist.group.WORLD)
    else:
        _meshes[key] = _first_ranks_mesh(degrees)
    return _meshes[key]


def _mesh_of(degrees: Degrees, device_mesh: Any, groups: dict[str, Any], everyone: Any) -> ParallelMesh:
    import torch.distributed as dist

    return ParallelMesh(
        degrees,
        device_mesh,
        groups["ulysses"],
        groups["ring"],
        groups["sequence"],
        groups["cfg"],
        dist.get_rank(groups["sequence"]),
        everyone,
        groups["tp"],
        dist.get_rank(groups["tp"]),
        groups["call"],
    )


def _enumerated_groups(grid: Any, leading: int) -> dict[str, Any]:
    """Every group of a layout from a rank grid whose last four dims are MESH_DIMS (after `leading`
    dims of replicas), each created in one fixed order on every rank (new_group is collective)."""
    import math

    import torch.distributed as dist

    groups = {}
    for name, dims in _GROUP_DIMS.items():
        along = [leading + MESH_DIMS.index(dim) for dim in dims]
        others = [d for d in range(grid.dim()) if d not in along]
        size = math.prod(grid.shape[d] for d in along)
        groups[name] = dist.new_subgroups_by_enumeration(grid.permute(*others, *along).reshape(-1, size).tolist())[0]
    return groups


def _first_ranks_mesh(degrees: Degrees) -> ParallelMesh | None:
    """The layout over ranks 0 … n-1 from public group enumerations; None on the ranks outside it."""
    import torch
    import torch.distributed as dist

    groups = _enumerated_groups(torch.arange(degrees.world_size).reshape(degrees.shape), 0)
    everyone = dist.new_group(list(range(degrees.world_size)))
    if dist.get_rank() >= degrees.world_size:
        return None
    return _mesh_of(degrees, None, groups, everyone)


def build_replica_meshes(degrees: Degrees, device_type: str, replicas: int) -> ParallelMesh:
    """`replicas` copies of one layout side by side (`accel serve --replicas`): a replica dimension
    outside cfg × ring × ulysses × tp, ranks r·n … r·n + n − 1 in replica r. Every rank creates every
    replica's groups (new_group is collective) and keeps its own replica's mesh, where `build_mesh`
    (and so `accel.apply`) finds it."""
    import torch
    import torch.distributed as dist

    size = degrees.world_size
    if dist.get_world_size() != replicas * size:
        raise UserError(
            f"{replicas} replicas of {degrees.describe()} need {replicas * size} processes, not {dist.get_world_size()}"
        )
    grid = torch.arange(replicas * size).reshape(replicas, *degrees.shape)
    groups = _enumerated_groups(grid, 1)
    everyone = dist.new_subgroups_by_enumeration(grid.reshape(replicas, size).tolist())[0]
    mesh = _mesh_of(degrees, None, groups, everyone)
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
