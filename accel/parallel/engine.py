"""The generic engine that runs a resolved `ParallelPlan` on one transformer instance.

Around the transformer's forward, and at the module boundaries the plan names, it installs hooks
that cut the planned tensors into this rank's sequence shard (accel/parallel/cuts.py), route
attention to the context-parallel functions (accel/parallel/routing.py), and gather the output so
every rank returns the full result. Hooks are registered on this transformer's modules only.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from accel.errors import NotAvailableError
from accel.hooks import PARALLEL, wrap
from accel.parallel.comm import all_gather
from accel.parallel.cuts import Cuts
from accel.parallel.layout import group_runs
from accel.parallel.matching import PlanMismatch, glob_modules, matching
from accel.parallel.mesh import ParallelMesh
from accel.parallel.mode import AttentionRouter, bypassing_backend
from accel.parallel.outputs import map_sample
from accel.parallel.plan_format import GroupedTokens, LeadingCount, ParallelPlan, SequenceSplit
from accel.parallel.routing import AttentionRoute


class ContextParallel:
    """Context parallelism on one transformer instance; `remove()` restores it exactly."""

    def __init__(self, transformer: torch.nn.Module, plan: ParallelPlan, mesh: ParallelMesh) -> None:
        """`plan`: the resolved plan for this transformer (accel/parallel/plan.py `resolve_plan`)."""
        if not isinstance(plan, ParallelPlan):
            raise TypeError(f"ContextParallel runs a resolved ParallelPlan, not {type(plan).__name__}")
        self.plan = plan
        self.mesh = mesh
        self.world, self.rank = mesh.degrees.sequence, mesh.sequence_rank
        # State of the forward call in progress: whether one runs, its cuts and its routed attention.
        self._active = False
        self._cuts = Cuts(plan, self.world, self.rank)
        self._route = AttentionRoute(plan, mesh, self._cuts)
        self._undo: list[Callable[[], None]] = []
        # Whether a forward has routed attention yet: that proves the processors reach the engine,
        # so a later forward with no attention at all is a cache's (TaylorSeer extrapolates every
        # attention output of a call), not a processor that bypasses it.
        self._proven = False
        # Whether any forward was cut, and any run whole (split_only_when): a run that cut none gained
        # nothing. Flags, as the route's `routed`, not counters.
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
            for module in matching(modules, pattern, transformer, "that the parallel plan splits at"):
                self._hook_splits(module, splits, counts)
        for split in plan.splits:  # after the splits above: a module's own cuts lay its streams out first
            if not split.at:
                continue
            if split.module:
                raise PlanMismatch(
                    f"context parallelism: the plan defers {split.value}, which only a transformer argument can be"
                )
            for module in matching(modules, split.at, transformer, f"to cut {split.value} at"):
                self._hook(module.register_forward_pre_hook(lambda *_, split=split: self._cut_deferred(split)))
        if plan.output_module and plan.output_before:
            for module in matching(modules, plan.output_module, transformer, "to gather the output at"):
                self._hook(module.register_forward_pre_hook(self._gather_first_argument(module), with_kwargs=True))
        elif plan.output_module:
            for module in matching(modules, plan.output_module, transformer, "to gather the output at"):
                self._hook(module.register_forward_hook(lambda _m, _a, out: self._gather(out)))
        for pattern in plan.local_attention:
            for module in matching(modules, pattern, transformer, "(local attention)"):
                self._hook(module.register_forward_pre_hook(lambda *_: self._route.enter_local()))
                self._hook(module.register_forward_hook(lambda *_: self._route.leave_local(), always_call=True))
        for pattern in plan.whole_queries:
            for module in matching(modules, pattern, transformer, "(whole queries)"):
                self._hook(module.register_forward_pre_hook(lambda *_: self._route.enter_whole_queries()))
                self._hook(module.register_forward_hook(lambda *_: self._route.leave_whole_queries(), always_call=True))
        for grouped in plan.grouped:
            for module in matching(modules, grouped.module, transformer, "that the parallel plan runs by token groups"):
                self._hook_groups(module, grouped)
        for pattern, keys in plan.module_keys:  # may match nothing: SD 3.5 large has no attn2, medium has
            for module in glob_modules(modules, pattern):
                self._hook(module.register_forward_pre_hook(lambda *_, keys=keys: self._route.keys.append(keys)))
                self._hook(module.register_forward_hook(lambda *_: self._route.leave_keys(), always_call=True))
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
            self._cuts.arguments(bound.arguments, inputs)
            self._cuts.rebase_counts(bound.arguments, counts)  # after the cuts: they may lay the stream out
            return bound.args, bound.kwargs

        def cut_output(_module: Any, _args: Any, output: Any) -> Any:
            if not self._active:
                return None
            for split in outputs:
                output = self._cuts.cut(split, output)
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
            layout = self._cuts.layouts.get(grouped.stream)
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
            self._route.enter_local()
            try:
                # A shard of padding alone runs one token of the last group, so there is an output to shape.
                for start, count, first, many in [(r.start, r.tokens, r.first, r.groups) for r in runs] or [
                    (0, 1, groups - 1, 1)
                ]:
                    bound.arguments[grouped.value] = tokens.narrow(grouped.dim, start, count)
                    bound.arguments[grouped.by] = by.narrow(grouped.by_dim, first, many)
                    outputs.append(call_next(*bound.args, **bound.kwargs))
            finally:
                self._route.leave_local()
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
        self._cuts.arguments(
            bound.arguments, [split for split in self.plan.splits if not split.module and not split.at]
        )
        self._cuts.rebase_counts(bound.arguments, self._counts)
        for split in self.plan.splits:
            if split.at and bound.arguments.get(split.value) is not None:
                bound.arguments[split.value] = self._cuts.defer(split, bound.arguments[split.value])
        self._active, self._route.routed = True, False
        try:
            with AttentionRouter(
                self._route.attend, lambda: self._route.local_depth > 0, self.plan.pairwise_mask, self.plan.causal_local
            ):
                output = call_next(*bound.args, **bound.kwargs)
            if (
                not self._route.routed and not self._proven
            ):  # every rank ran the same code, so every rank raises here alike
                raise NotAvailableError(self._unrouted())
            self._proven = True
            if not self.plan.output_module:
                output = self._gather(output)
        finally:  # the per-call state starts empty for the next call, however this one ended
            self._active = False
            self._cuts.clear()
            self._route.clear()
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

    def real_tokens(self, value: str) -> int | None:
        """During a forward: how many of this rank's tokens of the planned tensor `value` are real (see
        Cuts.real_tokens; None: all are)."""
        return self._cuts.real_tokens(value)

    def _cut_deferred(self, split: SequenceSplit) -> None:
        if self._active:
            self._cuts.cut_deferred(split)

    def _unrouted(self) -> str:
        backend = bypassing_backend(self._transformer)
        why = f"its diffusers attention backend {backend!r} bypasses" if backend else "its attention processors bypass"
        return (
            f"context parallelism: {type(self._transformer).__name__}'s forward sent no attention call through the "
            f"parallel engine ({why} torch's scaled_dot_product_attention), so each rank attended only its own shard; "
            'call set_attention_backend("native") on it, use processors that call scaled_dot_product_attention, '
            "or run on one process"
        )

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
        layout = self._cuts.layouts.get(self.plan.output_stream)
        if layout is None:
            raise PlanMismatch(
                f"context parallelism: no {self.plan.output_stream} tensor was cut, so there is nothing to gather"
            )
        return map_sample(
            output, lambda shard: layout.join(all_gather(shard, self.mesh.sequence_group), self.plan.output_dim)
        )
