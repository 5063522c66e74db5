"""The generic engine that runs a family's `ParallelPlan` on one transformer instance.

Around the transformer's forward: cut the planned inputs into this rank's sequence shard
(padding any length), route attention to the context-parallel functions with the pad keys
masked, and gather the output so every rank returns the full result.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from accel.errors import NotAvailableError
from accel.instance import override
from accel.models.base import Family, ParallelPlan
from accel.parallel.attention import usp_attention
from accel.parallel.comm import all_gather
from accel.parallel.layout import SequenceLayout
from accel.parallel.mesh import ParallelMesh
from accel.parallel.mode import AttentionRouter


def plan_of(family: Family, where: str) -> ParallelPlan:
    """The family's parallel plan, or the one-line refusal (`where`: the flag or key that asked)."""
    if family.parallel is None:
        raise NotAvailableError(f"{where}: {family.title} has no context-parallel plan yet; run it on one process")
    return family.parallel


class ContextParallel:
    """Context parallelism on one transformer instance; `remove()` restores its forward."""

    def __init__(self, transformer: torch.nn.Module, plan: ParallelPlan, mesh: ParallelMesh) -> None:
        self.plan = plan
        self.mesh = mesh
        self._layouts: dict[str, SequenceLayout] = {}  # of the forward call in progress
        self._forward = transformer.forward
        self._signature = inspect.signature(self._forward)
        missing = [split.arg for split in plan.splits if split.arg not in self._signature.parameters]
        if missing:
            raise TypeError(f"{type(transformer).__name__}.forward has no argument {missing[0]!r} that the parallel plan splits")

        @functools.wraps(self._forward)
        def forward(*args: Any, **kwargs: Any) -> Any:
            return self.forward(*args, **kwargs)

        self.remove: Callable[[], None] = override(transformer, "forward", forward)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        world, rank = self.mesh.degrees.sequence, self.mesh.sequence_rank
        bound = self._signature.bind(*args, **kwargs)
        layouts: dict[str, SequenceLayout] = {}
        for split in self.plan.splits:
            value = bound.arguments.get(split.arg)
            if not isinstance(value, Tensor):
                continue
            layout = layouts.setdefault(split.stream, SequenceLayout(value.shape[split.dim], world))
            if layout.length != value.shape[split.dim]:
                raise ValueError(
                    f"context parallelism: {split.arg} has {value.shape[split.dim]} {split.stream} tokens, "
                    f"other {split.stream} inputs {layout.length}"
                )
            bound.arguments[split.arg] = layout.split(value, split.dim, rank)
        if self.plan.output_stream not in layouts:
            raise ValueError(f"context parallelism: no {self.plan.output_stream} input was given to split")
        self._layouts = layouts
        try:
            with AttentionRouter(self._attend_over(layouts)):
                output = self._forward(*bound.args, **bound.kwargs)
        finally:
            self._layouts = {}
        return self._gather(output, layouts[self.plan.output_stream])

    def real_tokens(self, arg: str) -> Tensor | None:
        """During a forward: which of this rank's tokens of the input `arg` are real (None: all are)."""
        stream = next((split.stream for split in self.plan.splits if split.arg == arg), None)
        layout = self._layouts.get(stream) if stream is not None else None
        if layout is None or not layout.pad:
            return None
        return layout.valid()[self.mesh.sequence_rank]

    def _attend_over(self, layouts: dict[str, SequenceLayout]) -> Callable[[Tensor, Tensor, Tensor, float | None], Tensor]:
        streams = [name for name in self.plan.attention_keys if name in layouts]
        key_tokens = sum(layouts[name].shard for name in streams)
        padded = any(layouts[name].pad for name in streams)
        degrees = self.mesh.degrees
        ulysses = self.mesh.ulysses_group if degrees.ulysses > 1 else None
        ring = self.mesh.ring_group if degrees.ring > 1 else None
        valid_cache: dict[torch.device, Tensor] = {}

        def attend(query: Tensor, key: Tensor, value: Tensor, scale: float | None) -> Tensor:
            if key.shape[-2] != key_tokens:
                raise ValueError(
                    f"context parallelism: an attention call has {key.shape[-2]} keys per rank, but the plan's "
                    f"{' + '.join(streams)} shards hold {key_tokens}; the family's parallel plan does not fit this transformer"
                )
            key_valid = None
            if padded:
                if key.device not in valid_cache:
                    valid_cache[key.device] = torch.cat([layouts[name].valid(key.device) for name in streams], dim=1)[:, None, :]
                key_valid = valid_cache[key.device]
            return usp_attention(query, key, value, ulysses, ring, key_valid, scale)

        return attend

    def _gather(self, output: Any, layout: SequenceLayout) -> Any:
        dim = self.plan.output_dim
        if isinstance(output, tuple):
            return (layout.join(all_gather(output[0], self.mesh.sequence_group), dim), *output[1:])
        sample = layout.join(all_gather(output.sample, self.mesh.sequence_group), dim)
        return type(output)(**{**output, "sample": sample})
