"""Verification of a context-parallel plan no tested family wrote, before it is used.

The plan runs on N simulated ranks in this process (accel/parallel/simulate.py: the same engine,
the same collectives, one copy of the weights) on a small real input, and every rank's output is
compared with the unsplit forward's. Equal within the dtype's tolerance: the plan is used. Otherwise
context parallelism is refused in one line naming the first module whose output differs, found by a
second, recorded run. Never silently wrong. Which candidate is used, and the verdicts kept on disk,
are accel/parallel/choose.py's and accel/parallel/verdicts.py's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from accel.errors import first_line
from accel.parallel.layout import SequenceLayout
from accel.parallel.observe import TransformerCall
from accel.parallel.outputs import tensors_of
from accel.parallel.plan_format import ParallelPlan
from accel.parallel.simulate import run_ranks, simulated_meshes, weight_sharing_copy

# Largest difference from one process, as a share of the output's largest magnitude, that a plan may
# make: float32 differs only by summation order; half types by rounding at every block.
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-3}
HALF_TOLERANCE = 3e-2
RECORD_DEPTH = 3  # module names of up to three parts (blocks.3.attn) are compared when locating a divergence


@dataclass(frozen=True)
class Verdict:
    exact: bool
    error: float = 0.0
    reason: str = ""  # why not exact, one line


def tolerance(dtype: torch.dtype) -> float:
    return TOLERANCE.get(dtype, HALF_TOLERANCE)


def verify_plan(
    transformer: nn.Module, plan: ParallelPlan, call: TransformerCall, ulysses: int, ring: int, reference: Any = None
) -> Verdict:
    """Whether `plan` on ulysses × ring simulated ranks gives `transformer`'s unsplit output on `call`."""
    if reference is None:
        args, kwargs = call.fresh()
        with torch.no_grad():
            reference = transformer(*args, **kwargs)
    expected = list(tensors_of(reference))
    try:
        outputs = _split_run(transformer, plan, call, ulysses, ring)
    except Exception as error:  # the plan's failure on this model, whatever it is, is the verdict
        return Verdict(False, float("inf"), f"it fails on {ulysses * ring} simulated ranks: {first_line(error)}")
    worst = 0.0
    for output in outputs:
        got = list(tensors_of(output))
        if len(got) != len(expected) or any(a.shape != b.shape for a, b in zip(got, expected)):
            return Verdict(
                False,
                float("inf"),
                f"its output on {ulysses * ring} simulated ranks has other shapes than one process's",
            )
        worst = max([worst, *(_relative(a, b) for a, b in zip(got, expected))])
    dtype = expected[0].dtype if expected else torch.float32
    if worst <= tolerance(dtype):
        return Verdict(True, worst)
    where = first_divergence(transformer, plan, call, ulysses, ring, tolerance(dtype))
    return Verdict(
        False,
        worst,
        f"on {ulysses * ring} simulated ranks its output differs from one process's by "
        f"{worst:.1e} of its scale, first at {where}",
    )


def _split_run(
    transformer: nn.Module,
    plan: ParallelPlan,
    call: TransformerCall,
    ulysses: int,
    ring: int,
    record: dict[int, dict[str, list[Tensor]]] | None = None,
) -> list[Any]:
    from accel.parallel.engine import ContextParallel

    meshes = simulated_meshes(ulysses, ring)
    copies = [weight_sharing_copy(transformer) for _ in meshes]
    engines, handles = [], []
    try:
        for rank, (copy, mesh) in enumerate(zip(copies, meshes)):
            engines.append(ContextParallel(copy, plan, mesh))
            if record is not None:
                record[rank] = {}
                handles += _recorders(copy, record[rank])

        def forward(rank: int, _mesh: Any) -> Any:
            args, kwargs = call.fresh()
            return copies[rank](*args, **kwargs)

        return run_ranks(meshes, forward)
    finally:
        for handle in handles:
            handle.remove()
        for engine in engines:
            engine.remove()


def _recorders(transformer: nn.Module, into: dict[str, list[Tensor]]) -> list[Any]:
    """Hooks keeping the first output of each shallow module, in call order (dicts keep insertion order)."""
    handles = []
    for name, module in transformer.named_modules():
        if not name or len(name.split(".")) > RECORD_DEPTH:
            continue

        def keep(_module: nn.Module, _args: Any, output: Any, name: str = name) -> None:
            if name not in into:
                into[name] = [t.detach().clone() for t in tensors_of(output)]

        handles.append(module.register_forward_hook(keep))
    return handles


def first_divergence(
    transformer: nn.Module, plan: ParallelPlan, call: TransformerCall, ulysses: int, ring: int, limit: float
) -> str:
    """The first module (in the unsplit forward's order) whose output the split run does not reproduce."""
    reference: dict[str, list[Tensor]] = {}
    handles = _recorders(transformer, reference)
    try:
        with torch.no_grad():
            args, kwargs = call.fresh()
            transformer(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    ranks: dict[int, dict[str, list[Tensor]]] = {}
    try:
        _split_run(transformer, plan, call, ulysses, ring, record=ranks)
    except Exception:  # noqa: BLE001 - already judged; what was recorded before the failure still locates it
        pass
    modules = dict(transformer.named_modules())
    for name, expected in reference.items():
        per_rank = [ranks.get(rank, {}).get(name) for rank in range(ulysses * ring)]
        if any(outputs is None for outputs in per_rank):
            return f"{name} ({type(modules[name]).__name__}), which the split run never reached"
        for index, tensor in enumerate(expected):
            shards = [outputs[index] for outputs in per_rank if index < len(outputs)]
            error = _shard_error(tensor, shards)
            if error is not None and error > limit:
                return f"{name} ({type(modules[name]).__name__})"
    return "the transformer's output"


def _shard_error(expected: Tensor, shards: Sequence[Tensor]) -> float | None:
    """How far the ranks' tensors are from `expected`: each rank's whole copy, or their shards joined
    along the one dim they are cut on; None where the tensors are neither (several streams in one)."""
    if not shards:
        return None
    if all(shard.shape == expected.shape for shard in shards):
        return max(_relative(shard, expected) for shard in shards)
    dims = [
        d
        for d in range(expected.dim())
        if shards[0].dim() == expected.dim() and shards[0].shape[d] != expected.shape[d]
    ]
    if len(dims) != 1 or any(shard.shape != shards[0].shape for shard in shards):
        return None
    layout = SequenceLayout(expected.shape[dims[0]], len(shards))
    if layout.shard != shards[0].shape[dims[0]]:
        return None
    return _relative(layout.join(list(shards), dims[0]), expected)


def _relative(got: Tensor, expected: Tensor) -> float:
    expected = expected.float()
    if expected.numel() == 0:
        return 0.0
    scale = max(expected.abs().max().item(), 1e-6)
    return (got.float() - expected).abs().max().item() / scale
