"""The model a memory estimate measures, without reading a weight: each component built from its
config in bfloat16 (on meta to count its weights; on fake `cuda` to run it), the transformer cut to
one block of each kind for the forward (under no_grad a block's activations are freed before the
next block runs, so the working peak does not grow with depth), and the flagship's inputs on the device.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from accel.models.flagships import Component

DTYPE = torch.bfloat16
# Config keys that set a transformer's depth: one block of each kind measures its working peak.
DEPTH_KEYS = (
    "num_layers",
    "num_single_layers",
    "num_refiner_layers",
    "n_layers",
    "n_refiner_layers",
    "num_text_blocks",
    "num_visual_blocks",
)


@contextmanager
def _built_as(device: str) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(DTYPE)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def build(component: Component, device: str = "meta", config: dict[str, Any] | None = None) -> nn.Module:
    """`component` from its config in bfloat16 on `device` ("meta": no memory; "cuda" inside a fake mode)."""
    config = dict(component.config if config is None else config)
    with _built_as(device):
        if component.library == "diffusers":
            import diffusers

            return getattr(diffusers, component.cls).from_config(config).eval()
        import transformers

        made = transformers.AutoConfig.for_model(component.model_type, **config)
        return getattr(transformers, component.cls)._from_config(made, dtype=DTYPE).eval()


def cut_config(component: Component) -> dict[str, Any]:
    import diffusers

    accepted = set(inspect.signature(getattr(diffusers, component.cls).__init__).parameters)
    return {**component.config, **{key: 1 for key in DEPTH_KEYS if key in accepted}}


def on_device(inputs: Any, device: str) -> Any:
    if isinstance(inputs, torch.Tensor):
        return inputs.to(device, DTYPE if inputs.is_floating_point() else inputs.dtype)
    if isinstance(inputs, dict):
        return {key: on_device(value, device) for key, value in inputs.items()}
    if isinstance(inputs, (list, tuple)):  # Z-Image takes its latents and prompts as lists
        return type(inputs)(on_device(value, device) for value in inputs)
    return inputs


def block_lists(model: nn.Module) -> dict[str, nn.Module]:
    """The model's repeated blocks: its ModuleList / Sequential children (what group offload streams)."""
    return {name: child for name, child in model.named_children() if isinstance(child, (nn.ModuleList, nn.Sequential))}
