"""The generic engine that runs a family's `ParallelPlan` on one transformer instance.

Around the transformer's forward, and at the module boundaries the plan names: cut the planned
tensors into this rank's sequence shard (padding any length), route attention to the
context-parallel functions with pad keys and model masks applied, and gather the output so every
rank returns the full result. Hooks are registered on this transformer's modules only.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import Tensor

from accel.errors import NotAvailableError
from accel.hooks import PARALLEL, wrap
from accel.models.base import Family
from accel.parallel.plan_format import (
    AutomaticPlan,
    FromDiffusers,
    GroupedTokens,
    LeadingCount,
    ParallelPlan,
    SequenceSplit,
)
from accel.parallel.attention import leading_real, usp_attention, whole_query_attention
from accel.parallel.comm import all_gather
from accel.parallel.derive import resolve_plan
from accel.parallel.layout import SequenceLayout, group_runs
from accel.parallel.mesh import ParallelMesh
from accel.parallel.mode import AttentionRouter, bypassing_backend, is_whole_pairwise, key_mask
from accel.parallel.outputs import map_sample


def plan_of(family: Family, where: str) -> ParallelPlan | FromDiffusers | AutomaticPlan:
    """The family's parallel plan, or the one-line refusal (`where`: the flag or key that asked).
    A `FromDiffusers` plan is derived when the engine meets the transformer, an `AutomaticPlan`
    learned and verified when applied (accel/parallel/verify.py)."""
    if family.parallel is None:
        raise NotAvailableError(f"{where}: {family.title} has no context-parallel plan yet; run it on one process")
    return family.parallel


def untaught_message(where: str, pipeline_class: str, what: str) -> str:
    """The refusal of `what` (CFG or tensor parallelism) for a pipeline no family describes."""
    return (
        f"{where}: {pipeline_class} is not a family accel was taught, and {what} needs one (its context "
        "parallelism is planned automatically and verified before use); use ulysses / ring alone, or one process"
    )


def refuse_untaught_before_start(ref: Any, where: str, settings: Any) -> None:
    """A saved pipeline whose classes no family knows gets its layout's CFG and TP refused before any
    rank starts (a hub id's classes are known only once loaded, where apply refuses them alike)."""
    if ref.family is not None or ref.pipeline is None:
        return
    if settings.cfg > 1:
        raise NotAvailableError(untaught_message(where, ref.pipeline, "CFG parallelism"))
    if settings.tp > 1:
        raise NotAvailableError(untaught_message(where, ref.pipeline, "tensor parallelism"))


class PlanMismatch(TypeError):
    """The family's plan names something this transformer does not have."""


@dataclass(frozen=True)
class _Segment:
    """One stream's stretch of an attention call's keys on this rank (layout None: replicated)."""

    stream: str
    tokens: int
    layout: SequenceLayout | None


class ContextParallel:
    """Context parallelism on one transformer instance; `remove()` restores it exactly."""

    def __init__(self, transformer: torch.nn.Module, plan: ParallelPlan | FromDiffusers, mesh: ParallelMesh) -> None:
        self.plan = plan = resolve_plan(plan, transformer)
        _refuse_config(plan, transformer)
        self.mesh = mesh
        self.world, self.rank = mesh.degrees.sequence, mesh.sequence_rank
        # State of the forward call in progress.
        self._layouts: dict[str, SequenceLayout] = {}
        self._active = False
        self._local_depth = 0
        self._whole_query_depth = 0
        # Key streams of the attention calls in progress, innermost last (module_keys); empty: the plan's.
        self._keys: list[tuple[str, ...]] = []
        # Blocks are often handed the same tensor (a joint mask): cut it once and gather its mask
        # once per forward, so every block gets the same shard object and no repeated exchange.
        self._cuts = _PerTensor()
        self._gathered_masks = _PerTensor()
        # A whole-sequence pair mask is (B, H|1, N, N): one shared by every block (SkyReels-V2's) is
        # padded once; one made anew per block (diffusers repeats LTX-2's per head) is not held past it.
        self._pair_masks = _PerTensor(keep=1)
        # Deferred cuts of this call: value -> (the argument passed, the copy the transformer holds).
        self._pending: dict[str, tuple[Any, Any]] = {}
        self._undo: list[Callable[[], None]] = []
        # Whether the forward in progress sent any attention through `_attend`: a flag that compiled
        # blocks may set but never read (a counter would be a guarded value, recompiling each call).
        self._routed = False
        # Whether a forward has routed attention yet: that proves the processors reach the engine,
        # so a later forward with no attention at all is a cache's (TaylorSeer extrapolates every
        # attention output of a call), not a processor that bypasses it.
        self._proven = False
        # Whether any forward was cut, and any run whole (split_only_when): a run that cut none gained
        # nothing. Flags, as `_routed`, not counters.
        self.cut_any = self.ran_whole = False
        self._transformer = transformer

        self._signature = inspect.signature(transformer.forward)
        modules = dict(transformer.named_modules())
        by_module: dict[str, list[SequenceSplit]] = {}
        for split in plan.splits:
            by_module.setdefault(split.module, []).append(split)
        config = getattr(transformer, "config", {})
        counts_by_module: dict[str, list[LeadingCount]] = {}
        for count in plan.leading_counts:
            if count.when is None or config.get(count.when[0]) == count.when[1]:
                counts_by_module.setdefault(count.module, []).append(count)
        self._counts = counts_by_module.get("", [])
        for pattern in dict.fromkeys([*by_module, *counts_by_module]):
            splits, counts = by_module.get(pattern, []), counts_by_module.get(pattern, [])
            if not pattern:
                self._check_arguments(transformer, splits, counts)  # cut in `forward` itself
                continue
            for module in _matching(modules, pattern, transformer, "that the parallel plan splits at"):
                self._hook_splits(module, splits, counts)
        for split in plan.splits:  # after the splits above: a module's own cuts lay its streams out first
            if not split.at:
                continue
            if split.module:
                raise PlanMismatch(
                    f"context parallelism: the plan defers {split.value}, which only a transformer argument can be"
                )
            for module in _matching(modules, split.at, transformer, f"to cut {split.value} at"):
                self._hook(module.register_forward_pre_hook(lambda *_, split=split: self._cut_deferred(split)))
        if plan.output_module and plan.output_before:
            for module in _matching(modules, plan.output_module, transformer, "to gather the output at"):
                self._hook(module.register_forward_pre_hook(self._gather_first_argument(module), with_kwargs=True))
        elif plan.output_module:
            for module in _matching(modules, plan.output_module, transformer, "to gather the output at"):
                self._hook(module.register_forward_hook(lambda _m, _a, out: self._gather(out)))
        for pattern in plan.local_attention:
            for module in _matching(modules, pattern, transformer, "(local attention)"):
                self._hook(module.register_forward_pre_hook(lambda *_: self._enter_local()))
                self._hook(module.register_forward_hook(lambda *_: self._leave_local(), always_call=True))
        for pattern in plan.whole_queries:
            for module in _matching(modules, pattern, transformer, "(whole queries)"):
                self._hook(module.register_forward_pre_hook(lambda *_: self._enter_whole_queries()))
                self._hook(module.register_forward_hook(lambda *_: self._leave_whole_queries(), always_call=True))
        for grouped in plan.grouped:
            for module in _matching(
                modules, grouped.module, transformer, "that the parallel plan runs by token groups"
            ):
                self._hook_groups(module, grouped)
        for pattern, keys in plan.module_keys:  # may match nothing: SD 3.5 large has no attn2, medium has
            for module in glob_modules(modules, pattern):
                self._hook(module.register_forward_pre_hook(lambda *_, keys=keys: self._keys.append(keys)))
                self._hook(module.register_forward_hook(lambda *_: self._leave_keys(), always_call=True))
        # The innermost layer of the transformer's forward: CFG and a whole-transformer compile wrap it.
        self._undo.append(wrap(transformer, "forward", "accel.context_parallel", PARALLEL, self.forward))

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()

    # -- installing ------------------------------------------------------------------------------
    def _hook(self, handle: Any) -> None:
        self._undo.append(handle.remove)

    def _check_arguments(
        self, module: torch.nn.Module, splits: list[SequenceSplit], counts: Sequence[LeadingCount] = ()
    ) -> inspect.Signature:
        signature = inspect.signature(module.forward)
        missing = [
            split.value for split in splits if split.value != "output" and split.value not in signature.parameters
        ]
        if missing:
            raise PlanMismatch(
                f"{type(module).__name__}.forward has no argument {missing[0]!r} that the parallel plan splits"
            )
        missing = [count.value for count in counts if count.value not in signature.parameters]
        if missing:
            raise PlanMismatch(
                f"{type(module).__name__}.forward has no argument {missing[0]!r} that the parallel plan rebases"
            )
        return signature

    def _hook_splits(self, module: torch.nn.Module, splits: list[SequenceSplit], counts: list[LeadingCount]) -> None:
        inputs = [split for split in splits if split.value != "output"]
        outputs = [split for split in splits if split.value == "output"]
        signature = self._check_arguments(module, splits, counts)

        def cut_inputs(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if not self._active:
                return None
            bound = signature.bind(*args, **kwargs)
            self._cut_arguments(bound.arguments, inputs)
            self._rebase_counts(bound.arguments, counts)  # after the cuts: they may lay the stream out
            return bound.args, bound.kwargs

        def cut_output(_module: Any, _args: Any, output: Any) -> Any:
            if not self._active:
                return None
            for split in outputs:
                output = self._cut(split, output)
            return output

        if inputs or counts:
            self._hook(module.register_forward_pre_hook(cut_inputs, with_kwargs=True))
        if outputs:
            self._hook(module.register_forward_hook(cut_output))

    def _hook_groups(self, module: torch.nn.Module, grouped: GroupedTokens) -> None:
        """Run `module` on this rank's tokens a run of groups at a time (see GroupedTokens), locally."""
        signature = inspect.signature(module.forward)
        missing = [name for name in (grouped.value, grouped.by) if name not in signature.parameters]
        if missing:
            raise PlanMismatch(
                f"{type(module).__name__}.forward has no argument {missing[0]!r} that the parallel plan groups by"
            )

        def forward(call_next: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            if not self._active:
                return call_next(*args, **kwargs)
            layout = self._layouts.get(grouped.stream)
            if layout is None:
                raise PlanMismatch(
                    f"context parallelism: {grouped.module} runs by token groups of the {grouped.stream} stream, "
                    "which nothing has cut yet"
                )
            bound = signature.bind(*args, **kwargs)
            tokens, by = bound.arguments[grouped.value], bound.arguments[grouped.by]
            groups = by.shape[grouped.by_dim]
            runs = group_runs(layout, self.rank, groups)
            outputs = []
            self._enter_local()
            try:
                # A shard of padding alone runs one token of the last group, so there is an output to shape.
                for start, count, first, many in [(r.start, r.tokens, r.first, r.groups) for r in runs] or [
                    (0, 1, groups - 1, 1)
                ]:
                    bound.arguments[grouped.value] = tokens.narrow(grouped.dim, start, count)
                    bound.arguments[grouped.by] = by.narrow(grouped.by_dim, first, many)
                    outputs.append(call_next(*bound.args, **bound.kwargs))
            finally:
                self._leave_local()
            real = sum(run.tokens for run in runs)
            if not runs:
                outputs = [outputs[0].narrow(grouped.dim, 0, 0)]
            padding = list(outputs[0].shape)
            padding[grouped.dim] = layout.shard - real
            return torch.cat([*outputs, outputs[0].new_zeros(padding)], grouped.dim)

        self._undo.append(wrap(module, "forward", "accel.context_parallel.groups", PARALLEL, forward))

    # -- the forward call ------------------------------------------------------------------------
    def forward(self, call_next: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The transformer's forward (`call_next`) on this rank's shard, the full output returned."""
        bound = self._signature.bind(*args, **kwargs)
        if self.plan.split_only_when is not None:
            argument, value = self.plan.split_only_when
            if bound.arguments.get(argument) != value:  # a call the plan runs whole on every rank
                self.ran_whole = True
                return call_next(*args, **kwargs)
            self.cut_any = True
        self._cut_arguments(bound.arguments, [split for split in self.plan.splits if not split.module and not split.at])
        self._rebase_counts(bound.arguments, self._counts)
        for split in self.plan.splits:
            if split.at and bound.arguments.get(split.value) is not None:
                bound.arguments[split.value] = self._defer(split, bound.arguments[split.value])
        self._refuse_diffusers_cache()
        self._active, self._routed = True, False
        try:
            with AttentionRouter(
                self._attend, lambda: self._local_depth > 0, self.plan.pairwise_mask, self.plan.causal_local
            ):
                output = call_next(*bound.args, **bound.kwargs)
            if not self._routed and not self._proven:  # every rank ran the same code, so every rank raises here alike
                raise NotAvailableError(self._unrouted())
            self._proven = True
            if not self.plan.output_module:
                output = self._gather(output)
        finally:  # the per-call state starts empty for the next call, however this one ended
            self._active, self._layouts, self._local_depth, self._whole_query_depth = False, {}, 0, 0
            self._keys.clear()
            self._pending.clear()
            self._cuts.clear()
            self._gathered_masks.clear()
            self._pair_masks.clear()
        return output

    def uncut_note(self) -> str | None:
        """A line for a run whose transformer calls all ran whole (split_only_when never matched)."""
        if self.cut_any or not self.ran_whole or self.plan.split_only_when is None:
            return None
        argument, value = self.plan.split_only_when
        return (
            f"context parallelism cut none of {type(self._transformer).__name__}'s calls: its plan cuts only "
            f"calls passing {argument}={value!r}, so every rank computed each call whole (no speedup from the sequence "
            "degree; the pipeline's own caching options decide which calls those are)"
        )

    def _refuse_diffusers_cache(self) -> None:
        """diffusers' cache hooks (enabled after apply) decide from each rank's shard alone, so ranks
        would part ways and deadlock in the next collective: refuse before the first one."""
        if getattr(self._transformer, "is_cache_enabled", False):
            name = type(self._transformer).__name__
            raise NotAvailableError(
                f"context parallelism: {name} has diffusers' own cache enabled (enable_cache), which decides on each "
                "rank's shard alone; call disable_cache() on it and use accel's [cache] instead, or run on one process"
            )

    def _unrouted(self) -> str:
        backend = bypassing_backend(self._transformer)
        why = f"its diffusers attention backend {backend!r} bypasses" if backend else "its attention processors bypass"
        return (
            f"context parallelism: {type(self._transformer).__name__}'s forward sent no attention call through the "
            f"parallel engine ({why} torch's scaled_dot_product_attention), so each rank attended only its own shard; "
            'call set_attention_backend("native") on it, use processors that call scaled_dot_product_attention, '
            "or run on one process"
        )

    def real_tokens(self, value: str) -> int | None:
        """During a forward: how many of this rank's tokens of the planned tensor `value` are real,
        the rest being padding at the shard's end (None: all are). Host arithmetic on the layout,
        so the cache can cut its residual on any device without a mask or a sync."""
        stream = next(
            (split.stream for split in self.plan.splits if split.value == value and isinstance(split.stream, str)), None
        )
        layout = self._layouts.get(stream) if stream is not None else None
        if layout is None or not layout.pad:
            return None
        return layout.real(self.rank)

    def _cut_arguments(self, arguments: dict[str, Any], splits: list[SequenceSplit]) -> None:
        for split in splits:
            if split.value in arguments:
                arguments[split.value] = self._cut(split, arguments[split.value])

    def _rebase_counts(self, arguments: dict[str, Any], counts: list[LeadingCount]) -> None:
        """Each count of a stream's leading tokens becomes how many of them this rank's shard holds
        (a trailing count: how many of its slots come after them, its padding included)."""
        for count in counts:
            total = arguments.get(count.value)
            if total is None:
                continue
            layout = self._layouts.get(count.stream)
            if layout is None:
                raise PlanMismatch(
                    f"context parallelism: {count.value} counts {count.stream} tokens, which nothing has cut yet"
                )
            if isinstance(total, bool) or not isinstance(total, (int, torch.SymInt)):
                raise PlanMismatch(
                    f"context parallelism: {count.value} counts {count.stream} tokens, so it must be an int, not "
                    f"{type(total).__name__}"
                )
            if count.trailing:
                leading = max(0, min(layout.length - total - self.rank * layout.shard, layout.shard))
                arguments[count.value] = layout.shard - leading
            else:
                arguments[count.value] = max(0, min(total - self.rank * layout.shard, layout.real(self.rank)))

    def _defer(self, split: SequenceSplit, value: Any) -> Any:
        """The copy of a list or mapping argument that the transformer gets, filled with the cut
        items when `split.at` starts (from `value`, which an outer layer may change until then)."""
        if isinstance(value, Mapping):
            own: Any = dict(value)
        elif isinstance(value, (list, tuple)):
            own = list(value)
        else:
            raise PlanMismatch(
                f"context parallelism: {split.value} is cut where {split.at} starts, so it must be a list or mapping, "
                f"not {type(value).__name__}"
            )
        self._pending[split.value] = (value, own)
        return own

    def _cut_deferred(self, split: SequenceSplit) -> None:
        pending = self._pending.pop(split.value, None) if self._active else None
        if pending is None:  # not passed, or cut at an earlier module of the pattern
            return
        source, own = pending
        now = replace(split, at="")
        for key, item in source.items() if isinstance(source, Mapping) else enumerate(source):
            own[key] = self._cut(now, item)

    def _cut(self, split: SequenceSplit, value: Any) -> Any:
        if split.element is not None:  # one item of a tuple whose items are different streams
            if not isinstance(value, (tuple, list)) or len(value) <= split.element:
                raise PlanMismatch(
                    f"context parallelism: {split.module or 'the transformer'}'s {split.value} has no item "
                    f"{split.element} to cut"
                )
            items = list(value)
            items[split.element] = self._cut(replace(split, element=None), items[split.element])
            return type(value)(items)
        if isinstance(value, (tuple, list)):
            return type(value)(self._cut(split, item) for item in value)
        if isinstance(value, Mapping):  # {block index: residual} (Z-Image's ControlNet)
            return {key: self._cut(split, item) for key, item in value.items()}
        if not isinstance(value, Tensor) or (split.ndim is not None and value.dim() != split.ndim):
            return value
        if split.broadcast and value.shape[split.dim] == 1:  # one value for every token: every rank keeps it
            return value
        return self._cuts.get(value, lambda: self._cut_tensor(split, value))

    def _cut_tensor(self, split: SequenceSplit, value: Tensor) -> Tensor:
        if len(split.streams) == 1:
            return self._layout(split.streams[0], value.shape[split.dim], split.value).split(
                value, split.dim, self.rank
            )
        whole = [name for name in split.streams if name in self.plan.whole_streams]
        missing = [name for name in split.streams if name not in self._layouts and name not in whole]
        if missing or len(whole) > 1:
            name = missing[0] if missing else whole[1]
            raise PlanMismatch(f"context parallelism: {split.value} spans the {name} stream, which nothing has cut yet")
        cut = sum(self._layouts[name].length for name in split.streams if name not in whole)
        lengths = [
            value.shape[split.dim] - cut if name in whole else self._layouts[name].length for name in split.streams
        ]
        parts = value.split(lengths, dim=split.dim)
        return torch.cat(
            [
                part if name in whole else self._layouts[name].split(part, split.dim, self.rank)
                for name, part in zip(split.streams, parts)
            ],
            dim=split.dim,
        )

    def _layout(self, stream: str, length: int, value: str) -> SequenceLayout:
        layout = self._layouts.setdefault(stream, SequenceLayout(length, self.world))
        if layout.length != length:
            raise ValueError(
                f"context parallelism: {value} has {length} {stream} tokens, other {stream} tensors {layout.length}"
            )
        return layout

    def _enter_local(self) -> None:
        self._local_depth += 1

    def _leave_local(self) -> None:
        self._local_depth = max(0, self._local_depth - 1)

    def _enter_whole_queries(self) -> None:
        self._whole_query_depth += 1

    def _leave_whole_queries(self) -> None:
        self._whole_query_depth = max(0, self._whole_query_depth - 1)

    def _leave_keys(self) -> None:
        if self._keys:
            self._keys.pop()

    # -- attention -------------------------------------------------------------------------------
    def _attend(self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scale: float | None) -> Tensor:
        self._routed = True
        segments = self._segments(key.shape[-2])
        if mask is not None and is_whole_pairwise(mask, query.shape[-2]):
            return self._attend_pairs(query, key, value, mask, scale, segments)
        if self._whole_query_depth > 0:
            return self._attend_whole_queries(query, key, value, mask, scale, segments)
        replicated = next((i for i, segment in enumerate(segments) if segment.layout is None), None)
        if replicated is not None and 0 < segments[replicated].tokens == key.shape[-2] - query.shape[-2]:
            return self._attend_shared_keys(query, key, value, mask, scale, segments, replicated)
        share = None
        if replicated is not None:
            if query.shape[-2] != key.shape[-2]:
                raise PlanMismatch("context parallelism: a replicated stream is only supported in joint self-attention")
            share = self._own_share(segments, replicated)
            query, key, value = (share.take(x, -2) for x in (query, key, value))
            segments = share.segments
        key_valid = self._pad_valid(segments, key.device)
        # Padding alone is known on the host; a model mask is data, so every block then applies it.
        real_keys = self._real_keys(segments) if key_valid is not None and mask is None else None
        if mask is not None:
            masks = self._every_rank_mask(mask, share)
            key_valid = masks if key_valid is None else key_valid & masks
        out = usp_attention(query, key, value, *self._usp_groups(), key_valid, scale, real_keys)
        return share.restore(out, self.mesh.sequence_group) if share is not None else out

    def _attend_shared_keys(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        mask: Tensor | None,
        scale: float | None,
        segments: list[_Segment],
        replicated: int,
    ) -> Tensor:
        """Queries of the cut streams alone against their keys and a replicated stretch every rank
        holds whole (Qwen-Image 2.1's cached prompt keys): the cut keys are attended as usual, the
        whole stretch by each rank's queries on their own, the two merged by log-sum-exp."""
        start, length = sum(segment.tokens for segment in segments[:replicated]), segments[replicated].tokens
        cut = [segment for index, segment in enumerate(segments) if index != replicated]

        def without(x: Tensor, dim: int) -> Tensor:
            return torch.cat(
                [x.narrow(dim, 0, start), x.narrow(dim, start + length, x.shape[dim] - start - length)], dim
            )

        shared_key, shared_value = key.narrow(-2, start, length), value.narrow(-2, start, length)
        key, value = without(key, -2), without(value, -2)
        key_valid = self._pad_valid(cut, key.device)
        real_keys = self._real_keys(cut) if key_valid is not None and mask is None else None
        shared_valid = None
        if mask is not None:
            local = key_mask(mask)
            shared_valid = local.narrow(-1, start, length)
            masks = self._gathered_masks.get(
                mask,
                lambda: torch.stack(all_gather(without(local, -1).to(torch.uint8), self.mesh.sequence_group)).bool(),
            )
            key_valid = masks if key_valid is None else key_valid & masks
        return usp_attention(
            query,
            key,
            value,
            *self._usp_groups(),
            key_valid,
            scale,
            real_keys,
            shared=(shared_key, shared_value, shared_valid),
        )

    def _attend_pairs(
        self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float | None, segments: list[_Segment]
    ) -> Tensor:
        """Self-attention of one cut stream under a mask the model built for every token pair of the
        whole stream: padded in shard order once per mask tensor and forward, then sliced per block."""
        layout = segments[0].layout if len(segments) == 1 else None
        if (
            layout is None
            or self._whole_query_depth > 0
            or query.shape[-2] != key.shape[-2]
            or mask.shape[-1] != layout.length
        ):
            raise NotAvailableError(
                "context parallelism: this transformer's attention mask relates every token pair (shape "
                f"{tuple(mask.shape)}), "
                "which the engine handles for the self-attention of one cut stream only; run it without [parallel]"
            )

        def pad() -> Tensor:
            if not layout.pad:
                return mask
            # Padding queries see every key (True, or bias 0): finite, and dropped with the padding;
            # padding keys are excluded by key_valid.
            padded = torch.nn.functional.pad(mask, (0, layout.pad, 0, layout.pad), value=0)
            if mask.dtype == torch.bool:
                padded[..., layout.length :, :] = True
            return padded

        pairs = self._pair_masks.get(mask, pad)
        key_valid = self._pad_valid(segments, key.device)
        return usp_attention(query, key, value, *self._usp_groups(), key_valid, scale, pair_mask=pairs)

    def _usp_groups(self) -> tuple[Any, Any]:
        """The Ulysses and Ring groups usp_attention takes (None where the degree is 1)."""
        degrees = self.mesh.degrees
        return (
            self.mesh.ulysses_group if degrees.ulysses > 1 else None,
            self.mesh.ring_group if degrees.ring > 1 else None,
        )

    def _attend_whole_queries(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        mask: Tensor | None,
        scale: float | None,
        segments: list[_Segment],
    ) -> Tensor:
        """Queries of a replicated stream against cut keys: partial attention merged over the ranks."""
        if any(segment.layout is None for segment in segments):
            raise PlanMismatch("context parallelism: whole queries need keys the plan cuts, not a replicated stream")
        key_valid = self._pad_valid(segments, key.device)
        real_keys = self._real_keys(segments) if key_valid is not None and mask is None else None
        if mask is not None:
            masks = self._every_rank_mask(mask, None)
            key_valid = masks if key_valid is None else key_valid & masks
        return whole_query_attention(query, key, value, self.mesh.sequence_group, key_valid, scale, real_keys)

    def _segments(self, keys: int) -> list[_Segment]:
        streams = self._keys[-1] if self._keys else self.plan.attention_keys
        segments = [self._segment(name) for name in streams]
        unknown = [segment for segment in segments if segment.layout is None]
        known = sum(segment.tokens for segment in segments)
        if len(unknown) > 1 or known > keys or (not unknown and known != keys):
            raise PlanMismatch(
                f"context parallelism: an attention call has {keys} keys per rank, which the plan's "
                f"{' + '.join(streams)} shards ({known} cut tokens) do not make up; "
                "the family's parallel plan does not fit this transformer"
            )
        return [_Segment(s.stream, keys - known, None) if s.layout is None else s for s in segments]

    def _segment(self, stream: str) -> _Segment:
        # No walrus in a comprehension here: its cell variable breaks a compiled block's graph.
        layout = self._layouts.get(stream)
        return _Segment(stream, layout.shard, layout) if layout is not None else _Segment(stream, 0, None)

    def _pad_valid(self, segments: list[_Segment], device: torch.device) -> Tensor | None:
        """(P, 1, keys per rank) bool: which key slots of every rank hold real tokens; None: all do."""
        if not any(segment.layout is not None and segment.layout.pad for segment in segments):
            return None
        return torch.cat([segment.layout.valid(device) for segment in segments if segment.layout], dim=1)[:, None, :]

    def _real_keys(self, segments: list[_Segment]) -> list[int | None]:
        """For each rank's shard of keys, how many leading keys are real when those are all its real
        ones (None where padding sits between two streams): known from the layouts alone."""
        shards = [segment for segment in segments if segment.layout is not None]
        sizes = [segment.tokens for segment in shards]
        return [leading_real([segment.layout.real(rank) for segment in shards], sizes) for rank in range(self.world)]

    def _every_rank_mask(self, mask: Tensor, share: _Share | None) -> Tensor:
        """(P, B|1, keys per rank): every rank's key mask, exchanged once per mask tensor and forward."""

        def gather() -> Tensor:
            local = key_mask(mask)
            if share is not None:
                local = share.take(local, -1)
            return torch.stack(all_gather(local.to(torch.uint8), self.mesh.sequence_group)).bool()

        return self._gathered_masks.get(mask, gather)

    def _own_share(self, segments: list[_Segment], replicated: int) -> _Share:
        layout = SequenceLayout(segments[replicated].tokens, self.world)
        start = sum(segment.tokens for segment in segments[:replicated])
        shared = _Segment(segments[replicated].stream, layout.shard, layout)
        return _Share(start, layout, self.rank, [*segments[:replicated], shared, *segments[replicated + 1 :]])

    # -- output ----------------------------------------------------------------------------------
    def _gather_first_argument(self, module: torch.nn.Module) -> Callable[..., Any]:
        first = next(iter(inspect.signature(module.forward).parameters), None)

        def gather(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if not self._active:
                return None
            if args:
                return (self._gather(args[0]), *args[1:]), kwargs
            if first in kwargs:
                return args, {**kwargs, first: self._gather(kwargs[first])}
            raise PlanMismatch(f"context parallelism: {type(module).__name__} was called with no argument to gather")

        return gather

    def _gather(self, output: Any) -> Any:
        layout = self._layouts.get(self.plan.output_stream)
        if layout is None:
            raise PlanMismatch(
                f"context parallelism: no {self.plan.output_stream} tensor was cut, so there is nothing to gather"
            )
        return map_sample(
            output, lambda shard: layout.join(all_gather(shard, self.mesh.sequence_group), self.plan.output_dim)
        )


def _refuse_config(plan: ParallelPlan, transformer: torch.nn.Module) -> None:
    """One line for a transformer config the plan says it cannot split (Kandinsky 5's sparse attention)."""
    config = getattr(transformer, "config", {})
    for key, value, why in plan.refuses:
        if config.get(key) == value:
            raise NotAvailableError(
                f"context parallelism: {type(transformer).__name__} with {key} = {value!r} {why}; run it on one process"
            )


class _PerTensor:
    """Results computed once per tensor object within one forward. Each entry holds its tensor, so
    the id stays unique while cached, and its version, so an in-place change recomputes. `keep`:
    how many entries at most (the latest), for large tensors a model may make anew in every block."""

    def __init__(self, keep: int | None = None) -> None:
        self._entries: dict[int, tuple[Tensor, int, Tensor]] = {}
        self._keep = keep

    def get(self, tensor: Tensor, compute: Callable[[], Tensor]) -> Tensor:
        if torch.compiler.is_compiling():  # a graph would guard on the ids held and recompile each call
            return compute()
        entry = self._entries.get(id(tensor))
        if entry is not None and entry[0] is tensor and entry[1] == tensor._version:
            return entry[2]
        result = compute()
        if self._keep is not None and len(self._entries) >= self._keep:
            self._entries.pop(next(iter(self._entries)))
        self._entries[id(tensor)] = (tensor, tensor._version, result)
        return result

    def clear(self) -> None:
        self._entries.clear()


def glob_modules(modules: dict[str, torch.nn.Module], pattern: str) -> list[torch.nn.Module]:
    """Modules whose dotted name matches `pattern` segment by segment ("blocks.*.attn2": * is one name;
    a negative index counts from the end of its list: "blocks.-1" is the last block)."""
    parts = pattern.split(".")
    return [
        module
        for name, module in modules.items()
        if name and len(name.split(".")) == len(parts) and _name_matches(modules, name.split("."), parts)
    ]


def _name_matches(modules: dict[str, torch.nn.Module], names: list[str], parts: list[str]) -> bool:
    for depth, (name, part) in enumerate(zip(names, parts)):
        if part.startswith("-") and part[1:].isdigit():
            parent = modules.get(".".join(names[:depth]))
            size = len(parent) if isinstance(parent, (torch.nn.ModuleList, torch.nn.Sequential)) else None
            if size is None or not name.isdigit() or int(name) != size + int(part):
                return False
        elif not fnmatchcase(name, part):
            return False
    return True


def _matching(
    modules: dict[str, torch.nn.Module], pattern: str, transformer: torch.nn.Module, why: str
) -> list[torch.nn.Module]:
    found = glob_modules(modules, pattern)
    if not found:
        raise PlanMismatch(f"{type(transformer).__name__} has no module {pattern!r} {why}")
    return found


@dataclass
class _Share:
    """This rank's share of a replicated stretch of tokens: taken before attention, gathered after."""

    start: int
    layout: SequenceLayout
    rank: int
    segments: list[_Segment]

    def take(self, x: Tensor, dim: int) -> Tensor:
        before, stretch, after = x.split(
            [self.start, self.layout.length, x.shape[dim] - self.start - self.layout.length], dim
        )
        return torch.cat([before, self.layout.split(stretch, dim, self.rank), after], dim)

    def restore(self, out: Tensor, group: Any) -> Tensor:
        before, share, after = out.split(
            [self.start, self.layout.shard, out.shape[-2] - self.start - self.layout.shard], -2
        )
        return torch.cat([before, self.layout.join(all_gather(share, group), -2), after], -2)
