"""accel's ParallelPlan from a diffusers `_cp_plan`, so a plan diffusers ships is not written twice.

diffusers' plan maps a module name ("" the transformer, "blocks.0", "blocks.*") to the tensors to
cut there (an argument name, or an item index of the module's returned tuple) and names the module
whose output is gathered. accel's engine needs more than that to pad any length and to know which
keys an attention call sees: which tensors are one sequence (a stream). `FromDiffusers.streams`
adds exactly that; everything else is read from diffusers' plan, so a change of the plan in
diffusers reaches accel.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from accel.models.base import FromDiffusers, ParallelPlan, SequenceSplit


class PlanDerivationError(TypeError):
    """A diffusers `_cp_plan` that `FromDiffusers` cannot turn into an accel plan."""


def resolve_plan(plan: ParallelPlan | FromDiffusers, transformer: torch.nn.Module) -> ParallelPlan:
    """The ParallelPlan to run on `transformer`: `plan` itself, or derived from the class's `_cp_plan`."""
    if isinstance(plan, ParallelPlan):
        return plan
    cp_plan = getattr(type(transformer), "_cp_plan", None)
    if not cp_plan:
        raise PlanDerivationError(
            f"{type(transformer).__name__} has no diffusers _cp_plan to derive the parallel plan from; "
            "this diffusers version may predate it (upgrade diffusers)"
        )
    return derive_plan(cp_plan, plan)


def derive_plan(cp_plan: Mapping[str, Any], spec: FromDiffusers) -> ParallelPlan:
    """Translate diffusers' `_cp_plan` (ContextParallelInput / ContextParallelOutput entries) under `spec`."""
    streams = dict(spec.streams)
    splits: list[SequenceSplit] = []
    outputs: list[tuple[str, int]] = []
    kept: set[str] = set()
    for module, entry in cp_plan.items():
        if _is_output(entry):
            outputs.append((module, int(entry.gather_dim)))
            continue
        if not isinstance(entry, Mapping):
            raise PlanDerivationError(f"_cp_plan[{module!r}] is neither a mapping of inputs nor an output")
        for key, value in entry.items():
            if isinstance(value, (list, tuple)):
                raise PlanDerivationError(f"_cp_plan[{module!r}][{key!r}] lists several cuts of one tensor")
            if _is_output(value):
                outputs.append((module, int(value.gather_dim)))
                continue
            if _stream_key(module, key) in spec.keep_whole:
                kept.add(_stream_key(module, key))
                continue
            splits.append(_split(module, key, value, streams))
    if len(outputs) != 1:
        raise PlanDerivationError(f"_cp_plan gathers at {len(outputs)} places; accel gathers one output")
    module, dim = outputs[0]
    if set(spec.keep_whole) - kept:
        raise PlanDerivationError(f"the family keeps {sorted(set(spec.keep_whole) - kept)[0]!r} whole, which _cp_plan does not cut")
    unused = set(streams) - {_stream_key(split.module, split.value if split.element is None else split.element)
                             for split in splits}
    if unused:
        raise PlanDerivationError(f"the family names a stream for {sorted(unused)[0]!r}, which _cp_plan does not cut")
    return ParallelPlan(
        splits=(*splits, *spec.extra_splits),
        attention_keys=spec.attention_keys,
        output_stream=spec.output_stream,
        output_dim=dim,
        output_module=module,
        local_attention=spec.local_attention,
        batch_args=spec.batch_args,
        module_keys=spec.module_keys,
        batch_items=spec.batch_items,
        whole_queries=spec.whole_queries,
        grouped=spec.grouped,
    )


def _split(module: str, key: str | int, value: Any, streams: dict[str, str]) -> SequenceSplit:
    name = _stream_key(module, key)
    if name not in streams:
        raise PlanDerivationError(f"_cp_plan cuts {name!r}, but the family does not say which stream it belongs to")
    if bool(getattr(value, "split_output", False)) != isinstance(key, int):
        # diffusers marks the items of a module's returned tuple with int keys and split_output
        raise PlanDerivationError(f"_cp_plan[{module!r}][{key!r}]: only the items of a returned tuple are cut after the module")
    return SequenceSplit(
        value="output" if isinstance(key, int) else key,
        stream=streams[name],
        dim=int(value.split_dim),
        module=module,
        ndim=getattr(value, "expected_dims", None),
        element=key if isinstance(key, int) else None,
    )


def _stream_key(module: str, key: str | int) -> str:
    return f"{module}[{key}]" if isinstance(key, int) else key


def _is_output(entry: Any) -> bool:
    return hasattr(entry, "gather_dim")
