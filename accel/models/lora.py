"""LoRA weights, fused into the pipeline's weights before anything accelerates it.

A LoRA is part of the model a user asked for, so accel merges it into the base weights right
after loading (diffusers' `load_lora_weights`, `fuse_lora`, then `unload_lora_weights`): the
transformer is then plain linear layers again, which quantization, compile, the cache and context
parallelism handle as they handle any checkpoint, at no cost per step. Parsing and the file check
need no torch: they run before any rank starts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accel.errors import ModelError, UserError

FORM = "PATH@SCALE (a .safetensors file, a folder, or a hub repo id; SCALE 1 when left out)"


@dataclass(frozen=True)
class Lora:
    source: str
    scale: float = 1.0

    @property
    def local(self) -> Path | None:
        """The file or folder it names on this machine; None: a hub repo id."""
        path = Path(self.source).expanduser()
        looks_local = (
            path.exists() or self.source.startswith(("/", ".", "~")) or path.suffix in (".safetensors", ".bin", ".pt")
        )
        return path if looks_local else None


def parse_loras(given: Sequence[str] | None) -> tuple[Lora, ...]:
    """`[model] lora` entries as Lora specs; a bad scale or a local path that is not there is one line."""
    loras = []
    for text in given or ():
        source, at, scale_text = text.rpartition("@")
        if not at:
            source, scale_text = text, "1"
        try:
            scale = float(scale_text)
        except ValueError:
            raise UserError(f"[model] lora: {text}: write {FORM}, e.g. style.safetensors@0.8") from None
        if not math.isfinite(scale):
            raise UserError(f"[model] lora: {text}: the scale must be a finite number, got {scale_text}")
        lora = Lora(source, scale)
        if lora.local is not None and not lora.local.exists():
            raise UserError(
                f"[model] lora: {source} does not exist; pass a LoRA .safetensors file, its folder, or a hub repo id"
            )
        loras.append(lora)
    return tuple(loras)


def load_adapter(pipe: Any, lora: Lora, name: str, where: str) -> None:
    """Load `lora` into the pipeline as the adapter `name`; a file it cannot load is one line
    starting with `where`."""
    local = lora.local
    try:
        if local is not None and local.is_file():
            pipe.load_lora_weights(str(local.parent), weight_name=local.name, adapter_name=name)
        else:
            pipe.load_lora_weights(str(local) if local is not None else lora.source, adapter_name=name)
    except (ValueError, KeyError, OSError, RuntimeError) as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        raise ModelError(
            f"{where}{lora.source} is not a LoRA {type(pipe).__name__} can load "
            f"({lines[0] if lines else type(error).__name__})"
        ) from None


def fuse_loras(pipe: Any, loras: Sequence[Lora]) -> None:
    """Load each LoRA, merge them at their scales into the pipeline's weights, and drop the adapters."""
    if not loras:
        return
    if not hasattr(pipe, "load_lora_weights"):
        raise UserError(f"[model] lora: {type(pipe).__name__} has no diffusers LoRA loader; remove lora")
    names = [f"accel_lora_{index}" for index in range(len(loras))]
    for name, lora in zip(names, loras, strict=True):
        load_adapter(pipe, lora, name, "[model] lora: ")
        if not any(name in adapters for adapters in pipe.get_list_adapters().values()):
            raise ModelError(
                f"[model] lora: {lora.source} has no weights for this {type(pipe).__name__}'s modules; "
                "pass a LoRA made for this model"
            )
    pipe.set_adapters(names, adapter_weights=[lora.scale for lora in loras])
    pipe.fuse_lora(adapter_names=names)
    pipe.unload_lora_weights()
