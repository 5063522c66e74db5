"""Loading a transformer as one tensor-parallel slice, straight from its safetensors files.

The model is built on the meta device from its config, the family's TensorPlan is read off those
shapes, and each planned weight is read as this rank's slice only (safetensors reads just those
bytes); everything else is read whole. No rank ever holds the whole transformer, so a node's host
memory peaks at about one copy of the split weights however many ranks it runs, plus each rank's
copy of the replicated rest. The slices are then split in place exactly as `accel.apply` splits a
whole model (accel/parallel/tensor.py), so a later apply with the same tp only points the sums at
its group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from accel.errors import ModelError
from accel.parallel.plan_format import TensorPlan


def load_split_transformer(
    cls: type[nn.Module], folder: Path, tensor: TensorPlan, dtype: torch.dtype, device: torch.device, tp: int, rank: int
) -> nn.Module:
    """`cls` from `folder` (its config and *.safetensors) as slice `rank` of `tp`, on `device` in `dtype`."""
    from accelerate import init_empty_weights
    from safetensors import safe_open

    from accel.parallel.tensor import planned_layers, rank_slice, resolve_tensor_plan, slices_of, split_module

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(
            f"{folder} has no .safetensors weights, which loading a tensor-parallel slice needs; convert the checkpoint"
        )
    with init_empty_weights():  # parameters on meta; buffers made at init stay real
        model = cls.from_config(cls.load_config(folder))
    plan = resolve_tensor_plan(tensor, model)
    layers = planned_layers(model, plan)  # from the whole shapes, before any slice replaces them
    slices = slices_of(model, plan, layers)
    expected = {name for name, _ in model.named_parameters()}
    keep_fp32 = set(getattr(cls, "_keep_in_fp32_modules", None) or ())
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as weights:
            for key in weights.keys():  # noqa: SIM118 - safe_open is not a mapping
                if key not in expected:
                    continue
                value = (
                    rank_slice(weights.get_slice(key), *slices[key], tp, rank)
                    if key in slices
                    else weights.get_tensor(key)
                )
                if value.is_floating_point():
                    value = value.to(torch.float32 if keep_fp32 & set(key.split(".")) else dtype)
                _set_parameter(model, key, value.to(device))
                loaded.add(key)
    missing = sorted(expected - loaded)
    if missing:
        raise ModelError(
            f"{folder}: the weights lack {missing[0]}{f' and {len(missing) - 1} more' if len(missing) > 1 else ''} "
            f"of {cls.__name__}; re-download or re-save the model"
        )
    model.to(device)  # the buffers made at init
    split_module(model, plan, tp, rank, layers, sliced=True)
    return model.eval()


def _set_parameter(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    module.register_parameter(leaf, nn.Parameter(value, requires_grad=False))


def transformer_folders(root: Path, attrs: tuple[str, ...]) -> dict[str, tuple[type[nn.Module], Path]]:
    """The transformer components of a pipeline folder, by attribute: their class and folder."""
    import importlib
    import json

    index = json.loads((root / "model_index.json").read_text())
    found: dict[str, tuple[type[nn.Module], Path]] = {}
    for attr in attrs:
        entry = index.get(attr)
        if not isinstance(entry, list) or len(entry) != 2 or entry[1] is None:
            continue
        library, class_name = entry
        cls: Any = getattr(importlib.import_module(library), class_name, None)
        if cls is not None and (root / attr).is_dir():
            found[attr] = (cls, root / attr)
    return found
