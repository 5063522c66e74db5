"""One unsplit forward of a transformer watched for what the automatic plan needs
(accel/parallel/automatic.py): the first block's arguments of each block list, the attention calls
per module pattern (query and key token counts, square masks), the modules run after the last block,
and the transformer's own arguments and output. Also the call itself, kept to run again.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from accel.models.base import BlockList
from accel.models.probe import named_arguments
from accel.parallel.outputs import map_tensors


@dataclass(frozen=True)
class TransformerCall:
    """One call of a transformer's forward, kept to run it again (the verification's input)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def fresh(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments with every tensor copied, so a model that writes into its inputs changes no other run."""
        return map_tensors(self.args, torch.clone), map_tensors(self.kwargs, torch.clone)

    def to(self, device: torch.device | str) -> TransformerCall:
        return TransformerCall(
            map_tensors(self.args, lambda t: t.to(device)), map_tensors(self.kwargs, lambda t: t.to(device))
        )


@dataclass
class AttentionCalls:
    """The attention calls one module pattern made: (query tokens, key tokens) pairs, and whether
    any came with a square boolean mask (one relating every token pair)."""

    shapes: set[tuple[int, int]] = field(default_factory=set)
    square_mask: bool = False


@dataclass
class Observation:
    """What one unsplit forward showed: first-block arguments per list, attention calls per module
    pattern, the modules outside the blocks called after the last block, in call order (name, first
    argument), the transformer's own arguments and its output."""

    first_arguments: dict[str, dict[str, Any]]
    attention: dict[str, AttentionCalls]
    after_blocks: list[tuple[str, Any]]
    transformer_arguments: dict[str, Any]
    output: Any


class _ModuleStack:
    """The dotted name of the innermost module running, from hooks on every module."""

    def __init__(self, transformer: nn.Module) -> None:
        self.names: list[str] = []
        self._handles = []
        for name, module in transformer.named_modules():
            self._handles.append(module.register_forward_pre_hook(lambda *_, name=name: self._enter(name)))
            self._handles.append(module.register_forward_hook(lambda *_: self._leave(), always_call=True))

    def _enter(self, name: str) -> None:
        self.names.append(name)

    def _leave(self) -> None:
        self.names.pop()

    @property
    def innermost(self) -> str:
        return self.names[-1] if self.names else ""

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class _AttentionLog(TorchFunctionMode):
    def __init__(self, stack: _ModuleStack) -> None:
        super().__init__()
        self.stack = stack
        self.calls: list[tuple[str, int, int]] = []

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            query = args[0] if args else kwargs["query"]
            key = args[1] if len(args) > 1 else kwargs["key"]
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            square = (
                isinstance(mask, Tensor)
                and mask.dtype == torch.bool
                and mask.dim() == 4
                and mask.shape[-1] == mask.shape[-2] > 1
            )
            self.calls.append((self.stack.innermost, query.shape[-2], key.shape[-2], square))
        return func(*args, **kwargs)


def pattern_of(name: str) -> str:
    """A module name with every list index made `*`: one pattern for the same module of every block."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", name)


def observe(transformer: nn.Module, call: TransformerCall, lists: Sequence[BlockList]) -> Observation:
    """Run `transformer` once on `call`, unsplit, watching what the plan needs."""
    first_arguments: dict[str, dict[str, Any]] = {}
    order: list[tuple[str, Any]] = []  # direct children in call order, and "<blocks>" after each block
    handles = []
    attrs = {block_list.attr for block_list in lists}
    for block_list in lists:
        blocks = transformer.get_submodule(block_list.attr)

        def keep(module: nn.Module, args: Any, kwargs: Any, attr: str = block_list.attr) -> None:
            first_arguments.setdefault(attr, named_arguments(module, args, kwargs))

        handles.append(blocks[0].register_forward_pre_hook(keep, with_kwargs=True))
        for block in blocks:
            handles.append(block.register_forward_hook(lambda *_: order.append(("<blocks>", None))))
    # Every module outside the block lists: the outermost one running first after the blocks is
    # where the output is gathered (a ModuleDict's item, such as Z-Image's final layer, is called
    # where the dict itself never is).
    for name, child in transformer.named_modules():
        if not name or any(name == attr or name.startswith(attr + ".") for attr in attrs):
            continue

        def called(module: nn.Module, args: Any, kwargs: Any, name: str = name) -> None:
            first = next(iter(named_arguments(module, args, kwargs).values()), None)
            order.append((name, first))

        handles.append(child.register_forward_pre_hook(called, with_kwargs=True))
    stack = _ModuleStack(transformer)
    log = _AttentionLog(stack)
    try:
        args, kwargs = call.fresh()
        with torch.no_grad(), log:
            output = transformer(*args, **kwargs)
    finally:
        stack.remove()
        for handle in handles:
            handle.remove()
    attention: dict[str, AttentionCalls] = {}
    for name, queries, keys, square in log.calls:
        entry = attention.setdefault(pattern_of(name), AttentionCalls())
        entry.shapes.add((queries, keys))
        entry.square_mask = entry.square_mask or square
    last = max((i for i, (name, _) in enumerate(order) if name == "<blocks>"), default=-1)
    return Observation(
        first_arguments=first_arguments,
        attention=attention,
        after_blocks=[entry for entry in order[last + 1 :] if entry[0] != "<blocks>"],
        transformer_arguments=named_arguments(transformer, *call.fresh()),
        output=output,
    )
