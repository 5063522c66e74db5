"""Find a transformer's repeated blocks from the model itself, for models no family describes.

A hand-written family states its block lists (`Family.blocks`); the generic path (issue 34) must
find them on a transformer accel was never taught. diffusers says which classes are a model's
repeated blocks in two class attributes: `_repeated_blocks` (set for regional compile) and
`_no_split_modules` (set for device maps). The lists are the `nn.ModuleList`s whose items are of
those classes. Where no list holds a declared class (PRX and Allegro declare none; HiDream's lists
hold wrappers of the classes it declares), the model is read by its structure: a list of at least
two modules of one class, each holding an attention, is a list of transformer blocks.

What a block returns comes from diffusers' block registry (the metadata its cache hooks use: which
output is the hidden states, which the encoder states) where it has an entry that agrees with the
block's forward; otherwise the result says so, and a later step learns it by probing one block call.

The order is the order the transformer runs the lists. It is read from the forward's source (the
order in which it first names each list) without running anything; where that cannot tell (a list
run from a helper method, or nested lists under one child), the result says so and
`order_by_call` learns it from one forward with hooks.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal

from torch import nn
from torch.utils.hooks import RemovableHandle

from accel.errors import UserError
from accel.models.base import BlockList

FoundBy = Literal["_repeated_blocks", "_no_split_modules", "structure"]
# Where the order of the lists comes from: the forward's source (first mention of each list), the
# order the modules were defined in (not known to be the run order), or one forward that was run.
OrderFrom = Literal["forward source", "definition", "call"]


@dataclass(frozen=True)
class FoundList:
    """One list of repeated blocks found on a transformer.

    `attr` is its path under the transformer (dotted where nested), `block_class` the class of its
    items, `count` how many there are, `found_by` what named them as blocks. `returns` names what a
    block's forward returns, in order, as `BlockList.returns` does (one name: a bare tensor), read
    from diffusers' block registry; None where it is not known, with `unknown` saying why (the next
    step probes a block call for it).
    """

    attr: str
    block_class: str
    count: int
    found_by: FoundBy
    returns: tuple[str, ...] | None
    unknown: str = ""

    def block_list(self) -> BlockList | None:
        """The BlockList a family would declare for this list (None: what a block returns is not known)."""
        return BlockList(self.attr, returns=self.returns) if self.returns is not None else None


@dataclass(frozen=True)
class Discovery:
    """Every list of repeated blocks found on one transformer, in the order it runs them (`order`
    says how that order is known)."""

    transformer_class: str
    lists: tuple[FoundList, ...]
    order: OrderFrom

    @property
    def attrs(self) -> tuple[str, ...]:
        return tuple(found.attr for found in self.lists)

    def block_lists(self) -> tuple[BlockList, ...] | None:
        """The lists as a family's `blocks`, or None while any list's returns are unknown."""
        lists = tuple(found.block_list() for found in self.lists)
        return None if any(block is None for block in lists) else tuple(block for block in lists if block is not None)

    def ordered(self, attrs: tuple[str, ...]) -> Discovery:
        """The same lists in the run order `attrs` (from `order_by_call`); lists the call did not run go last."""
        rank = {attr: index for index, attr in enumerate(attrs)}
        lists = sorted(self.lists, key=lambda found: rank.get(found.attr, len(rank)))
        return replace(self, lists=tuple(lists), order="call")


def _class_names(obj: object) -> set[str]:
    return {cls.__name__ for cls in type(obj).__mro__}


def _declared(transformer: nn.Module) -> dict[str, FoundBy]:
    """The block class names the transformer's class declares, and which attribute declares each
    (`_repeated_blocks` first: it names exactly the blocks; `_no_split_modules` also names embedders)."""
    declared: dict[str, FoundBy] = {}
    attributes: tuple[FoundBy, ...] = ("_repeated_blocks", "_no_split_modules")
    for attribute in attributes:
        for name in getattr(transformer, attribute, None) or ():
            declared.setdefault(name, attribute)
    return declared


def _lists(
    module: nn.Module, found_by: Callable[[nn.ModuleList], FoundBy | None], prefix: str = ""
) -> Iterator[FoundList]:
    """Every non-empty ModuleList under `module` that `found_by` names as blocks, with its dotted
    path, in definition order. A found list's items are not searched (blocks hold lists of their
    own); everything else is, so lists nested in stages or wrappers are found too."""
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if isinstance(child, nn.ModuleList) and len(child) and (by := found_by(child)) is not None:
            returns, unknown = _returns(child[0])
            yield FoundList(path, type(child[0]).__name__, len(child), by, returns, unknown)
        else:
            yield from _lists(child, found_by, f"{path}.")


def _has_attention(block: nn.Module) -> bool:
    return any(any("Attention" in name for name in _class_names(sub)) for sub in block.modules() if sub is not block)


def _by_structure(items: nn.ModuleList) -> FoundBy | None:
    """ "structure" for a list of transformer blocks by structure alone: two or more of one class
    (not a torch layer), each with an attention; None for any other list."""
    one_class = len({type(item) for item in items}) == 1 and not type(items[0]).__module__.startswith("torch.")
    return "structure" if len(items) >= 2 and one_class and _has_attention(items[0]) else None


def _registry_entry(block: nn.Module) -> Any | None:
    """diffusers' TransformerBlockRegistry entry for the block's class or a base of it (None: none).
    The registry is private to diffusers, so a diffusers without it gives None (the block is probed)."""
    try:
        from diffusers.hooks._helpers import TransformerBlockRegistry
    except ImportError:
        return None
    for cls in type(block).__mro__:
        try:
            return TransformerBlockRegistry.get(cls)
        except ValueError:
            continue
    return None


def _returns(block: nn.Module) -> tuple[tuple[str, ...] | None, str]:
    """What the block returns, from diffusers' registry: (names, "") or (None, why not known)."""
    name = type(block).__name__
    entry = _registry_entry(block)
    if entry is None:
        return None, f"diffusers' block registry has no entry for {name}"
    slots: dict[int, str] = {}
    if entry.return_hidden_states_index is not None:
        slots[entry.return_hidden_states_index] = entry.hidden_states_argument_name
    if entry.return_encoder_hidden_states_index is not None:
        slots[entry.return_encoder_hidden_states_index] = entry.encoder_hidden_states_argument_name
    if not slots or sorted(slots) != list(range(len(slots))):
        return None, f"diffusers' block registry leaves outputs of {name} unnamed"
    names = tuple(slots[index] for index in range(len(slots)))
    parameters = inspect.signature(type(block).forward).parameters
    missing = [arg for arg in names if arg not in parameters]
    if missing:
        # A skipped block passes its inputs through by name: a name the forward does not take is no use.
        return (
            None,
            f"diffusers' block registry names {', '.join(repr(arg) for arg in missing)}, which {name}.forward does "
            "not take",
        )
    return names, ""


def _forward_source(transformer: nn.Module) -> str:
    try:
        return inspect.getsource(type(transformer).forward)
    except (OSError, TypeError):
        return ""


def _source_order(transformer: nn.Module, attrs: list[str]) -> list[str] | None:
    """`attrs` in the order the forward's source first names them (by their first path segment),
    or None where that does not tell: a list not named there, or two lists under one child."""
    heads = [attr.split(".")[0] for attr in attrs]
    if len(set(heads)) != len(heads):
        return None
    source = _forward_source(transformer)
    first: dict[str, int] = {}
    for match in re.finditer(r"\bself\.(\w+)", source):
        first.setdefault(match.group(1), match.start())
    if any(head not in first for head in heads):
        return None
    return sorted(attrs, key=lambda attr: first[attr.split(".")[0]])


def discover_blocks(transformer: nn.Module) -> Discovery:
    """The transformer's lists of repeated blocks, in the order it runs them.

    Lists of the classes its `_repeated_blocks` / `_no_split_modules` declare; where it declares
    none held in a list, lists that look like transformer blocks (see `_by_structure`). A
    transformer with neither is refused with a UserError naming its class and what was looked for.
    """
    declared = _declared(transformer)

    def declared_class(items: nn.ModuleList) -> FoundBy | None:
        """What declares the items' class (None: nothing does); `_repeated_blocks` before `_no_split_modules`."""
        return next((by for name, by in declared.items() if all(name in _class_names(item) for item in items)), None)

    found = list(_lists(transformer, declared_class)) or list(_lists(transformer, _by_structure))
    if not found:
        looked = (
            f"no module list of its declared blocks ({', '.join(declared)})"
            if declared
            else "no _repeated_blocks or _no_split_modules"
        )
        raise UserError(
            f"{type(transformer).__name__} has no repeated blocks: {looked}, and no module list of two or more "
            "blocks of one class holding an attention"
        )
    by_attr = {item.attr: item for item in found}
    order = _source_order(transformer, list(by_attr))
    if order is None:
        return Discovery(type(transformer).__name__, tuple(found), "definition")
    return Discovery(type(transformer).__name__, tuple(by_attr[attr] for attr in order), "forward source")


def order_by_call(transformer: nn.Module, call: Callable[[], Any]) -> tuple[str, ...]:
    """The block lists in the order `call` (one forward of the transformer) runs them: a forward
    pre-hook on every found block records the first run of each list. Lists the call did not run
    are left out. For a transformer whose `discover_blocks` order is "definition"."""
    discovery = discover_blocks(transformer)
    ran: list[str] = []
    handles: list[RemovableHandle] = []

    def hook_for(attr: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if attr not in ran:
                ran.append(attr)

        return hook

    try:
        for found in discovery.lists:
            for block in transformer.get_submodule(found.attr):
                handles.append(block.register_forward_pre_hook(hook_for(found.attr)))
        call()
    finally:
        for handle in handles:
            handle.remove()
    return tuple(ran)
