"""Per-rank bytes of a layout's weights, counted exactly from components built on meta (after the TP
split where the layout splits them, and as torchao stores what [quant] quantizes): no weight is read.
"""

from __future__ import annotations

import math

from torch import nn

from accel.memory.build import block_lists, build
from accel.memory.fake_cuda import fake_world
from accel.models.base import Family
from accel.models.flagships import Component
from accel.recipe.sections import QuantSection


def weight_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


# How torchao stores a quantized Linear weight of shape (rows, columns): bits per weight, bytes per
# row (scales, zero points), bytes per group of INT4_GROUP columns in a row (int4's scale and zero).
QUANT_STORAGE = {"int8wo": (8, 5, 0), "int8dq": (8, 5, 0), "fp8wo": (8, 4, 0), "fp8dq": (8, 4, 0), "int4wo": (4, 0, 4)}


def quantized_bytes(scheme: str, shape: tuple[int, ...] | list[int]) -> int:
    from accel.optimize.quantize import INT4_GROUP

    bits, per_row, per_group = QUANT_STORAGE[scheme]
    rows, columns = shape
    return rows * columns * bits // 8 + rows * per_row + rows * (columns // INT4_GROUP) * per_group


def parameter_bytes(family: Family, model: nn.Module, tp: int = 1, quant: QuantSection | None = None) -> dict[str, int]:
    """Each parameter's and buffer's bytes on one rank (`model` built on meta): each split parameter cut
    to its 1/tp slice (what the split loader reads of it, accel/models/split_load.py), and each Linear
    weight [quant] chooses stored as torchao stores it (the split comes first, then the shards quantize)."""
    slices: dict[str, tuple[int, tuple[int, ...]]] = {}
    if tp > 1:
        from accel.parallel.tensor import planned_layers, resolve_tensor_plan, slices_of

        assert family.tensor is not None
        plan = resolve_tensor_plan(family.tensor, model)
        slices = slices_of(model, plan, planned_layers(model, plan))
    quantized: set[str] = set()
    if quant is not None and quant.type != "none":
        from accel.optimize.quantize import chosen_layers

        quantized = set(chosen_layers(model, quant.type, family.blocks, quant.scope, quant.exclude)[0])
    sizes = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        shape = list(tensor.shape)
        if name in slices:
            shape[slices[name][0]] //= tp
        layer, _, leaf = name.rpartition(".")
        if leaf == "weight" and layer in quantized:
            sizes[name] = quantized_bytes(quant.type, shape)  # type: ignore[union-attr]
        else:
            sizes[name] = math.prod(shape) * tensor.element_size()
    return sizes


def transformer_weights(family: Family, model: nn.Module, tp: int, quant: QuantSection | None = None) -> int:
    """The transformer's bytes on one rank (parameter_bytes, summed)."""
    return sum(parameter_bytes(family, model, tp, quant).values())


def tp_problem(family: Family, model: nn.Module, tp: int) -> str | None:
    """Why `tp` cannot split this transformer (`model` built on meta; None: it can)."""
    if tp == 1:
        return None
    if family.tensor is None:
        return f"{family.title} has no tensor-parallel plan"
    from accel.parallel.tensor import resolve_tensor_plan, width_problem

    return width_problem(model, resolve_tensor_plan(family.tensor, model), tp, family.title)


def sharded_encoder_bytes(component: Component, ranks: int) -> int | None:
    """One rank's bytes of a text encoder that [memory] text_encoder = "sharded" splits over `ranks`
    with transformers' plan, split on meta by the same code as a run; None where it stays whole (no
    plan) or the split is refused (heads the ranks do not divide, accel/parallel/encoders.py)."""
    from torch.distributed.device_mesh import DeviceMesh

    from accel.parallel.encoders import heads_problem, local_bytes, split_encoder, tp_plan_of

    encoder = build(component)
    if not tp_plan_of(encoder) or heads_problem(encoder, ranks) is not None:
        return None
    with fake_world(ranks):
        split_encoder(encoder, DeviceMesh("cpu", list(range(ranks))))
    return local_bytes(encoder) + sum(t.numel() * t.element_size() for t in encoder.buffers())


def offload_groups(model: nn.Module, sizes: dict[str, int] | None = None) -> tuple[int, int]:
    """(bytes outside the repeated blocks, bytes of the largest block) of `model` built on meta, each
    tensor counted as `sizes` says (default: as built): what diffusers' block-level group offload holds
    on the GPU besides one block being streamed in."""
    if sizes is None:
        sizes = {name: t.numel() * t.element_size() for name, t in [*model.named_parameters(), *model.named_buffers()]}
    lists, blocks = block_lists(model), {}
    for name, size in sizes.items():
        head, _, rest = name.partition(".")
        if head in lists:
            index = rest.partition(".")[0]
            blocks[f"{head}.{index}"] = blocks.get(f"{head}.{index}", 0) + size
    return sum(sizes.values()) - sum(blocks.values()), max(blocks.values(), default=0)
