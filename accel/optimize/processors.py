"""Leaner attention processors in place of diffusers' own, where a family names one.

Some diffusers processors build more than attention needs: HunyuanVideo 1.5's makes a (B, 1, L, L)
boolean pair mask in every block, 12 GiB at 720p x 121 frames, which offload cannot remove and
which decides whether the model fits one 24 GB card. A family lists the processors accel replaces
(`Family.processors`); modules whose processor is of another class (a user's own) are left alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from accel.models.base import Family

# What diffusers keeps on a processor object rather than on its module.
_CARRIED = ("_attention_backend", "_parallel_config")


def install_processors(transformer: torch.nn.Module, family: Family) -> Callable[[], None]:
    """Give every module of `transformer` that runs one of the family's replaced processors accel's
    equivalent; returns the undo (the original processor objects back)."""
    factories = dict(family.processors)
    if not factories:
        return lambda: None
    replaced: list[tuple[Any, Any]] = []
    for module in transformer.modules():
        processor = getattr(module, "processor", None)
        factory = factories.get(type(processor).__name__) if processor is not None else None
        if factory is not None and hasattr(module, "set_processor"):
            lean = factory()
            for setting in _CARRIED:  # a backend the user chose stays chosen
                if hasattr(processor, setting):
                    setattr(lean, setting, getattr(processor, setting))
            module.set_processor(lean)
            replaced.append((module, processor))

    def undo() -> None:
        while replaced:
            module, processor = replaced.pop()
            module.set_processor(processor)

    return undo
