"""Validation: every section's keys checked against its dataclass' annotations and metadata, values
normalized (int -> float, list -> tuple, tables read-only), and each refusal one line naming the
source, section and key, with a near miss suggested."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from accel.cache.config import cache_refusal
from accel.errors import RecipeError
from accel.recipe.limits import FLOAT32_MAX, PROMPT_CHARS_ENV, prompt_chars
from accel.recipe.sections import SECTIONS, BenchVariant, CacheSection, CompileSection


def check_cache(source: str, cache: CacheSection) -> None:
    """[cache] as its method reads it: the method configs' fields say which keys each method reads."""
    refusal = cache_refusal(cache)
    if refusal is not None:
        raise RecipeError(f"{source}: {refusal}")


def check_compile(source: str, compile: CompileSection) -> None:
    """A mode tunes inductor's kernels: with another backend there are none to tune."""
    if compile.mode != "default" and compile.backend != "inductor":
        raise RecipeError(
            f"{source}: [compile] mode = '{compile.mode}' tunes inductor's kernels, and backend = "
            f"'{compile.backend}' makes none; set mode = 'default' or backend = 'inductor'"
        )


def check_sections(
    source: str, data: Any, allowed: Mapping[str, type], nullable: bool = True
) -> dict[str, dict[str, Any]]:
    """Validate every section present in `data`; returns the normalized values given, per section.

    `nullable` lets optional keys be None ("the family's default"); variants forbid it, being TOML data.
    """
    if not isinstance(data, Mapping):
        raise RecipeError(f"{source}: a recipe must be a table of sections, got {show(data)}")
    out: dict[str, dict[str, Any]] = {}
    for name, raw in data.items():
        if name not in allowed:
            raise RecipeError(f"{source}: {_unknown_section(name, raw, allowed)}")
        out[name] = _check_section(source, name, SECTIONS[name], raw, nullable)
    return out


def _unknown_section(name: Any, raw: Any, allowed: Mapping[str, type]) -> str:
    """Explain an unknown top-level name; a stray key (`steps = 4` above any header) gets its section."""
    if not isinstance(raw, Mapping):
        homes = [s for s, cls in allowed.items() if name in _hints(cls)]
        if homes:
            where = " or ".join(f"[{s}] {name}" for s in homes)
            return f"key {name!r} is not in a section (did you mean {where}?)"
    return f"unknown section [{_name(name)}]{suggest(name, allowed, lambda s: f'[{s}]', 'sections')}"


def _check_section(source: str, name: str, cls: type, raw: Any, nullable: bool) -> dict[str, Any]:
    """Validate one section's keys against the dataclass' annotations; returns normalized values."""
    if not isinstance(raw, Mapping):
        raise RecipeError(f"{source}: [{name}] must be a table, got {show(raw)}")
    hints = _hints(cls)
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in hints:
            raise RecipeError(f"{source}: unknown key [{name}] {_name(key)}{suggest(key, hints, repr, 'keys')}")
        hint, meta = hints[key]
        if hint == tuple[BenchVariant, ...]:  # needs the whole recipe's section list: Recipe.from_dict does it
            out[key] = value
            continue
        ok, out[key] = _coerce(hint, meta, value)
        if not ok or (value is None and not nullable):
            raise RecipeError(f"{source}: [{name}] {key} must be {_refusal(hint, meta, value)}")
    return out


def check_variants(source: str, raw: Any) -> tuple[BenchVariant, ...]:
    """Validate [bench] variants: uniquely named tables overriding any section but [bench]."""
    if not isinstance(raw, list | tuple):
        raise RecipeError(f"{source}: [bench] variants must be a list of tables, got {show(raw)}")
    others = {name: cls for name, cls in SECTIONS.items() if name != "bench"}
    variants: list[BenchVariant] = []
    for i, item in enumerate(raw, 1):
        if not isinstance(item, Mapping):
            raise RecipeError(f"{source}: [bench] variant #{i} must be a table, got {show(item)}")
        if "name" not in item:
            raise RecipeError(f'{source}: [bench] variant #{i} has no name (add name = "...")')
        name = item["name"]
        if not isinstance(name, str) or not name:
            raise RecipeError(f"{source}: [bench] variant #{i} name must be a non-empty string, got {show(name)}")
        if any(v.name == name for v in variants):
            raise RecipeError(f"{source}: [bench] variant name {name!r} is used twice (names must be unique)")
        where = f"{source}: [bench] variant {name!r}"
        body = {k: v for k, v in item.items() if k != "name"}
        if "bench" in body:
            raise RecipeError(f"{where}: cannot contain [bench] (variants share the recipe's repeats and warmup)")
        values = check_sections(where, body, others, nullable=False)
        frozen = types.MappingProxyType({s: types.MappingProxyType(v) for s, v in values.items()})
        variants.append(BenchVariant(name, frozen))
    return tuple(variants)


@functools.cache
def _hints(cls: type) -> dict[str, tuple[Any, Mapping[str, Any]]]:
    """Field name -> (resolved annotation, metadata), in declaration order."""
    types_ = get_type_hints(cls)
    return {f.name: (types_[f.name], f.metadata) for f in dataclasses.fields(cls)}


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    """`X | None` -> (X, True); anything else -> (hint, False)."""
    if get_origin(hint) in (Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        return args[0], len(args) < len(get_args(hint))
    return hint, False


def _coerce(hint: Any, meta: Mapping[str, Any], value: Any) -> tuple[bool, Any]:
    """Whether `value` fits the annotation, and its normalized form (int -> float, list -> tuple).

    Strict on purpose: TOML `true` is not 1, and 1 is not `true`, so a typo cannot flip a switch.
    """
    hint, optional = _unwrap_optional(hint)
    low = meta.get("min")
    if value is None:
        return optional, None
    if hint is bool:
        return type(value) is bool, value
    high = meta.get("max")
    if hint is int:
        return type(value) is int and (low is None or value >= low) and (high is None or value <= high), value
    if hint is float:
        number = (
            type(value) in (int, float)
            and math.isfinite(value)
            and abs(value) <= FLOAT32_MAX
            and (low is None or value >= low)
        )
        return number, float(value) if number else value
    if hint is str:
        return isinstance(value, str) and (not meta.get("prompt") or len(value) <= prompt_chars()), value
    if get_origin(hint) is Literal:
        return any(type(value) is type(c) and value == c for c in get_args(hint)), value
    if hint == tuple[tuple[float, ...], ...]:
        ok = isinstance(value, list | tuple) and all(
            isinstance(row, list | tuple) and all(type(v) in (int, float) and math.isfinite(v) and v > 0 for v in row)
            for row in value
        )
        return ok, tuple(tuple(float(v) for v in row) for row in value) if ok else value
    if hint == tuple[str, ...]:
        ok = isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)
        return ok, tuple(value) if ok else value
    if hint == Mapping[str, str]:
        ok = isinstance(value, Mapping) and all(
            isinstance(k, str) and k.isidentifier() and isinstance(v, str) for k, v in value.items()
        )
        return ok, types.MappingProxyType(dict(value)) if ok else value
    if hint == Mapping[str, Any]:
        ok = isinstance(value, Mapping) and all(
            isinstance(k, str) and k.isidentifier() and _argument_value(v) for k, v in value.items()
        )
        frozen = {k: tuple(v) if isinstance(v, list | tuple) else v for k, v in value.items()} if ok else value
        return ok, types.MappingProxyType(frozen) if ok else value
    raise TypeError(f"no validator for annotation {hint!r}")  # a programming error, not a user one


def _refusal(hint: Any, meta: Mapping[str, Any], value: Any) -> str:
    """'<requirement>, got <value>': the bound a value passed where it passed one of those that keep
    numbers from overflowing and prompts from swamping the tokenizer."""
    if meta.get("prompt") and isinstance(value, str):
        return (
            f"a string of at most {prompt_chars():,} characters ({PROMPT_CHARS_ENV} raises the limit), got "
            f"{len(value):,} characters"
        )
    if type(value) is int and "max" in meta and value > meta["max"]:
        return f"an integer from {meta.get('min', 0)} to {meta['max']}, got {show(value)}"
    shown = show(value)
    if type(value) is float and math.isfinite(value) and abs(value) > FLOAT32_MAX:
        shown += f" (past float32's range, {FLOAT32_MAX:.1e}, which pipelines compute in)"
    return f"{_requirement(hint, meta)}, got {shown}"


def _argument_value(value: Any) -> bool:
    """A call argument a recipe can state: a finite number, a string, a boolean, or a list of them."""
    if isinstance(value, list | tuple):
        return all(_argument_value(v) and not isinstance(v, list | tuple) for v in value)
    return isinstance(value, bool | int | str) or (isinstance(value, float) and math.isfinite(value))


def _requirement(hint: Any, meta: Mapping[str, Any]) -> str:
    """What a key accepts, in words, for 'must be ...' messages."""
    hint, _ = _unwrap_optional(hint)
    bound = f" >= {meta['min']}" if "min" in meta else ""
    if hint is bool:
        return "true or false"
    if hint is int:
        return f"an integer{bound}"
    if hint is float:
        return f"a number{bound}"
    if hint is str:
        return "a string"
    if get_origin(hint) is Literal:
        choices = [str(c) for c in get_args(hint)]
        return " or ".join(choices) if len(choices) == 2 else f"one of {', '.join(choices)}"
    if hint == Mapping[str, str]:
        return 'a table of keyword = "file path"'
    if hint == Mapping[str, Any]:
        return "a table of keyword = value (numbers, strings, booleans or lists of them)"
    if hint == tuple[tuple[float, ...], ...]:
        return "a list of lists of positive numbers"
    return "a list of strings"


# --- formatting helpers -----------------------------------------------------------------------


def suggest(word: Any, choices: Iterable[str], fmt: Callable[[str], str], kind: str) -> str:
    """' (did you mean X?)' for a near miss, else the valid names, so the user never has to guess."""
    choices = list(choices)
    close = difflib.get_close_matches(str(word), choices, n=1)
    return f" (did you mean {fmt(close[0])}?)" if close else f" (valid {kind}: {', '.join(choices)})"


def _name(key: Any) -> str:
    """A user-written name, quoted only when printing it raw could break the one-line message."""
    return key if isinstance(key, str) and key.isprintable() and key else repr(key)


def show(value: Any) -> str:
    """A value as the user wrote it in TOML terms (true, not True), on one short line."""
    text = ("true" if value else "false") if isinstance(value, bool) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
