"""accel's ParallelPlan from a diffusers `_cp_plan`, so a plan diffusers ships is not written twice.

diffusers' plan maps a module name ("" the transformer, "blocks.0", "blocks.*") to the tensors to
cut there (an argument name, or an item index of the module's returned tuple) and names the module
whose output is gathered. accel's engine needs more than that to pad any length and to know which
keys an attention call sees: which tensors are one sequence (a stream). `FromDiffusers.streams`
adds exactly that; everything else is read from diffusers' plan, so a change of the plan in
diffusers reaches accel.

A transformer no family describes names no streams: `learned_streams` reads them off one run at two
token counts (a cut as long as the main stream at both is that stream, one as long as the text at
both is the text), and the automatic plan's reading of its attention completes the plan
(accel/parallel/diffusers_candidates.py), verified before use like any plan learned.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from accel.parallel.plan_format import FromDiffusers, ParallelPlan, SequenceSplit
from accel.models.probe import named_arguments
from accel.parallel.matching import glob_modules

DIFFUSERS = "diffusers _cp_plan"  # a plan's origin, as reports name it


class PlanDerivationError(TypeError):
    """A diffusers `_cp_plan` that `FromDiffusers` cannot turn into an accel plan."""


def derive_plan(cp_plan: Mapping[str, Any], spec: FromDiffusers) -> ParallelPlan:
    """Translate diffusers' `_cp_plan` (ContextParallelInput / ContextParallelOutput entries) under `spec`."""
    streams = dict(spec.streams)
    splits: list[SequenceSplit] = []
    kept: set[str] = set()
    for module, entry in cp_plan.items():
        if _is_output(entry):
            continue
        if not isinstance(entry, Mapping):
            raise PlanDerivationError(f"_cp_plan[{module!r}] is neither a mapping of inputs nor an output")
        for key, value in entry.items():
            if isinstance(value, (list, tuple)):
                raise PlanDerivationError(f"_cp_plan[{module!r}][{key!r}] lists several cuts of one tensor")
            if _is_output(value):
                continue
            if _stream_key(module, key) in spec.keep_whole:
                kept.add(_stream_key(module, key))
                continue
            splits.append(_split(module, key, value, streams))
    outputs = _gathers(cp_plan)
    if len(outputs) != 1:
        raise PlanDerivationError(f"_cp_plan gathers at {len(outputs)} places; accel gathers one output")
    module, dim = outputs[0]
    if set(spec.keep_whole) - kept:
        raise PlanDerivationError(
            f"the family keeps {sorted(set(spec.keep_whole) - kept)[0]!r} whole, which _cp_plan does not cut"
        )
    unused = set(streams) - {
        _stream_key(split.module, split.value if split.element is None else split.element) for split in splits
    }
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
        origin=DIFFUSERS,
    )


def readable_cp_plan(transformer_class: type) -> bool:
    """Whether the class ships a `_cp_plan` accel's engine can follow: one gather (MiniMax-H3's
    gathers video and audio apart)."""
    return len(_gathers(getattr(transformer_class, "_cp_plan", None) or {})) == 1


def _gathers(cp_plan: Mapping[str, Any]) -> list[tuple[str, int]]:
    """(module, dim) of every gather a `_cp_plan` states, in its order."""
    found = []
    for module, entry in cp_plan.items():
        values = entry.values() if isinstance(entry, Mapping) else (entry,)
        found += [(module, int(value.gather_dim)) for value in values if _is_output(value)]
    return found


def cut_keys(cp_plan: Mapping[str, Any]) -> list[str]:
    """Every cut of a `_cp_plan`, keyed as `FromDiffusers.streams` keys it."""
    return [
        _stream_key(module, key)
        for module, entry in cp_plan.items()
        if isinstance(entry, Mapping)
        for key, value in entry.items()
        if not _is_output(value)
    ]


def cut_lengths(transformer: torch.nn.Module, run: Callable[[], Any]) -> dict[str, int | None]:
    """How long each tensor the class's `_cp_plan` cuts is along its cut dim while `run()` runs the
    transformer (None: a tensor of another rank than the plan expects, which diffusers leaves whole),
    keyed as `FromDiffusers.streams` keys it; a cut whose tensor never came is missing. A pattern
    ("blocks.*") is read at its first module."""
    cp_plan = getattr(type(transformer), "_cp_plan", None) or {}
    modules = dict(transformer.named_modules())
    lengths: dict[str, int | None] = {}
    handles = []

    def read(key: str, value: Any, cut: Any) -> None:
        if isinstance(value, torch.Tensor) and lengths.get(key) is None:
            expected = getattr(cut, "expected_dims", None)
            lengths[key] = None if expected is not None and value.dim() != expected else value.shape[int(cut.split_dim)]

    for module_name, entry in cp_plan.items():
        if _is_output(entry) or not isinstance(entry, Mapping):
            continue
        inputs = {key: cut for key, cut in entry.items() if isinstance(key, str) and not _is_output(cut)}
        items = {key: cut for key, cut in entry.items() if isinstance(key, int) and not _is_output(cut)}
        for module in [transformer] if module_name == "" else glob_modules(modules, module_name)[:1]:

            def before(mod: torch.nn.Module, args: Any, kwargs: Any, inputs: dict[str, Any] = inputs) -> None:
                arguments = named_arguments(mod, args, kwargs)
                for key, cut in inputs.items():
                    read(key, arguments.get(key), cut)

            def after(
                _mod: torch.nn.Module,
                _args: Any,
                output: Any,
                module_name: str = module_name,
                items: dict[int, Any] = items,
            ) -> None:
                for index, cut in items.items():
                    if isinstance(output, (tuple, list)) and index < len(output):
                        read(_stream_key(module_name, index), output[index], cut)

            handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(module.register_forward_hook(after))
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return lengths


def learned_streams(
    keys: list[str],
    lengths: dict[str, int | None],
    other: dict[str, int | None],
    stream: tuple[str, int, int],
    text: tuple[str, int] | None,
) -> tuple[tuple[str, str], ...] | None:
    """Each cut's stream from its lengths in two runs (`lengths`, `other`): (name, length, other length)
    of the main stream, (name, length) of the text. A cut of a tensor of another rank in both runs is
    named the main stream (diffusers leaves it whole); None where a cut follows neither stream, or its
    tensor never came (a mask the probe's prompt did not need): its stream cannot be learned."""
    name, length, more = stream
    streams = []
    for key in keys:
        if key not in lengths or key not in other:
            return None
        sizes = (lengths[key], other[key])
        if sizes == (length, more) or sizes == (None, None):
            streams.append((key, name))
        elif text is not None and sizes == (text[1], text[1]):
            streams.append((key, text[0]))
        else:
            return None
    return tuple(streams)


def _split(module: str, key: str | int, value: Any, streams: dict[str, str]) -> SequenceSplit:
    name = _stream_key(module, key)
    if name not in streams:
        raise PlanDerivationError(f"_cp_plan cuts {name!r}, but the family does not say which stream it belongs to")
    if bool(getattr(value, "split_output", False)) != isinstance(key, int):
        # diffusers marks the items of a module's returned tuple with int keys and split_output
        raise PlanDerivationError(
            f"_cp_plan[{module!r}][{key!r}]: only the items of a returned tuple are cut after the module"
        )
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
