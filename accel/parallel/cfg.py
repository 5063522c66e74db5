"""CFG parallelism: the conditional and unconditional branches run on the two halves of the ranks.

Pipelines run classifier-free guidance one of two ways, and each gets its own split:

- batched ("batch"): one transformer call on uncond and cond concatenated along the batch. Each
  half takes its half of the batch; the outputs are gathered along the batch.
- two calls ("calls"): the transformer is called once per branch per step. Half r computes call r
  and answers the other call with a placeholder tensor; when the second call ends the halves swap
  results and the placeholder is filled in place, before the pipeline combines the two.

Either way every rank returns what one process would. A step with one call (guidance off) or a
batch that does not halve is refused with a message, never run on half the work.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from accel.errors import NotAvailableError, UserError
from accel.instance import override
from accel.models.base import CfgStyle
from accel.parallel.comm import all_gather
from accel.parallel.mesh import ParallelMesh
from accel.parallel.outputs import as_output, map_sample, sample_of
from accel.steps import StepEvents, StepListener


def _no_cfg_message(detail: str) -> str:
    return (
        f"[parallel] cfg = 2 splits the classifier-free guidance branches, but {detail}; "
        "turn guidance on (a guidance scale above 1, with a negative prompt where the model needs one) or set cfg = 1"
    )


class CfgParallel(StepListener):
    """CFG parallelism on a pipeline's transformers; `remove()` restores them."""

    def __init__(
        self,
        transformers: dict[str, torch.nn.Module],
        style: CfgStyle,
        batch_args: tuple[str, ...],
        mesh: ParallelMesh,
        events: StepEvents,
    ) -> None:
        self.style = style
        self.batch_args = batch_args
        self.group = mesh.cfg_group
        self.half = torch.distributed.get_rank(mesh.cfg_group)
        self.events = events
        self._calls = 0  # transformer calls so far in this step ("calls" style)
        self._computed: Tensor | None = None
        self._placeholder: Tensor | None = None
        self._undo: list[Callable[[], None]] = []
        for transformer in transformers.values():
            self._wrap(transformer)
        events.add(self)

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()
        self.events.remove(self)

    def _wrap(self, transformer: torch.nn.Module) -> None:
        original = transformer.forward
        signature = inspect.signature(original)
        run = self._batch_half if self.style == "batch" else self._own_call

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            return run(original, signature.bind(*args, **kwargs))

        self._undo.append(override(transformer, "forward", forward))

    # -- step events -----------------------------------------------------------------------------
    def on_generation_start(self, num_steps: int) -> None:
        self._calls, self._computed, self._placeholder = 0, None, None

    def before_step(self, step_index: int) -> None:
        if self.style == "calls" and self._calls == 1:
            raise UserError(_no_cfg_message("the pipeline called the transformer once per step"))
        self._calls = 0

    # -- batched CFG -----------------------------------------------------------------------------
    def _batch_half(self, original: Callable[..., Any], bound: inspect.BoundArguments) -> Any:
        primary = bound.arguments[self.batch_args[0]]
        batch = primary.shape[0]
        if batch % 2:
            raise UserError(_no_cfg_message(f"the transformer got a batch of {batch}"))
        for name in self.batch_args:
            value = bound.arguments.get(name)
            if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == batch:
                bound.arguments[name] = value.chunk(2)[self.half]
        output = original(*bound.args, **bound.kwargs)
        return map_sample(output, lambda half: torch.cat(all_gather(half, self.group), dim=0))

    # -- one call per branch ---------------------------------------------------------------------
    def _own_call(self, original: Callable[..., Any], bound: inspect.BoundArguments) -> Any:
        index = self._calls
        self._calls += 1
        if index > 1:
            raise NotAvailableError(
                "[parallel] cfg = 2: the pipeline called the transformer more than twice in one step; "
                "CFG parallelism splits exactly two branches"
            )
        if index == self.half:
            output = original(*bound.args, **bound.kwargs)
            self._computed = sample_of(output)
        else:
            self._placeholder = torch.empty(0)
            output = as_output(self._placeholder, bound.arguments.get("return_dict", True))
        if index == 1:
            self._swap()
        return output

    def _swap(self) -> None:
        """Both branches are done: each half fills its placeholder with the other half's result."""
        assert self._computed is not None and self._placeholder is not None
        results = all_gather(self._computed, self.group)
        with torch.no_grad():
            self._placeholder.data = results[1 - self.half]  # the pipeline holds this very tensor
        self._computed, self._placeholder = None, None

