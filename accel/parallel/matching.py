"""Which modules of a transformer a plan's dotted patterns name ("blocks.*.attn2", "blocks.-1")."""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch


class PlanMismatch(TypeError):
    """The family's plan names something this transformer does not have."""


def glob_modules(modules: dict[str, torch.nn.Module], pattern: str) -> list[torch.nn.Module]:
    """Modules whose dotted name matches `pattern` segment by segment ("blocks.*.attn2": * is one name;
    a negative index counts from the end of its list: "blocks.-1" is the last block)."""
    parts = pattern.split(".")
    return [
        module
        for name, module in modules.items()
        if name and len(name.split(".")) == len(parts) and _name_matches(modules, name.split("."), parts)
    ]


def _name_matches(modules: dict[str, torch.nn.Module], names: list[str], parts: list[str]) -> bool:
    for depth, (name, part) in enumerate(zip(names, parts)):
        if part.startswith("-") and part[1:].isdigit():
            parent = modules.get(".".join(names[:depth]))
            size = len(parent) if isinstance(parent, (torch.nn.ModuleList, torch.nn.Sequential)) else None
            if size is None or not name.isdigit() or int(name) != size + int(part):
                return False
        elif not fnmatchcase(name, part):
            return False
    return True


def matching(
    modules: dict[str, torch.nn.Module], pattern: str, transformer: torch.nn.Module, why: str
) -> list[torch.nn.Module]:
    found = glob_modules(modules, pattern)
    if not found:
        raise PlanMismatch(f"{type(transformer).__name__} has no module {pattern!r} {why}")
    return found
