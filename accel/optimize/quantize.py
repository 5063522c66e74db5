"""torchao quantization of a transformer's Linear layers, and the hardware each scheme needs.

By default only the Linear layers inside the family's repeated blocks are quantized: they hold
nearly all weights and FLOPs. The layers outside them (patch / text / time embedders, the token
refiner, the final norm and output projection) see raw inputs such as sinusoidal timestep
features, or write the velocity directly, so quantization errors there reach the image undamped
for almost no speed gained; they stay in the model dtype unless `scope = "transformer"`.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from accel.errors import UserError
from accel.models.base import BlockList

# The smallest CUDA compute capability each scheme's kernels run on (None: also runs on CPU).
FP8_CAPABILITY = (8, 9)  # Ada / Hopper float8 tensor cores
INT4_CAPABILITY = (8, 0)  # tinygemm int4 kernels, Ampere and newer
NEEDS_CUDA: dict[str, tuple[int, int]] = {"fp8dq": FP8_CAPABILITY, "fp8wo": FP8_CAPABILITY, "int4wo": INT4_CAPABILITY}
INT4_GROUP = 128


def hardware_refusal(
    scheme: str, device_type: str, capability: tuple[int, int] | None, dtype: torch.dtype
) -> str | None:
    """Why `scheme` cannot run on this device and dtype (None: it can). Pure, so every branch is testable."""
    need = NEEDS_CUDA.get(scheme)
    if need is not None:
        wanted = f"an NVIDIA GPU of compute capability {need[0]}.{need[1]} or newer"
        if device_type != "cuda" or capability is None:
            return f"[quant] type = '{scheme}' needs {wanted}; this run is on {device_type}. Use int8wo or int8dq"
        if capability < need:
            return (
                f"[quant] type = '{scheme}' needs {wanted}; this GPU is {capability[0]}.{capability[1]}. "
                "Use int8wo or int8dq"
            )
    if scheme == "int4wo" and dtype != torch.bfloat16:
        return (
            f"[quant] type = 'int4wo' needs bfloat16 weights, the model is {str(dtype).removeprefix('torch.')}; "
            "set --dtype bfloat16"
        )
    return None


def check_hardware(scheme: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, before loading, a scheme this machine cannot run."""
    if scheme == "none":
        return
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    refusal = hardware_refusal(scheme, device.type, capability, dtype)
    if refusal:
        raise UserError(refusal)


def _config(scheme: str) -> Any:
    """The torchao config for a scheme. Inductor settings are left alone: torchao's recommended ones
    change global state (float32 matmul precision) for everything else in the process."""
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Float8WeightOnlyConfig,
        Int4WeightOnlyConfig,
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
    )
    from torchao.quantization.granularity import PerRow

    if scheme == "int8wo":
        return Int8WeightOnlyConfig(set_inductor_config=False)
    if scheme == "int8dq":
        return Int8DynamicActivationInt8WeightConfig(set_inductor_config=False)
    if scheme == "fp8wo":
        return Float8WeightOnlyConfig(set_inductor_config=False)
    if scheme == "fp8dq":  # per-row scales: per-tensor ones visibly lose detail on DiT activations
        return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)
    if scheme == "int4wo":
        return Int4WeightOnlyConfig(
            group_size=INT4_GROUP, int4_packing_format="tile_packed_to_4d", set_inductor_config=False
        )
    raise ValueError(f"unknown quantization scheme {scheme!r}")


def _shape_fits(scheme: str, layer: nn.Linear) -> bool:
    """Whether the scheme's kernels take this layer's shape (others stay in the model dtype)."""
    if scheme.startswith("fp8"):
        return layer.in_features % 16 == 0 and layer.out_features % 16 == 0
    if scheme == "int4wo":
        return layer.in_features % INT4_GROUP == 0
    return True


@dataclass
class QuantSummary:
    """What quantization did to one pipeline's transformers."""

    scheme: str
    quantized: list[str] = field(default_factory=list)
    # Linear layers left in the model dtype, by why: outside the blocks, excluded, shape.
    kept: dict[str, list[str]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "type": self.scheme,
            "quantized_layers": len(self.quantized),
            "kept_layers": {why: len(names) for why, names in self.kept.items()},
        }


# Which scheme each quantized transformer holds: quantization cannot be undone in place (the
# high-precision weights are freed, which is the point), so a second apply must not stack another.
_quantized: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def quantized_as(transformer: nn.Module) -> str | None:
    """The scheme `transformer` was quantized with (None: it was not)."""
    return _quantized.get(transformer)


def chosen_layers(
    transformer: nn.Module, scheme: str, blocks: Sequence[BlockList], scope: str, exclude: Sequence[str]
) -> tuple[list[str], dict[str, list[str]]]:
    """The Linear layers `scheme` quantizes, and those it keeps in the model dtype by why (the memory
    plan counts the same choice on a transformer built on meta)."""
    block_attrs = {spec.attr for spec in blocks}
    chosen: list[str] = []
    kept: dict[str, list[str]] = {}
    for name, module in transformer.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if scope == "blocks" and name.split(".")[0] not in block_attrs:
            kept.setdefault("outside the repeated blocks", []).append(name)
        elif _is_lora(name):
            kept.setdefault("LoRA adapter", []).append(name)
        elif any(fnmatchcase(name, pattern) for pattern in exclude):
            kept.setdefault("excluded", []).append(name)
        elif not _shape_fits(scheme, module):
            kept.setdefault("shape the kernel cannot take", []).append(name)
        else:
            chosen.append(name)
    return chosen, kept


def quantize_transformer(
    transformer: nn.Module,
    summary: QuantSummary,
    blocks: Sequence[BlockList],
    scope: str,
    exclude: Sequence[str],
    prefix: str = "",
) -> None:
    """Quantize the chosen Linear layers in place as `summary.scheme`, recording each layer in
    `summary` (one summary can gather a pipeline's transformers; `prefix` names this one)."""
    scheme = summary.scheme
    done = _quantized.get(transformer)
    if done is not None:
        if done != scheme:
            raise UserError(
                f"[quant] type = '{scheme}': this pipeline's transformer is already quantized as '{done}'; "
                "load the pipeline again to quantize it differently"
            )
        return
    chosen, kept = chosen_layers(transformer, scheme, blocks, scope, exclude)
    summary.quantized += [prefix + name for name in chosen]
    for why, names in kept.items():
        summary.kept.setdefault(why, []).extend(prefix + name for name in names)
    if chosen:
        from torchao.quantization import quantize_

        quantize_(transformer, _config(scheme), filter_fn=_named(set(chosen)))
    _quantized[transformer] = scheme


def _is_lora(name: str) -> bool:
    """A peft LoRA layer (`…to_q.lora_A.default`): tiny, and peft adds its output to the base
    layer's in the adapter's dtype, so quantizing it saves nothing and breaks unload / fuse."""
    return any(part.startswith("lora_") for part in name.split("."))


def _named(names: set[str]) -> Callable[[nn.Module, str], bool]:
    return lambda module, name: isinstance(module, nn.Linear) and name in names


def refuse_on_quantized(pipe: Any | None, transformers: dict[str, nn.Module], scheme: str) -> list[Callable[[], None]]:
    """Wrap the methods that fail deep inside torchao on quantized weights, so each says so in one line
    instead: `save_pretrained` as safetensors (the pipeline's, before it writes any file, and each
    transformer's), and `fuse_qkv_projections` (the pipeline's and each transformer's). Returns the undos."""
    from accel.hooks import LORA, wrap

    undo: list[Callable[[], None]] = []
    owners: list[tuple[str, Any]] = [("pipe", pipe)] if pipe is not None else []
    owners += [(f"pipe.{attr}", t) for attr, t in transformers.items()]
    for where, owner in owners:
        if callable(getattr(owner, "save_pretrained", None)):
            undo.append(
                wrap(
                    owner,
                    "save_pretrained",
                    "accel.refuse_safetensors",
                    LORA,
                    _refuse_safetensors(getattr(owner, "save_pretrained"), where, scheme),
                )
            )
        if callable(getattr(owner, "fuse_qkv_projections", None)):
            undo.append(
                wrap(owner, "fuse_qkv_projections", "accel.refuse_fuse_qkv", LORA, _refuse_fuse_qkv(where, scheme))
            )
    return undo


def _refuse_safetensors(method: Callable[..., Any], where: str, scheme: str) -> Callable[..., Any]:
    signature = inspect.signature(method)

    def refuse(call_next: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        arguments = signature.bind_partial(*args, **kwargs).arguments
        parameter = signature.parameters.get("safe_serialization")
        safe = arguments.get("safe_serialization", parameter.default if parameter is not None else True)
        if safe:
            raise UserError(
                f"[quant] type = '{scheme}': {where}.save_pretrained() cannot write torchao's quantized weights as "
                "safetensors; pass safe_serialization=False (from_pretrained loads that back quantized), or save "
                "before "
                "accel.apply"
            )
        return call_next(*args, **kwargs)

    return refuse


def _refuse_fuse_qkv(where: str, scheme: str) -> Callable[..., Any]:
    def refuse(call_next: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        raise UserError(
            f"[quant] type = '{scheme}': {where}.fuse_qkv_projections() cannot concatenate torchao's quantized q, k "
            "and v weights; call it before accel.apply (the fused layers are then quantized)"
        )

    return refuse
