"""Step 1 of `apply`: torchao on the transformers' Linear layers, and one-line refusals of the pipeline
methods that fail on quantized weights."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from accel.errors import UserError
from accel.hooks import LORA, wrap
from accel.models.parts import execution_device, transformers_of
from accel.optimize.quantize import QuantSummary, check_hardware, quantize_transformer, refuse_on_quantized

if TYPE_CHECKING:
    from accel.handle import AccelHandle


def apply_quant(handle: AccelHandle) -> None:
    settings = handle.recipe.quant
    if settings.type == "none":
        return
    transformers = transformers_of(handle.pipe, handle.family)
    first = next(iter(transformers.values()))
    parameter = next(first.parameters())
    check_hardware(settings.type, execution_device(handle.pipe, first), parameter.dtype)
    handle.quant = QuantSummary(settings.type)
    for attr, transformer in transformers.items():
        quantize_transformer(
            transformer,
            handle.quant,
            handle.family.blocks,
            settings.scope,
            settings.exclude,
            prefix=f"{attr}." if len(transformers) > 1 else "",
        )
    handle.on_each_pipeline(partial(_refuse_on_quantized_pipeline, quantized=set(transformers), scheme=settings.type))
    handle._undo.extend(refuse_on_quantized(None, transformers, settings.type))


def _refuse_on_quantized_pipeline(pipe: Any, quantized: set[str], scheme: str) -> Callable[[], None]:
    """A pipeline's own methods that fail on quantized weights, each refused in one line."""
    undo = [
        _refuse_lora_fusing(pipe, method, quantized, scheme)
        for method in ("fuse_lora", "unfuse_lora")
        if callable(getattr(pipe, method, None))
    ]
    undo.extend(refuse_on_quantized(pipe, {}, scheme))
    return partial(_undo_all, undo)


def _undo_all(undo: list[Callable[[], None]]) -> None:
    while undo:
        undo.pop()()


def _refuse_lora_fusing(pipe: Any, method: str, quantized: set[str], scheme: str) -> Callable[[], None]:
    """Wrap this pipeline's `fuse_lora` / `unfuse_lora`: peft cannot add a LoRA delta to (or take it
    from) torchao-quantized weights, and fails deep inside with an operator error; say so in one line."""
    signature = inspect.signature(getattr(pipe, method))

    def refuse(call_next: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        components = signature.bind_partial(*args, **kwargs).arguments.get("components")
        if components is None:
            parameter = signature.parameters.get("components")
            components = parameter.default if parameter is not None else list(quantized)
        if quantized & set(components):
            raise UserError(
                f"[quant] type = '{scheme}': pipe.{method}() cannot merge LoRA weights into the quantized "
                "transformer; keep the LoRA unfused (it runs beside the quantized layers), or fuse it "
                "before accel.apply"
            )
        return call_next(*args, **kwargs)

    return wrap(pipe, method, f"accel.refuse_{method}", LORA, refuse)
