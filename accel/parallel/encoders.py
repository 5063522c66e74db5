"""Text encoders on one rank ([memory] text_encoder = "rank0"): the layout's first rank encodes each
prompt once and sends the embeddings to the others, which hold no text encoder at all. With
text_encoder = "cpu" that rank (or the one process) also keeps them in host memory and encodes there.

Every family's pipeline encodes through `encode_prompt`, so that one method is wrapped: on the
first rank it runs and its result is broadcast over the layout's group (its structure as a
picklable skeleton, then each tensor on the device); on the others the same call returns the
received copy, built on the device and in the dtype the first rank's had. Dropping the encoders
stays when the rest of `accel.apply` is undone, like the TP split: the memory was given back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from accel.errors import NotAvailableError
import inspect

from accel.instance import ENCODE, ENCODE_ON_CPU, wrap

METHOD = "encode_prompt"


# Placements under which only the layout's first rank holds the text encoders.
ONE_RANK_PLACEMENTS = ("rank0", "cpu")


def loads_text_encoders(placement: str, layout_size: int) -> bool:
    """Whether this rank loads the text encoders under [memory] text_encoder = `placement` in a
    layout of `layout_size` ranks (replicas of it side by side: each one's first rank encodes)."""
    from accel.launch import rank

    return placement not in ONE_RANK_PLACEMENTS or layout_size == 1 or rank() % layout_size == 0


def text_encoder_names(pipe: Any) -> list[str]:
    """The pipeline's text encoder components that it holds (text_encoder, text_encoder_2, …)."""
    return [name for name in getattr(pipe, "components", {}) if name.startswith("text_encoder") and getattr(pipe, name, None) is not None]


@dataclass(frozen=True)
class _Slot:
    """Where a tensor of the result was: its index among the tensors sent, shape, dtype and device kind."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    on_cpu: bool


def _mapped(value: Any, leaf: type, fn: Any) -> Any:
    """`value` with every `leaf` inside its lists, tuples (named ones too) and dicts replaced by fn(leaf)."""
    if isinstance(value, leaf):
        return fn(value)
    if isinstance(value, (list, tuple)):
        items = [_mapped(item, leaf, fn) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {key: _mapped(item, leaf, fn) for key, item in value.items()}
    return value


def _skeleton(value: Any, tensors: list[torch.Tensor]) -> Any:
    """`value` with each tensor replaced by its _Slot, the tensors appended to `tensors` in order."""

    def slot(tensor: torch.Tensor) -> _Slot:
        tensors.append(tensor)
        return _Slot(len(tensors) - 1, tuple(tensor.shape), tensor.dtype, tensor.device.type == "cpu")

    return _mapped(value, torch.Tensor, slot)


class FirstRankEncodes:
    """`pipe.encode_prompt` run by the first rank of `group` only, its result shared with the rest."""

    def __init__(self, pipe: Any, group: Any, device: torch.device) -> None:
        if not callable(getattr(pipe, METHOD, None)):
            raise NotAvailableError(
                f'[memory] text_encoder = "rank0": {type(pipe).__name__} has no {METHOD}() to run on one rank; set text_encoder = "replicated"'
            )
        self.group, self.device = group, device
        self.source = dist.get_global_rank(group, 0) if group is not None and group != dist.group.WORLD else 0
        self.leads = dist.get_rank() == self.source
        if not self.leads:
            pipe.register_modules(**{name: None for name in text_encoder_names(pipe)})
        self.remove = wrap(pipe, METHOD, "accel.encoders.first_rank", ENCODE, self._encode)

    def _encode(self, call_next: Any, *args: Any, **kwargs: Any) -> Any:
        if self.leads:
            result = call_next(*args, **kwargs)
            tensors: list[torch.Tensor] = []
            skeleton = _skeleton(result, tensors)
            dist.broadcast_object_list([skeleton], src=self.source, group=self.group)
            for tensor in tensors:
                dist.broadcast(tensor.to(self.device).contiguous(), src=self.source, group=self.group)
            return result
        received: list[Any] = [None]
        dist.broadcast_object_list(received, src=self.source, group=self.group)
        return _mapped(received[0], _Slot, self._receive)  # in the order the first rank sent them

    def _receive(self, slot: _Slot) -> torch.Tensor:
        tensor = torch.empty(slot.shape, dtype=slot.dtype, device=self.device)
        dist.broadcast(tensor, src=self.source, group=self.group)
        return tensor.cpu() if slot.on_cpu else tensor



def _moved(value: Any, device: torch.device) -> Any:
    return _mapped(value, torch.Tensor, lambda tensor: tensor.to(device))


class EncodesOnCpu:
    """The pipeline's text encoders kept in host memory: `encode_prompt` runs with device="cpu" and
    its tensors are moved to `device` (the transformer's). remove() puts the encoders back."""

    def __init__(self, pipe: Any, device: torch.device) -> None:
        method = getattr(pipe, METHOD, None)
        if not callable(method) or "device" not in inspect.signature(method).parameters:
            raise NotAvailableError(
                f'[memory] text_encoder = "cpu": {type(pipe).__name__} has no {METHOD}(device=...) to run on the CPU; '
                f'set text_encoder = "replicated" or "rank0"'
            )
        self.device = device
        self.encoders = {name: getattr(pipe, name) for name in text_encoder_names(pipe)}
        self.devices = {name: next(encoder.parameters()).device for name, encoder in self.encoders.items()}
        for encoder in self.encoders.values():
            encoder.to("cpu")
        self._unwrap = wrap(pipe, METHOD, "accel.encoders.on_cpu", ENCODE_ON_CPU, self._encode)

    def _encode(self, call_next: Any, *args: Any, **kwargs: Any) -> Any:
        return _moved(call_next(*args, **{**kwargs, "device": torch.device("cpu")}), self.device)

    def remove(self) -> None:
        self._unwrap()
        for name, encoder in self.encoders.items():
            encoder.to(self.devices[name])
