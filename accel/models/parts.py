"""A loaded pipeline's parts as every accelerator reaches them: its transformers (the family's
attributes), their blocks (over the family's block lists, in the order the transformer runs them),
and the device it computes on. One lookup of each, so the cache, compile, quantization and the
parallel layout all see the same modules."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from accel.models.base import BlockList, Family


def transformers_of(pipe: Any, family: Family) -> dict[str, Any]:
    """The transformers `pipe` holds by attribute, in the family's order (Wan 2.2's two experts: both)."""
    return {attr: t for attr in family.transformer_attrs if (t := getattr(pipe, attr, None)) is not None}


def listed_blocks(transformer: Any, block_lists: Sequence[BlockList]) -> list[tuple[BlockList, Any]]:
    """The transformer's blocks over all of `block_lists`, in run order, each with its list."""
    return [(spec, block) for spec in block_lists for block in getattr(transformer, spec.attr)]


def blocks_of(transformer: Any, block_lists: Sequence[BlockList]) -> list[Any]:
    """The transformer's blocks over all of `block_lists`, in run order."""
    return [block for _, block in listed_blocks(transformer, block_lists)]


def transformer_device(pipe: Any, family: Family) -> Any:
    """The device `pipe`'s transformers compute on (its first transformer's, as offload sees it)."""
    return execution_device(pipe, next(iter(transformers_of(pipe, family).values())))


def execution_device(pipe: Any, module: Any) -> Any:
    """The device `pipe` computes on. Under accelerate's model CPU offload or diffusers' group
    offloading the weights wait on the CPU, so `module`'s first parameter (the fallback, for a
    pipeline that does not say) would name the wrong one; diffusers' `_execution_device` knows."""
    device = getattr(pipe, "_execution_device", None)
    return device if device is not None else next(module.parameters()).device
