"""Learn what a transformer's blocks return from one call, where diffusers' registry does not say.

The cache skips a block by handing its inputs on as its outputs, so it must know which argument
each output is. A transformer hands block k's outputs straight to block k + 1 as arguments: so
each output of a list's first block is named by the argument of the second block that *is* that
tensor (the same object; an equal tensor of the same shape where the transformer copied it on
the way, when exactly one argument is). An output no argument receives, or a list of one block,
stays unknown, with the reason.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from accel.models.discover import Discovery, FoundList


def probe_returns(transformer: nn.Module, discovery: Discovery, call: Callable[[], Any]) -> Discovery:
    """`discovery` with every list's unknown `returns` learned from `call` (one forward of the
    transformer, e.g. a one-step pipeline call); the lists the registry named are kept as they are."""
    wanted = [found for found in discovery.lists if found.returns is None and found.count >= 2]
    outputs: dict[str, Any] = {}
    arguments: dict[str, dict[str, Any]] = {}
    handles: list[RemovableHandle] = []

    def keep_output(attr: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            outputs.setdefault(attr, output)

        return hook

    def keep_arguments(attr: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            arguments.setdefault(attr, named_arguments(module, args, kwargs))

        return hook

    try:
        for found in wanted:
            blocks = transformer.get_submodule(found.attr)
            handles.append(blocks[0].register_forward_hook(keep_output(found.attr), with_kwargs=True))
            handles.append(blocks[1].register_forward_pre_hook(keep_arguments(found.attr), with_kwargs=True))
        with torch.no_grad():
            call()
    finally:
        for handle in handles:
            handle.remove()
    return replace(
        discovery,
        lists=tuple(
            _learned(found, outputs, arguments) if found in wanted else _one_block(found) for found in discovery.lists
        ),
    )


def _one_block(found: FoundList) -> FoundList:
    if found.returns is None and found.count < 2:
        return replace(found, unknown=f"{found.attr} holds one block: no next block shows what it returns")
    return found


def _learned(found: FoundList, outputs: dict[str, Any], arguments: dict[str, dict[str, Any]]) -> FoundList:
    if found.attr not in outputs or found.attr not in arguments:
        return replace(found, unknown=f"the probe call did not run two blocks of {found.attr}")
    returns, why = _match(outputs[found.attr], arguments[found.attr], found.block_class)
    return replace(found, returns=returns, unknown=why)


def named_arguments(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """A block call's arguments by parameter name (a `**kwargs` parameter's entries by their own names)."""
    signature = inspect.signature(module.forward)
    bound = signature.bind_partial(*args, **kwargs).arguments
    named: dict[str, Any] = {}
    for name, value in bound.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[name] = value
    return named


def _match(output: Any, arguments: dict[str, Any], block_class: str) -> tuple[tuple[str, ...] | None, str]:
    """The argument each output is, in output order: (names, "") or (None, why not)."""
    items = output if isinstance(output, tuple) else (output,)
    names: list[str] = []
    for index, item in enumerate(items):
        if not isinstance(item, torch.Tensor):
            return None, f"output {index} of {block_class} is a {type(item).__name__}, not a tensor"
        same = [name for name, value in arguments.items() if value is item]
        if not same:
            same = [
                name
                for name, value in arguments.items()
                if isinstance(value, torch.Tensor)
                and value.shape == item.shape
                and value.dtype == item.dtype
                and torch.equal(value, item)
            ]
        if len(same) != 1:
            how = (
                "reaches the next block as no argument"
                if not same
                else f"equals several arguments of the next ({', '.join(same)})"
            )
            return None, f"output {index} of {block_class} {how}"
        names.append(same[0])
    return tuple(names), ""
