"""LoRA adapters loaded onto a transformer that tensor parallelism split: each adapter is cut the way
its layer was, so a LoRA chosen per request (accel serve --lora) needs no whole weights.

A LoRA adds B·A·x to a layer's output. On a column-wise layer the rank keeps B's rows of its own
output features (a slice of each part where the layer is packed) and A whole. On a row-wise layer
the rank sees only its slice of the input, so it keeps A's matching columns, and the rank-r
products A_slice·x_slice are summed over the TP group before B (whole) applies: one all-reduce of
tokens × r per adapter, against the layer's own tokens × width. Merging (fuse_lora) then adds
B_slice·A or B·A_slice to each rank's shard, which is each shard's part of the whole layer's merge.

The cut happens as diffusers loads: the pipeline's `lora_state_dict`, which every LoRA loader
calls for the checkpoint in diffusers' key format, returns the cut tensors for the split layers.
diffusers' own shape checks then see the shapes of the shards (FLUX's loader would otherwise take
a LoRA wider than a row-wise shard for a Control LoRA and widen the layer with zeros).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from torch import nn

from accel.errors import UserError
from accel.hooks import LORA, wrap
from accel.parallel.comm import all_reduce
from accel.parallel.tensor import SPLIT_MARK, TensorGroup, rank_slice

_KEY = re.compile(r"^(?P<path>.+)\.(?P<part>lora_A|lora_B|lora_magnitude_vector)(?:\.(?P<leaf>weight|bias))?$")
_SUMMED = "_accel_lora_summed"  # on a lora_A module whose output is already summed over the TP group


def loads_split_loras(pipe: Any) -> Callable[[], None]:
    """Make `pipe.load_lora_weights` cut adapters for its split transformers (returns the undo)."""
    if not callable(getattr(pipe, "load_lora_weights", None)):
        return lambda: None

    def load(call_next: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        split = _split_components(pipe)
        if not split:
            return call_next(*args, **kwargs)
        undo = wrap(pipe, "lora_state_dict", "accel.tensor_parallel.cut_lora", LORA, _cut(split))
        try:
            result = call_next(*args, **kwargs)
        finally:
            undo()
        for component in split.values():
            sum_row_wise_adapters(component)
        return result

    return wrap(pipe, "load_lora_weights", "accel.tensor_parallel.lora", LORA, load)


def _split_components(pipe: Any) -> dict[str, nn.Module]:
    """The pipeline's split transformers by the name its LoRA keys start with."""
    found = {}
    for name, component in getattr(pipe, "components", {}).items():
        if isinstance(component, nn.Module) and getattr(component, SPLIT_MARK, None) is not None:
            found[name] = component
    return found


def _cut(split: dict[str, nn.Module]) -> Callable[..., Any]:
    def cut(call_next: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        result = call_next(*args, **kwargs)
        state_dict = result[0] if isinstance(result, tuple) else result
        for key in list(state_dict):
            state_dict[key] = cut_tensor(split, key, state_dict[key])
        return result

    return cut


def cut_tensor(split: dict[str, nn.Module], key: str, tensor: Any) -> Any:
    """`tensor` as this rank keeps it: cut where `key` is a LoRA weight of a split layer, whole otherwise."""
    match = _KEY.match(key)
    if match is None:
        return tensor
    component, _, path = match["path"].partition(".")
    if component not in split:  # keys without the component's name belong to the pipeline's transformer
        component, path = "transformer", match["path"]
    mark: TensorGroup | None = getattr(split.get(component), SPLIT_MARK, None)
    if mark is None or path not in mark.layers:
        return tensor
    style, parts = mark.layers[path]
    if match["part"] == "lora_magnitude_vector":
        raise UserError(
            f"LoRA: {key} is a DoRA magnitude, which tensor parallelism does not split; use a plain LoRA or tp = 1"
        )
    if style == "colwise" and match["part"] == "lora_B":  # B's rows (and bias) of this rank's output features
        return rank_slice(tensor, 0, parts, mark.degree, mark.rank)
    if style == "rowwise" and match["part"] == "lora_A" and match["leaf"] == "weight":  # A's input columns
        return rank_slice(tensor, 1, parts, mark.degree, mark.rank)
    return tensor


def sum_row_wise_adapters(transformer: nn.Module) -> None:
    """Sum each row-wise layer's adapters' rank-r products over the TP group (once per adapter)."""
    mark: TensorGroup = getattr(transformer, SPLIT_MARK)
    for path, (style, _parts) in mark.layers.items():
        if style != "rowwise":
            continue
        layer = transformer.get_submodule(path)
        for down in getattr(layer, "lora_A", {}).values():
            if not getattr(down, _SUMMED, False):
                down.register_forward_hook(_sum(mark))
                setattr(down, _SUMMED, True)


def _sum(mark: TensorGroup) -> Callable[..., Any]:
    def hook(_module: nn.Module, _args: Any, output: Any) -> Any:
        return all_reduce(output, mark.group)

    return hook
