"""Tensor parallelism: each block's weights split over a TP group, as the family's TensorPlan says.

A column-wise layer keeps its rank's slice of the output features (a slice of each part where
the layer is packed) and needs no exchange: its input is the same on every rank of the group. A
row-wise layer keeps the matching slice of its input features; the ranks' partial outputs are
summed over the group (one all-reduce per layer, through accel.parallel.comm), and the bias, held
whole, is added once after the sum. An attention then runs on the rank's own heads, an MLP on its
slice of the hidden width, and every block's output is whole again on every rank: context
parallelism, the cache and CFG parallelism see the same streams as without TP.

The shards are plain tensors, not DTensors, for two reasons: torchao quantizes them as it does any
Linear (split first, then quantize: a column-wise shard's per-output-channel scales are exactly the
whole layer's, a row-wise shard's span its own input columns), and a compiled block traces one
all-reduce per row-wise layer with no DTensor dispatch in the graph. Splitting stays when the rest
of `accel.apply` is undone, like quantization: the other ranks' slices were freed, which is the point.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from accel.errors import NotAvailableError, UserError
from accel.hooks import PARALLEL, wrap
from accel.parallel.plan_format import Packed, Rotary, TensorPlan
from accel.parallel.comm import all_reduce, group_rank, group_size
from accel.parallel.mesh import degrees_that_divide

Style = Literal["colwise", "rowwise"]
# Set on a split transformer: its TensorGroup. A second apply with the same degree and rank index
# leaves the weights as they are and points the sums at the new layout's group.
SPLIT_MARK = "_accel_tensor_parallel"
# A row-wise layer's bias, moved off `bias` so each rank's matmul adds none; added after the sum.
SUMMED_BIAS = "summed_bias"
DIFFUSERS_COL, DIFFUSERS_ROW = "_tp_packed_col_blocks", "_tp_packed_row_blocks"


class TensorPlanError(TypeError):
    """A plan that does not fit the transformer it is applied to (a bug in plan data, not a user error)."""


@dataclass(frozen=True)
class SplitLayer:
    """One planned Linear: its path, style and the absolute sizes of its parts along the split dim."""

    path: str
    module: nn.Linear
    style: Style
    parts: tuple[int, ...]

    @property
    def dim(self) -> int:
        return 0 if self.style == "colwise" else 1


def resolve_tensor_plan(plan: TensorPlan, transformer: nn.Module) -> TensorPlan:
    """`plan` itself, or with diffusers' `_tp_plan` of the transformer's class as its layers."""
    if not plan.from_diffusers:
        return plan
    tp_plan = getattr(type(transformer), "_tp_plan", None)
    if not tp_plan:
        raise NotAvailableError(
            f"[parallel] tp: {type(transformer).__name__} has no diffusers _tp_plan in this diffusers version "
            "(it came with diffusers 0.42); upgrade diffusers or set tp = 1"
        )
    layers = {pattern: _from_diffusers_style(pattern, style) for pattern, style in tp_plan.items()}
    return TensorPlan(layers=layers, norms=plan.norms, per_rank=plan.per_rank, rotary=plan.rotary)


def _from_diffusers_style(pattern: str, style: Any) -> str | Packed:
    if style in ("colwise", "rowwise"):
        return str(style)
    kind = type(style).__name__
    if kind in ("PackedColwiseParallel", "PackedRowwiseParallel"):
        blocks = getattr(style, "blocks", None)
        return Packed("colwise" if "Colwise" in kind else "rowwise", tuple(blocks or ()))
    raise TensorPlanError(f"_tp_plan[{pattern!r}]: style {style!r} is not one accel reads (colwise, rowwise, packed)")


def _pattern(glob: str) -> re.Pattern[str]:
    """A module pattern as a regex: `*` stands for one path atom (a list index)."""
    return re.compile("\\.".join("[^.]+" if atom == "*" else re.escape(atom) for atom in glob.split(".")) + "$")


def _matches(
    transformer: nn.Module, globs: Iterator[str] | tuple[str, ...] | list[str]
) -> Iterator[tuple[str, str, nn.Module]]:
    patterns = [(glob, _pattern(glob)) for glob in globs]
    for name, module in transformer.named_modules():
        for glob, pattern in patterns:
            if pattern.match(name):
                yield glob, name, module
                break


def planned_layers(transformer: nn.Module, plan: TensorPlan) -> list[SplitLayer]:
    """Every Linear the plan splits, with its parts; a plan naming no layer of this transformer is refused."""
    layers = []
    for glob, name, module in _matches(transformer, list(plan.layers)):
        if hasattr(module, "base_layer"):  # peft's LoRA wrapper: the adapter's weights would stay whole
            raise UserError(
                f"[parallel] tp: {name} carries a LoRA adapter loaded before the split; load it after accel.apply "
                "(it is then cut with its layer), or fuse and unload it first (pipe.fuse_lora(); "
                "pipe.unload_lora_weights())"
            )
        if not isinstance(module, nn.Linear):
            raise TensorPlanError(f"tensor plan {glob!r}: {name} is a {type(module).__name__}, not a Linear")
        layers.append(SplitLayer(name, module, *_style_and_parts(plan.layers[glob], module, name)))
    if not layers:
        raise NotAvailableError(
            f"[parallel] tp: the tensor-parallel plan names no layer of {type(transformer).__name__}; set tp = 1 for it"
        )
    return layers


def _style_and_parts(style: str | Packed, module: nn.Linear, name: str) -> tuple[Style, tuple[int, ...]]:
    kind: Style = style.style if isinstance(style, Packed) else style  # type: ignore[assignment]
    if kind not in ("colwise", "rowwise"):
        raise TensorPlanError(f"tensor plan for {name}: style {kind!r} is neither colwise nor rowwise")
    width = module.weight.shape[0 if kind == "colwise" else 1]
    if not isinstance(style, Packed):
        return kind, (width,)
    if style.parts:
        unit, rest = divmod(width, sum(style.parts))
        if rest:
            raise TensorPlanError(f"tensor plan for {name}: parts {style.parts} do not divide its width {width}")
        return kind, tuple(part * unit for part in style.parts)
    stored = getattr(module, DIFFUSERS_COL if kind == "colwise" else DIFFUSERS_ROW, None)
    if not stored or sum(stored) != width:
        raise TensorPlanError(f"tensor plan for {name}: a packed layer without parts, and no block sizes stored on it")
    return kind, tuple(int(size) for size in stored)


def planned_norms(transformer: nn.Module, plan: TensorPlan) -> list[tuple[str, nn.Module]]:
    return [(name, module) for _, name, module in _matches(transformer, plan.norms)]


def width_problem(transformer: nn.Module, plan: TensorPlan, tp: int, model: str) -> str | None:
    """The one line refusing `tp` when some split width (a part of a layer, a norm, a per-rank
    count) is not a multiple of it, naming the width and the degrees that divide every width."""
    widths: list[tuple[int, str]] = []
    layers = planned_layers(transformer, plan)
    for layer in layers:
        widths += [
            (part, f"{layer.path} ({'output' if layer.style == 'colwise' else 'input'} width {part})")
            for part in layer.parts
        ]
    for name, norm in planned_norms(transformer, plan):
        widths.append((norm.weight.shape[0], f"{name} (width {norm.weight.shape[0]})"))
    for name, module in _per_rank_owners(transformer, layers, plan):
        widths += [
            (value, f"{name}.{attr} = {value}")
            for attr in plan.per_rank
            if isinstance(value := getattr(module, attr, None), int)
        ]
    bad = next(((width, what) for width, what in widths if width % tp), None)
    if bad is None:
        return None
    common = 0
    for width, _ in widths:
        common = width if not common else _gcd(common, width)
    return f"[parallel] tp = {tp} does not divide {bad[1]} of {model}; use tp = {degrees_that_divide(common)}"


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def _per_rank_owners(transformer: nn.Module, layers: list[SplitLayer], plan: TensorPlan) -> list[tuple[str, nn.Module]]:
    """The nearest module above each column-wise layer that holds one of `plan.per_rank`'s attributes."""
    if not plan.per_rank:
        return []
    modules = dict(transformer.named_modules())
    owners: dict[str, nn.Module] = {}
    for layer in layers:
        if layer.style != "colwise":
            continue
        path = layer.path
        while "." in path:
            path = path.rsplit(".", 1)[0]
            module = modules[path]
            if any(isinstance(getattr(module, attr, None), int) for attr in plan.per_rank):
                owners.setdefault(path, module)
                break
    return list(owners.items())


@dataclass
class TensorGroup:
    """The group a split transformer's sums run over, read by its hooks at each call."""

    degree: int
    rank: int
    group: Any
    # each split Linear's path -> (style, parts): what a LoRA loaded later is cut by (tensor_lora.py)
    layers: dict[str, tuple[Style, tuple[int, ...]]] = field(default_factory=dict)


@dataclass
class TensorParallel:
    """The transformer's planned layers split over `group` (or, split already when it was loaded
    slice by slice, its sums pointed at `group`)."""

    transformer: nn.Module
    plan: TensorPlan
    group: Any

    def __post_init__(self) -> None:
        tp, rank = group_size(self.group), group_rank(self.group)
        mark = getattr(self.transformer, SPLIT_MARK, None)
        if mark is None:
            mark = split_module(self.transformer, self.plan, tp, rank)
        elif (mark.degree, mark.rank) != (tp, rank):
            raise UserError(
                f"[parallel] tp = {tp}: {type(self.transformer).__name__} is already split as slice {mark.rank} of "
                f"tp = {mark.degree} (the other slices were freed); load the pipeline again to change the layout"
            )
        mark.group = self.group


def split_module(
    transformer: nn.Module,
    plan: TensorPlan,
    tp: int,
    rank: int,
    layers: list[SplitLayer] | None = None,
    sliced: bool = False,
) -> TensorGroup:
    """Split `transformer` in place as slice `rank` of `tp` and mark it; the sums run over the
    returned TensorGroup's group, set when a layout applies it. `sliced`: the planned weights hold
    their slices already (loaded so); `layers` must then come from the whole model's shapes."""
    shared = TensorGroup(tp, rank, None)
    layers = layers if layers is not None else planned_layers(transformer, plan)
    for layer in layers:
        _split_layer(layer, tp, rank, shared, sliced)
        shared.layers[layer.path] = (layer.style, layer.parts)
    for _, norm in planned_norms(transformer, plan):
        _split_norm(norm, tp, rank, shared, sliced)
    for rotary in plan.rotary:
        for _, _, module in _matches(transformer, [rotary.module]):
            module.register_forward_pre_hook(_rotary_slices(rotary, shared), with_kwargs=True)
    for _, owner in _per_rank_owners(transformer, layers, plan):
        for attr in plan.per_rank:
            if isinstance(value := getattr(owner, attr, None), int):
                setattr(owner, attr, value // tp)
    setattr(transformer, SPLIT_MARK, shared)
    return shared


def slices_of(
    transformer: nn.Module, plan: TensorPlan, layers: list[SplitLayer]
) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Each split parameter's name → (dim, parts) on the whole model: what a loader reads of it."""
    slices: dict[str, tuple[int, tuple[int, ...]]] = {}
    for layer in layers:
        slices[f"{layer.path}.weight"] = (layer.dim, layer.parts)
        if layer.style == "colwise" and layer.module.bias is not None:
            slices[f"{layer.path}.bias"] = (0, layer.parts)
    for name, norm in planned_norms(transformer, plan):
        for leaf in ("weight", "bias"):
            if isinstance(getattr(norm, leaf, None), nn.Parameter):
                slices[f"{name}.{leaf}"] = (0, (norm.weight.shape[0],))
    return slices


def rank_slice(tensor: Any, dim: int, parts: tuple[int, ...], tp: int, rank: int) -> torch.Tensor:
    """This rank's slice of each part along `dim`, side by side, in storage of its own. `tensor` is
    a tensor or a safetensors slice (`get_slice`), of which only those bytes are read."""
    ndim = tensor.dim() if isinstance(tensor, torch.Tensor) else len(tensor.get_shape())
    pieces, offset = [], 0
    for part in parts:
        chunk = part // tp
        index = [slice(None)] * ndim
        index[dim] = slice(offset + rank * chunk, offset + (rank + 1) * chunk)
        pieces.append(tensor[tuple(index)])
        offset += part
    return torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0].clone()


def _split_layer(layer: SplitLayer, tp: int, rank: int, shared: TensorGroup, sliced: bool) -> None:
    module = layer.module
    if not sliced:
        if module.weight.is_meta:
            raise TensorPlanError(
                f"{layer.path}: its weight is not loaded (meta); load the pipeline before splitting it"
            )
        module.weight = nn.Parameter(
            rank_slice(module.weight.data, layer.dim, layer.parts, tp, rank), requires_grad=False
        )
        if layer.style == "colwise" and module.bias is not None:
            module.bias = nn.Parameter(rank_slice(module.bias.data, 0, layer.parts, tp, rank), requires_grad=False)
    if layer.style == "colwise":
        module.out_features = module.weight.shape[0]
        return
    module.in_features = module.weight.shape[1]
    bias = module.bias
    module.register_parameter("bias", None)
    if bias is not None:
        module.register_parameter(SUMMED_BIAS, nn.Parameter(bias.data, requires_grad=False))
    module.register_forward_hook(_sum_over(shared))


def _split_norm(norm: nn.Module, tp: int, rank: int, shared: TensorGroup, sliced: bool) -> None:
    width = norm.weight.shape[0] * (tp if sliced else 1)
    if not sliced:
        for name in ("weight", "bias"):
            value = getattr(norm, name, None)
            if isinstance(value, nn.Parameter):
                setattr(norm, name, nn.Parameter(rank_slice(value.data, 0, (width,), tp, rank), requires_grad=False))
    wrap(norm, "forward", "accel.tensor_parallel.norm", PARALLEL, _norm_over(norm, shared, width))


def _sum_over(shared: TensorGroup) -> Any:
    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        output = all_reduce(output, shared.group)
        bias = getattr(module, SUMMED_BIAS, None)
        return output if bias is None else output + bias

    return hook


def _rotary_slices(rotary: Rotary, shared: TensorGroup) -> Any:
    def hook(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        for name in rotary.arguments:
            if kwargs.get(name) is not None:
                kwargs[name] = _heads_slice(kwargs[name], rotary, shared)
        return args, kwargs

    return hook


def _heads_slice(value: Any, rotary: Rotary, shared: TensorGroup) -> Any:
    """This rank's heads of a rotary embedding (see Rotary)."""
    if isinstance(value, (tuple, list)):
        return type(value)(_heads_slice(item, rotary, shared) for item in value)
    if not isinstance(value, torch.Tensor) or value.dim() not in rotary.heads_dim:
        return value
    dim = rotary.heads_dim[value.dim()]
    if value.shape[dim] == 1:  # broadcast over the heads
        return value
    size = value.shape[dim] // shared.degree
    return value.narrow(dim, shared.rank * size, size)


def _norm_over(norm: nn.Module, shared: TensorGroup, width: int) -> Any:
    """RMSNorm over the whole (split) width: the rank's sum of squares summed over the group."""

    def forward(call_next: Any, hidden_states: torch.Tensor) -> torch.Tensor:
        eps = getattr(norm, "eps", None)
        if eps is None:
            eps = torch.finfo(hidden_states.dtype).eps
        values = hidden_states.float()
        squares = all_reduce(values.pow(2).sum(-1, keepdim=True), shared.group)
        normed = values * torch.rsqrt(squares / width + eps)
        weight, bias = getattr(norm, "weight", None), getattr(norm, "bias", None)
        if weight is not None:
            normed = normed * weight.float()
        if isinstance(bias, torch.Tensor):
            normed = normed + bias.float()
        return normed.to(hidden_states.dtype)

    return forward
