"""LoRAs a request chooses (`accel serve --lora NAME=PATH`, `--lora-dir DIR`): registered by name
before any rank starts, loaded as adapters on first use and kept (the least recently used is
dropped past `--max-loras`), and switched per request with diffusers' `set_adapters`: the base
weights are never reloaded or re-fused, and a request without a LoRA runs them alone.

A LoRA in the recipe's `[model] lora` is different: part of the model, fused once at load.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from accel.errors import UserError
from accel.models.lora import Lora, load_adapter

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_SCALE = 100.0  # far past any useful strength, finite in every dtype's arithmetic
Chosen = tuple[tuple[str, float], ...]  # a request's (name, scale) pairs, in its order


def registered_loras(given: Sequence[str] | None, folder: Path | None) -> dict[str, str]:
    """NAME -> file of `--lora NAME=PATH` (repeatable) and of each `*.safetensors` in `--lora-dir`
    (named by its stem); one line for a bad name, a missing file, or a name given twice."""
    loras: dict[str, str] = {}

    def add(name: str, path: Path, where: str) -> None:
        if not NAME.fullmatch(name):
            raise UserError(f"{where}: the name {name!r} must be 1 to 64 letters, digits, '.', '_' or '-'")
        if name in loras:
            raise UserError(f"{where}: the name {name!r} is registered twice; give each LoRA its own")
        if not path.is_file():
            raise UserError(f"{where}: {path} is not a file; pass a LoRA .safetensors file")
        loras[name] = str(path.resolve())

    for text in given or ():
        name, sep, path = text.partition("=")
        if not sep or not path:
            raise UserError(f"--lora {text}: write NAME=PATH, e.g. --lora pixel=loras/pixel.safetensors")
        add(name, Path(path).expanduser(), f"--lora {text}")
    if folder is not None:
        folder = folder.expanduser()
        if not folder.is_dir():
            raise UserError(f"--lora-dir {folder}: not a folder; pass the folder holding the LoRA .safetensors files")
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise UserError(f"--lora-dir {folder}: no .safetensors file in it")
        for path in files:
            add(path.stem, path, f"--lora-dir {folder}")
    return loras


def lora_refusal(settings: Any) -> str | None:
    """Why this server's layout cannot switch LoRAs per request (None: it can)."""
    fuse = "; fuse one LoRA into the model with the recipe's [model] lora instead"
    if settings.quant.type != "none":
        return (
            f"--lora with [quant] type {settings.quant.type} is not served yet: adapters over quantized layers are "
            f"untested{fuse}"
        )
    return None


def loras_for(settings: Any, given: Sequence[str] | None, folder: Path | None, most: int) -> dict[str, str]:
    """`--lora`, `--lora-dir` and `--max-loras` of a server or batch with these settings, checked
    before any rank starts: the registered LoRAs by name."""
    if most < 1:
        raise UserError(f"--max-loras must be >= 1, got {most}")
    loras = registered_loras(given, folder)
    if loras and (refusal := lora_refusal(settings)) is not None:
        raise UserError(refusal)
    return loras


def chosen_loras(given: Mapping[str, float] | None, registered: Mapping[str, str]) -> Chosen:
    """A request's `lora` field checked against the registered names: (name, scale) pairs, or
    ValueError with the one line a 400 carries."""
    if not given:
        return ()
    known = ", ".join(sorted(registered)) or "none (accel serve --lora NAME=PATH registers them)"
    for name, scale in given.items():
        if name not in registered:
            raise ValueError(f"lora: no LoRA {name!r} on this server; registered: {known}")
        if not math.isfinite(scale) or abs(scale) > MAX_SCALE:
            raise ValueError(f"lora: {name}'s scale must be a number between -{MAX_SCALE:g} and {MAX_SCALE:g}")
    return tuple((name, float(scale)) for name, scale in given.items())


class Adapters:
    """The pipeline's loaded adapters, at most `most` (least recently used dropped first).

    With `compiled` blocks, switching adapters the usual way (set_adapters) recompiles them: the
    compiled code specializes on the list of active adapters and on each scale, a Python float.
    So there every loaded LoRA sits in a slot (an adapter named `accel_slot_K`), every slot stays
    active, and a switch only writes the scales into tensors the compiled code reads: the chosen
    LoRAs' at their scales, the others' at 0. The blocks compile again only when a slot is first
    filled or takes a LoRA of another rank or other layers."""

    def __init__(self, pipe: Any, registered: Mapping[str, str], most: int, compiled: bool = False) -> None:
        self.pipe = pipe
        self.registered = dict(registered)
        self.most = most
        self.compiled = compiled
        self.loaded: OrderedDict[str, str] = OrderedDict()  # LoRA name -> its adapter's name, least recent first
        self.active: Chosen = ()
        # compiled: slot -> each LoRA layer's scale tensor the compiled code reads, with the LoRA's own
        # scale there (alpha / rank); found once each time a slot fills, written at each switch
        self._scales: dict[str, list[tuple[Any, float]]] = {}

    def use(self, chosen: Chosen) -> None:
        """Make `chosen` the active adapters at their scales (none: the base weights alone)."""
        if chosen == self.active:
            return
        if self.compiled:
            self._use_slots(chosen)
            self.active = chosen
            return
        names = [name for name, _scale in chosen]
        for name in names:
            if name in self.loaded:
                self.loaded.move_to_end(name)
            else:
                self._make_room(keep=names)
                self._load(name)
        if chosen:
            self.pipe.enable_lora()
            self.pipe.set_adapters(names, adapter_weights=[scale for _name, scale in chosen])
        elif self.loaded:
            self.pipe.disable_lora()
        self.active = chosen

    def _make_room(self, keep: list[str]) -> str | None:
        """Drop the least recently used LoRAs not in `keep` until one more fits; the adapter name the
        last one dropped had (a slot to refill), if any."""
        freed = None
        while len(self.loaded) >= self.most:
            oldest = next((name for name in self.loaded if name not in keep), None)
            if oldest is None:
                return freed  # the request itself names more than the cache holds: it gets them all
            freed = self.loaded.pop(oldest)
            self.pipe.delete_adapters(freed)
        return freed

    def _load(self, name: str, adapter: str | None = None) -> None:
        adapter = adapter or name
        load_adapter(self.pipe, Lora(self.registered[name]), adapter, f"LoRA {name}: ")
        self.loaded[name] = adapter

    def _use_slots(self, chosen: Chosen) -> None:
        names = [name for name, _scale in chosen]
        filled = False
        for name in names:
            if name in self.loaded:
                self.loaded.move_to_end(name)
                continue
            slot = self._make_room(keep=names)
            taken = set(self.loaded.values())
            slot = slot or next(f"accel_slot_{k}" for k in range(len(taken) + 1) if f"accel_slot_{k}" not in taken)
            self._load(name, slot)
            filled = True
        if filled:  # every slot active from now on; set_adapters leaves float scales, made tensors here
            slots = list(self.loaded.values())
            self.pipe.enable_lora()
            self.pipe.set_adapters(slots, adapter_weights=[1.0] * len(slots))
            self._scales = self._scale_tensors(slots)
        wanted = dict.fromkeys(self.loaded.values(), 0.0)
        for name, scale in chosen:
            wanted[self.loaded[name]] = scale
        for slot, weight in wanted.items():
            for tensor, base in self._scales[slot]:
                tensor.fill_(weight * base)

    def _scale_tensors(self, slots: list[str]) -> dict[str, list[tuple[Any, float]]]:
        """Each slot's LoRA layers' scales as tensors in place of peft's floats (set_scale's value at
        weight 1: the LoRA's alpha over its rank), with that value, for the switches to write."""
        import torch
        from peft.tuners.lora import LoraLayer

        found: dict[str, list[tuple[Any, float]]] = {slot: [] for slot in slots}
        for component in self.pipe.components.values():
            if not isinstance(component, torch.nn.Module):
                continue
            for module in component.modules():
                if not isinstance(module, LoraLayer):
                    continue
                for slot in slots:
                    if slot in module.scaling:
                        base = float(module.scaling[slot])
                        device = next(module.parameters()).device
                        module.scaling[slot] = torch.tensor(base, dtype=torch.float32, device=device)
                        found[slot].append((module.scaling[slot], base))
        return found
