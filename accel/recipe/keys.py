"""How a recipe key is declared: its default, help line, bounds and command-line spelling, kept in the
field's metadata so that validation, the README reference and the CLI's options all read one place."""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Flag:
    """How a recipe key reads as a command-line option, where that differs from the key: accel's CLI
    builds the option from this and the key's type, default and help (so commands share one spelling)."""

    name: str = ""  # "--guidance"; empty: the key's name with dashes
    alias: str = ""  # a short alias, "-p"
    metavar: str = ""  # the value's placeholder in --help; empty: its type's
    help: str = ""  # a line for --help where the key's own is a paragraph; empty: the key's
    shown: str = ""  # the default --help shows, where not "recipe, else <default>" ({recipe} stands for that)
    switch: Any = None  # the option takes no value and sets the key to this (a bool key: True)
    example: str = ""  # a table key's KEYWORD=VALUE example, for the line refusing a malformed one
    parse: bool = False  # a table key's values read as TOML values (17, true), else as strings


def table(help: str, flag: Flag | None = None) -> Any:
    """A recipe key holding a table (keyword = value); empty by default, read-only once validated."""
    meta: dict[str, Any] = {"help": help}
    if flag is not None:
        meta["flag"] = flag
    return field(default_factory=lambda: types.MappingProxyType({}), hash=False, metadata=meta)


def key(
    default: Any,
    help: str,
    min: int | None = None,
    max: int | None = None,
    prompt: bool = False,
    flag: Flag | None = None,
) -> Any:
    """A recipe key: its default, the help line the README reference is built from, bounds (`max`:
    where a larger number overflows something downstream), `prompt`: a text held to the prompt limit,
    `flag`: how its command-line option differs from the key."""
    meta: dict[str, Any] = {"help": help}
    if flag is not None:
        meta["flag"] = flag
    if min is not None:
        meta["min"] = min
    if max is not None:
        meta["max"] = max
    if prompt:
        meta["prompt"] = True
    return field(default=default, metadata=meta)
