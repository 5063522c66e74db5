"""The recipe: every knob of a run, read from TOML, validated up front.

A recipe is a set of frozen dataclasses, one per TOML section. Validation is generic: each field's
type annotation (plus an optional `min` in its metadata) says what it accepts, so adding a key is
one line and its error message comes for free. Errors are one line naming the source, section and
key, because the user's only recourse is to edit that line.

Here: the Recipe and its loading. The sections are in accel.recipe.sections, how a key is declared in
accel.recipe.keys, the bounds in accel.recipe.limits, validation in accel.recipe.checks, and the
refusals that span sections in accel.recipe.refusals.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from os import PathLike
from typing import Any

from accel.errors import RecipeError
from accel.recipe.checks import check_cache, check_compile, check_sections, check_variants, show, suggest
from accel.recipe.limits import read_capped
from accel.recipe.sections import (
    ACCELERATORS,
    SECTIONS,
    BenchSection,
    BenchVariant,
    CacheSection,
    CompileSection,
    GenerateSection,
    MemorySection,
    ModelSection,
    ParallelSection,
    QuantSection,
    VaeSection,
)

__all__ = ["Recipe", "load_recipe"]


@dataclass(frozen=True)
class Recipe:
    """A whole, validated run configuration. Build it with `from_dict` or `load_recipe`, which validate."""

    model: ModelSection = field(default_factory=ModelSection)
    generate: GenerateSection = field(default_factory=GenerateSection)
    cache: CacheSection = field(default_factory=CacheSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    vae: VaeSection = field(default_factory=VaeSection)
    quant: QuantSection = field(default_factory=QuantSection)
    compile: CompileSection = field(default_factory=CompileSection)
    memory: MemorySection = field(default_factory=MemorySection)
    bench: BenchSection = field(default_factory=BenchSection)
    # Where the recipe came from, for later messages; not part of its identity.
    source: str = field(default="<dict>", compare=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "<dict>") -> Recipe:
        """Validate a parsed recipe; missing sections and keys take their defaults."""
        values = check_sections(source, data, SECTIONS)
        bench = values.pop("bench", {})
        raw_variants = bench.pop("variants", ())
        sections = {name: SECTIONS[name](**values.get(name, {})) for name in SECTIONS if name != "bench"}
        check_cache(source, sections["cache"])
        check_compile(source, sections["compile"])
        variants = check_variants(source, raw_variants)
        return cls(**sections, bench=BenchSection(variants=variants, **bench), source=source)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain, TOML-friendly dict (lists, no None) that `from_dict` turns back into this recipe."""
        return {name: _plain(getattr(self, name)) for name in SECTIONS}

    def with_overrides(self, overrides: Mapping[str, Any], source: str = "command line") -> Recipe:
        """Deep-merge a partial recipe over this one and re-validate; errors name `source`."""
        if not isinstance(overrides, Mapping):
            raise RecipeError(f"{source}: overrides must be a table of sections, got {show(overrides)}")
        merged = Recipe.from_dict(_merge(self.to_dict(), overrides), source)
        return dataclasses.replace(merged, source=self.source)

    def unaccelerated(self) -> Recipe:
        """This recipe with every accelerator off: the baseline `run --compare` measures against."""
        plain = {name: SECTIONS[name]() for name in ACCELERATORS}
        return dataclasses.replace(self, **plain, bench=BenchSection())

    @property
    def variants(self) -> tuple[BenchVariant, ...]:
        """The validated bench variants, in recipe order."""
        return self.bench.variants

    def variant(self, name: str) -> Recipe:
        """The concrete recipe one bench variant runs: this one with its overrides, without variants."""
        for v in self.variants:
            if v.name == name:
                base = dataclasses.replace(self, bench=dataclasses.replace(self.bench, variants=()))
                return base.with_overrides(v.overrides, f"{self.source}: [bench] variant {name!r}")
        names = [v.name for v in self.variants]
        hint = suggest(name, names, repr, "variants") if names else " (the recipe defines none)"
        raise RecipeError(f"{self.source}: [bench] has no variant {name!r}{hint}")

    @property
    def world_size(self) -> int:
        """Number of processes (GPUs) the recipe's parallel layout needs."""
        return self.parallel.world_size


def load_recipe(path: str | PathLike[str]) -> Recipe:
    """Read and validate a TOML recipe, or a JSON one: the same tables as a JSON object, or the
    document `accel run --json` wrote, whose `recipe` is the run's effective recipe (so a run is
    rebuilt from its report). Every failure is a one-line RecipeError naming the file."""
    source = str(path)
    is_json = str(path).lower().endswith(".json")
    language = "JSON" if is_json else "TOML"
    try:
        raw = _read_capped(path, source)
        data = json.loads(raw) if is_json else tomllib.loads(raw.decode("utf-8"))
    except RecipeError:
        raise
    except FileNotFoundError:
        raise RecipeError(f"{source}: no such file") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise RecipeError(f"{source}: not valid {language}: {e}") from None
    except UnicodeDecodeError:
        raise RecipeError(f"{source}: not valid {language}: not UTF-8 text") from None
    except OSError as e:
        raise RecipeError(f"{source}: cannot read: {e.strerror}") from None
    except (ValueError, RecursionError) as e:  # a number of more than 4300 digits, tables nested thousands deep
        raise RecipeError(
            f"{source}: not valid {language}: {str(e).splitlines()[0][:120] or type(e).__name__}"
        ) from None
    if is_json and isinstance(data, Mapping) and isinstance(data.get("recipe"), Mapping):
        data = data["recipe"]  # an `accel run --json` report (no recipe has a [recipe] section): its effective recipe
    return Recipe.from_dict(data, source)


def _read_capped(path: str | PathLike[str], source: str) -> bytes:
    """The recipe's bytes, at most MAX_RECIPE_BYTES of them. A device is refused unread (a pipe is read)."""
    if stat.S_ISCHR(mode := os.stat(path).st_mode) or stat.S_ISBLK(mode):
        raise RecipeError(f"{source}: a device, not a recipe file; pass a .toml recipe or an accel run --json report")
    return read_capped(path, source, "a recipe is a few kilobytes, pass a .toml recipe or an accel run --json report")


def _plain(value: Any) -> Any:
    """Sections, variants, tuples and read-only mappings back to the dicts and lists TOML writes (no None)."""
    if isinstance(value, BenchVariant):
        return {"name": value.name, **_plain(value.overrides)}
    if dataclasses.is_dataclass(value):
        # An empty table is the default, so it is left out as None is.
        return {
            f.name: _plain(v)
            for f in dataclasses.fields(value)
            if (v := getattr(value, f.name)) is not None and not (isinstance(v, Mapping) and not v)
        }
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge: tables merge key by key, anything else (lists included) replaces."""
    out = dict(base)
    for key, value in top.items():
        old = out.get(key)
        out[key] = _merge(old, value) if isinstance(old, Mapping) and isinstance(value, Mapping) else value
    return out
