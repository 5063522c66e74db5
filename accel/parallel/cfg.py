"""CFG parallelism: the conditional and unconditional branches run on the two halves of the ranks.

Pipelines run classifier-free guidance one of two ways, and each gets its own split:

- batched ("batch"): one transformer call on uncond and cond concatenated along the batch. Each
  half takes its half of the batch; the outputs are gathered along the batch. A ControlNet's
  per-block residuals carry that batch too (the plan's `batch_items`): each tensor is halved, and
  where the batch pads every sample to the longest (Z-Image), cut to the half's own length.
- two calls ("calls"): the transformer is called once per branch per step. Half r computes call r
  and answers the other call with a placeholder tensor; when the second call ends the halves swap
  results and the placeholder is filled in place, before the pipeline combines the two. A
  transformer that returns several predictions (Cosmos 3: vision, sound and action lists) is
  answered with a placeholder for each, in the structure its family's `cfg_output_like` gives.

Either way every rank returns what one process would. A step with one call (guidance off) or a
batch that does not halve is refused with a message, never run on half the work. The one
exception: once a generation has run a guided batch, a later call with a smaller batch is a step
the pipeline runs unguided (Z-Image's `cfg_truncation`), and every half runs it whole.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from accel.errors import NotAvailableError, UserError
from accel.hooks import CFG, wrap
from accel.models.base import CfgStyle
from accel.parallel.plan_format import SequenceSplit
from accel.parallel.comm import Group, all_gather
from accel.parallel.matching import glob_modules
from accel.parallel.mesh import ParallelMesh
from accel.parallel.outputs import as_output, map_samples, map_tensors, sample_of, tensors_of
from accel.steps import StepEvents, StepListener


def _no_cfg_message(detail: str) -> str:
    return (
        f"[parallel] cfg = 2 splits the classifier-free guidance branches, but {detail}; "
        "turn guidance on (a guidance scale above 1, with a negative prompt where the model needs one) or set cfg = 1"
    )


@dataclass(frozen=True)
class CfgPlan:
    """What CFG parallelism needs of a pipeline (accel/parallel/plan.py `cfg_plan` makes it from the
    family and its plan). `batch_args`: the transformer arguments that carry the batch dim;
    `batch_items` and `padded`: the plan's `batch_items` and its splits of them deferred `at` a module
    (see ParallelPlan). `outputs_vary`: the two calls' outputs may differ in shape
    (Family.cfg_outputs_vary), so the halves exchange shapes before results. `output_like`: the
    structure of a call's several predictions (Acceleration.cfg_output_like; None: one sample)."""

    style: CfgStyle
    batch_args: tuple[str, ...] = ()
    batch_items: tuple[str, ...] = ()
    padded: tuple[SequenceSplit, ...] = ()
    outputs_vary: bool = False
    output_like: Callable[[Mapping[str, Any]], Any] | None = None


class CfgParallel(StepListener):
    """CFG parallelism on a pipeline's transformers; `remove()` restores them."""

    def __init__(
        self, transformers: dict[str, torch.nn.Module], plan: CfgPlan, mesh: ParallelMesh, events: StepEvents
    ) -> None:
        self.style = plan.style
        self.varying = plan.outputs_vary
        self.output_like = plan.output_like
        self.batch_args = plan.batch_args
        self.batch_items = plan.batch_items
        self.padded = plan.padded
        self._fitting: dict[str, Any] = {}  # this call's halved `padded` arguments, not yet fitted
        self.group = mesh.cfg_group
        self.half = torch.distributed.get_rank(mesh.cfg_group)
        self.events = events
        self._calls = 0  # transformer calls so far in this step ("calls" style)
        self._computed: list[Tensor] = []
        self._placeholders: list[Pending] = []
        self._shape: tuple[int, ...] | None = None  # a branch output's shape, known after the first step
        self._guided_batch: int | None = None  # the batch of this generation's first call ("batch" style)
        self._undo: list[Callable[[], None]] = []
        for transformer in transformers.values():
            self._wrap(transformer)
        events.add(self)

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()
        self.events.remove(self)

    def _wrap(self, transformer: torch.nn.Module) -> None:
        signature = inspect.signature(transformer.forward)
        run = self._batch_half if self.style == "batch" else self._own_call

        def forward(call_next: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            return run(call_next, signature.bind(*args, **kwargs))

        # Outside context parallelism (each half splits its own sequence), inside a whole compile.
        self._undo.append(wrap(transformer, "forward", "accel.cfg_parallel", CFG, forward))
        modules = dict(transformer.named_modules())
        for split in self.padded:
            for module in glob_modules(modules, split.at):
                # First of the module's hooks: before context parallelism cuts the fitted tensors.
                handle = module.register_forward_pre_hook(self._fitter(split, module), with_kwargs=True, prepend=True)
                self._undo.append(handle.remove)

    def _fitter(self, split: SequenceSplit, module: torch.nn.Module) -> Callable[..., None]:
        """A hook that cuts this call's halved `split.value` tensors to the tokens of `module`'s
        first input: the half's own longest sample, where the batch padded to the whole batch's."""
        signature = inspect.signature(module.forward)

        def fit(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            own = self._fitting.pop(split.value, None)
            if own is None:
                return
            length = next(iter(signature.bind(*args, **kwargs).arguments.values())).shape[split.dim]
            for key, item in list(own.items() if isinstance(own, Mapping) else enumerate(own)):
                if isinstance(item, Tensor) and item.shape[split.dim] > length:
                    own[key] = item.narrow(split.dim, 0, length)

        return fit

    # -- step events -----------------------------------------------------------------------------
    def on_generation_start(self, num_steps: int) -> None:
        self._calls, self._computed, self._placeholders = 0, [], []
        self._guided_batch = None

    def before_step(self, step_index: int) -> None:
        if self.style == "calls" and self._calls == 1:
            raise UserError(_no_cfg_message("the pipeline called the transformer once per step"))
        self._calls = 0

    # -- batched CFG -----------------------------------------------------------------------------
    def _batch_half(self, original: Callable[..., Any], bound: inspect.BoundArguments) -> Any:
        primary = bound.arguments[self.batch_args[0]]
        # A batch is a tensor, or a list with one tensor per sample (Z-Image's latents and captions).
        batch = len(primary) if isinstance(primary, (list, tuple)) else primary.shape[0]
        if self._guided_batch is not None and batch < self._guided_batch:
            return original(*bound.args, **bound.kwargs)  # an unguided step: both halves run it whole
        if batch % 2:
            raise UserError(_no_cfg_message(f"the transformer got a batch of {batch}"))
        self._guided_batch = batch
        for name in self.batch_args:
            value = bound.arguments.get(name)
            if isinstance(value, (list, tuple)) and len(value) == batch:
                bound.arguments[name] = value[self.half * batch // 2 : (self.half + 1) * batch // 2]
            elif isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == batch:
                bound.arguments[name] = value.chunk(2)[self.half]
        for name in self.batch_items:
            if bound.arguments.get(name) is not None:
                bound.arguments[name] = _halve_items(bound.arguments[name], batch, self.half)
        self._fitting = {
            split.value: bound.arguments[split.value]
            for split in self.padded
            if bound.arguments.get(split.value) is not None
        }
        try:
            output = original(*bound.args, **bound.kwargs)
        finally:
            self._fitting = {}
        return map_samples(output, self._join_halves)  # every prediction: LTX-2's audio beside its video

    def _join_halves(self, half: Tensor | list[Tensor]) -> Tensor | list[Tensor]:
        if isinstance(half, list):  # one output per sample, all of one shape
            return list(torch.cat(all_gather(torch.stack(half), self.group)).unbind())
        return torch.cat(all_gather(half, self.group), dim=0)

    # -- one call per branch ---------------------------------------------------------------------
    def _own_call(self, original: Callable[..., Any], bound: inspect.BoundArguments) -> Any:
        index = self._calls
        self._calls += 1
        if index > 1:
            raise NotAvailableError(
                "[parallel] cfg = 2: the pipeline called the transformer more than twice in one step; "
                "CFG parallelism splits exactly two branches"
            )
        if _waiting(list(bound.arguments.values())):  # the second branch computed from the first's output
            raise NotAvailableError(_USED_EARLY)
        if index == self.half:
            output = original(*bound.args, **bound.kwargs)
            self._computed = list(tensors_of(output)) if self.output_like is not None else [sample_of(output)]
            self._shape = tuple(self._computed[0].shape)
        elif self.output_like is not None:
            output = placeholders_like(self.output_like, bound.arguments)
            self._placeholders = list(tensors_of(output))
        else:
            like = _first_tensor(bound)
            self._placeholders = [Pending(self._shape, like.dtype, like.device)]
            output = as_output(self._placeholders[0], bound.arguments.get("return_dict", True))
        if index == 1:
            self._swap()
        return output

    def _swap(self) -> None:
        """Both branches are done: each half fills its placeholders, in place, with the other half's
        results (the pipeline holds those very tensors)."""
        assert len(self._computed) == len(self._placeholders) > 0
        for computed, placeholder in zip(self._computed, self._placeholders):
            results = _gather_varying(computed, self.group) if self.varying else all_gather(computed, self.group)
            placeholder.fill(results[1 - self.half])
        self._computed, self._placeholders = [], []


def placeholders_like(output_like: Callable[[Mapping[str, Any]], Any], arguments: Mapping[str, Any]) -> Any:
    """The other branch's answer to a call of a transformer with several predictions: its output's
    structure (`output_like`, as a call with return_dict=False returns it), one deferring placeholder
    per prediction, shaped as its like. A call with return_dict=True is refused: an output dataclass's
    fields for the predictions beside the sample have no names here."""
    if arguments.get("return_dict", True):
        raise NotAvailableError(_NAMELESS)
    return map_tensors(
        output_like(arguments), lambda like: Pending(tuple(like.shape), like.dtype, like.device, defers=True)
    )


def _gather_varying(tensor: Tensor, group: Group) -> list[Tensor]:
    """Every half's tensor where their shapes may differ (same number of dims): the shapes first
    (a host synchronisation), then the tensors padded to the largest and cut back to their own."""
    shapes = [tuple(shape.tolist()) for shape in all_gather(torch.tensor(tensor.shape, device=tensor.device), group)]
    largest = [max(sizes) for sizes in zip(*shapes)]
    padded = tensor.new_zeros(largest)
    padded[tuple(slice(0, size) for size in tensor.shape)] = tensor
    return [item[tuple(slice(0, size) for size in shape)] for item, shape in zip(all_gather(padded, group), shapes)]


def _halve_items(value: Any, batch: int, half: int) -> Any:
    """A new list or dict of `value`'s tensors, each cut to this half of its batch dim."""

    def halved(item: Any) -> Any:
        return item.chunk(2)[half] if isinstance(item, Tensor) and item.dim() > 0 and item.shape[0] == batch else item

    if isinstance(value, Mapping):
        return {key: halved(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [halved(item) for item in value]
    return halved(value)


def _first_tensor(bound: inspect.BoundArguments) -> Tensor:
    """The call's latents (or its first tensor): where and in what dtype the output will be."""
    value = bound.arguments.get("hidden_states")
    if isinstance(value, Tensor):
        return value
    return next(v for v in bound.arguments.values() if isinstance(v, Tensor))


class Pending(Tensor):
    """The other half's output of a CFG branch, before it has arrived: on the right device, in the
    right dtype and (after the first step) the right shape, so filling it later needs no rebinding.

    Indexing it (Kontext and Qwen-Image-Edit keep only the generated tokens, `out[:, :n]`, right
    after the call) gives another placeholder, filled from this one when it arrives. A pipeline
    that computes with the first branch's output before calling the second would get a wrong image
    from any placeholder; this one refuses such a use with one line instead, unless it `defers`:
    a placeholder of a prediction whose family declares its structure (Cosmos 3 masks each branch's
    predictions right after its call) answers an out-of-place tensor operation with another
    placeholder, computed when its inputs arrive. What needs a value now (a bool, a number, an
    in-place write, a transformer call) is refused all the same."""

    _ready: bool
    _defers: bool
    _derived: list[tuple[Pending, Callable[[Tensor], Tensor]]]

    def __new__(
        cls, shape: tuple[int, ...] | None, dtype: torch.dtype, device: torch.device, defers: bool = False
    ) -> Pending:
        pending = Tensor._make_subclass(cls, torch.empty(shape or (0,), dtype=dtype, device=device))
        pending._ready = False
        pending._defers = defers
        pending._derived = []
        return pending

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is Tensor.__getitem__ and _waiting(args[0]) and not _waiting(args[1:]):
            return args[0]._index(args[1])
        if getattr(func, "__name__", "") != "__get__" and any(_waiting(value) for value in (*args, *kwargs.values())):
            deferred = _deferred(func, args, kwargs)
            if deferred is None:
                raise NotAvailableError(_USED_EARLY)
            return deferred
        with _plain_tensors():
            return func(*args, **kwargs)

    def _index(self, index: Any) -> Pending:
        """The placeholder of `self[index]`, in its shape where this one's is known."""
        with _plain_tensors():
            shape = tuple(torch.empty(self.shape, device="meta")[index].shape) if self.numel() else None
        derived = Pending(shape, self.dtype, self.device, self._defers)
        self._derived.append((derived, lambda value: value[index]))
        return derived

    def fill(self, value: Tensor) -> None:
        with torch.no_grad(), _plain_tensors():
            if self.shape != value.shape:
                self.resize_(value.shape)
            self.copy_(value)
        self._ready = True
        for derived, take in self._derived:
            with _plain_tensors():
                part = take(value)
            if part is not None:
                derived.fill(part)


# A family's output structure (cfg_output_like) is what a call with return_dict=False returns.
_NAMELESS = (
    "[parallel] cfg = 2: the transformer was called with return_dict=True and returns more than its sample, whose "
    "output "
    "fields accel cannot name for the other branch; set cfg = 1"
)
_USED_EARLY = (
    "[parallel] cfg = 2: the pipeline used the first guidance branch's output before calling the "
    "transformer for the second, so the branches cannot run on separate ranks; set cfg = 1"
)


def _deferred(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Pending | None:
    """The placeholder of `func(*args, **kwargs)` on waiting placeholders that all defer, computed
    when the last of them is filled; None where the operation cannot wait (it writes in place, or
    gives no tensor: a bool, a number) or a placeholder does not defer."""
    name = getattr(func, "__name__", "")
    sources = [value for value in _flat((*args, *kwargs.values())) if isinstance(value, Pending) and not value._ready]
    in_place = (
        (name.endswith("_") and not name.startswith("__"))
        or name.startswith("__i")
        or name == "__setitem__"
        or "out" in kwargs
    )
    if in_place or not all(source._defers for source in sources):
        return None
    try:
        with _plain_tensors():  # the result's shape and dtype, from the placeholders' current (empty) contents
            trial = func(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an operation the placeholder's shape does not allow yet
        return None
    if any(trial is source for source in sources):  # a no-op (`.float()` of a float32 placeholder): that placeholder
        return trial
    if type(trial) is not Tensor:
        return None
    derived = Pending(tuple(trial.shape), trial.dtype, trial.device, defers=True)

    def take(_value: Tensor) -> Tensor | None:
        if any(not source._ready for source in sources):
            return None  # another input has yet to arrive: the last one computes it
        return func(*args, **kwargs)

    for source in sources:
        source._derived.append((derived, take))
    return derived


def _flat(values: Any) -> list[Any]:
    return [item for value in values for item in (_flat(value) if isinstance(value, (list, tuple)) else (value,))]


def _waiting(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_waiting(item) for item in value)
    return isinstance(value, Pending) and not value._ready


def _plain_tensors() -> Any:
    """Operations inside see plain tensors and return plain tensors (torch's documented idiom for
    a subclass that only watches; the one private name it needs sits here)."""
    return torch._C.DisableTorchFunctionSubclass()
