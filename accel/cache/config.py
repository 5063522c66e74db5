"""The cache methods by name: one frozen config per method, whose fields are the [cache] keys it
reads, named as its engine's keywords, and the registry `method name -> config`.

Torch-free: the recipe checks [cache] against these fields before torch loads (a key the chosen
method does not read is refused, not ignored), and a config's engine (the `StepCache` that installs
the method on a transformer) is imported only when a cache is built. A new method is its engine
module and a config here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from importlib import import_module
from typing import TYPE_CHECKING, Any, ClassVar, Self

from accel.models.parts import blocks_of

if TYPE_CHECKING:
    from accel.cache.calls import StepCache
    from accel.models.base import BlockList
    from accel.recipe.sections import CacheSection

# Field metadata of a key a method reads only while another key holds a value: (key, value).
ONLY_WITH = "only_with"


@dataclass(frozen=True)
class CacheConfig:
    """One method's keys of [cache]."""

    name: ClassVar[str]  # the recipe's `method`
    engine: ClassVar[str]  # "module:Class" of the StepCache that installs the method

    @classmethod
    def from_settings(cls, settings: CacheSection) -> Self:
        """The method's keys out of the recipe's [cache]."""
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})

    def keywords(self) -> dict[str, Any]:
        """The engine's keyword arguments: each field is named as the engine's keyword."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def engine_class(self) -> type[StepCache[Any]]:
        module, _, name = self.engine.partition(":")
        engine: type[StepCache[Any]] = getattr(import_module(module), name)
        return engine

    def refusal(self) -> str | None:
        """Why these settings cannot run (None: they can), past what each key's type and bounds allow."""
        return None

    def block_refusal(self, transformer: Any, block_lists: Sequence[BlockList]) -> str | None:
        """Why `transformer`'s blocks cannot take this method (None: they can)."""
        return None


@dataclass(frozen=True)
class DecidingConfig(CacheConfig):
    """What every method that decides from a threshold reads: the threshold and the limits."""

    threshold: float
    warmup_steps: int
    max_consecutive_cached: int
    max_cached_steps: int


@dataclass(frozen=True)
class BlockCacheConfig(DecidingConfig):
    """A block cache: head blocks decide, the middle is skipped and stood in for by the calibrator."""

    calibrator: str
    taylor_order: int = field(metadata={ONLY_WITH: ("calibrator", "taylorseer")})

    def block_refusal(self, transformer: Any, block_lists: Sequence[BlockList]) -> str | None:
        count = len(blocks_of(transformer, block_lists))
        if count < 2:
            return (
                f"[cache] method = '{self.name}': {type(transformer).__name__} has {count} block, and the block cache "
                "needs one to decide and one to cache; use method = 'taylorseer' or 'magcache', or turn the cache off"
            )
        return None


@dataclass(frozen=True)
class FBCacheConfig(BlockCacheConfig):
    """First Block Cache: block 0 decides, every later block is cached."""

    name = "fbcache"
    engine = "accel.cache.fbcache:FirstBlockCache"


@dataclass(frozen=True)
class DBCacheConfig(BlockCacheConfig):
    """DBCache: the first `first_blocks` decide, the last `last_blocks` always run."""

    name = "dbcache"
    engine = "accel.cache.blocks:BlockCache"
    first_blocks: int
    last_blocks: int

    def block_refusal(self, transformer: Any, block_lists: Sequence[BlockList]) -> str | None:
        if (refusal := super().block_refusal(transformer, block_lists)) is not None:
            return refusal
        count = len(blocks_of(transformer, block_lists))
        if self.first_blocks + self.last_blocks >= count:
            return (
                f"[cache] first_blocks ({self.first_blocks}) + last_blocks ({self.last_blocks}) leave none of "
                f"{type(transformer).__name__}'s {count} blocks to cache; make their sum at most {count - 1}"
            )
        return None


@dataclass(frozen=True)
class TaylorSeerConfig(CacheConfig):
    """TaylorSeer inside the blocks: computed every `interval` steps, extrapolated between."""

    name = "taylorseer"
    engine = "accel.cache.taylorseer:TaylorSeerCache"
    interval: int
    taylor_order: int
    disable_before: int
    disable_after: int
    interval_offset: int
    extrapolate_early: bool

    def refusal(self) -> str | None:
        if self.interval_offset >= self.interval:
            return (
                f"[cache] interval_offset ({self.interval_offset}) must be below interval ({self.interval}); "
                "an offset of a whole interval or more is the same schedule as interval_offset = "
                f"{self.interval_offset % self.interval}"
            )
        if self.disable_after and self.disable_after <= self.disable_before:
            return (
                f"[cache] disable_after ({self.disable_after}) must be above disable_before "
                f"({self.disable_before}), or 0 for none"
            )
        return None


@dataclass(frozen=True)
class MagCacheConfig(DecidingConfig):
    """MagCache: whole calls skipped along the calibrated residual-magnitude curve."""

    name = "magcache"
    engine = "accel.cache.magcache:MagCache"
    mag_ratios: tuple[tuple[float, ...], ...]

    def refusal(self) -> str | None:
        if self.threshold > 0 and not any(self.mag_ratios):
            return (
                '[cache] method = "magcache" needs mag_ratios, the per-step residual-magnitude ratios of this '
                "pipeline; measure them with accel tune RECIPE --calibrate"
            )
        return None


CACHE_METHODS: dict[str, type[CacheConfig]] = {
    config.name: config for config in (FBCacheConfig, DBCacheConfig, TaylorSeerConfig, MagCacheConfig)
}


def cache_refusal(settings: CacheSection) -> str | None:
    """Why the recipe's [cache] cannot run (None: it can). A key set away from its default that the
    chosen method does not read is refused, not ignored: first the keys only other methods read,
    then those another key turns on (a block cache's taylor_order, with calibrator = "taylorseer");
    then the method's own checks."""
    method, defaults = settings.method, type(settings)()
    changed = [f.name for f in fields(settings) if getattr(settings, f.name) != getattr(defaults, f.name)]
    readers = {key: _readers(key) for key in changed if key != "method"}
    for key, (always, conditions) in readers.items():
        if always and not conditions and method not in always:
            return (
                f'[cache] {key} is for method = {_either(always)}, not "{method}"; set method = "{always[0]}" or '
                f"remove {key}"
            )
    for key, (always, conditions) in readers.items():
        turned_on = any(method in methods and getattr(settings, k) == v for (k, v), methods in conditions.items())
        if conditions and method not in always and not turned_on:
            named = [f"method = {_either(always)}"] if always else []
            named += [f'{k} = "{v}"' for k, v in conditions]
            return f"[cache] {key} is for {' or '.join(named)}; set one of them or remove {key}"
    return CACHE_METHODS[method].from_settings(settings).refusal()


def _readers(key: str) -> tuple[list[str], dict[tuple[str, Any], list[str]]]:
    """The methods that read `key` always, and those that read it only while another key holds a value."""
    always: list[str] = []
    conditions: dict[tuple[str, Any], list[str]] = {}
    for name, config in CACHE_METHODS.items():
        for f in fields(config):
            if f.name == key:
                if ONLY_WITH in f.metadata:
                    conditions.setdefault(f.metadata[ONLY_WITH], []).append(name)
                else:
                    always.append(name)
    return always, conditions


def _either(methods: list[str]) -> str:
    quoted = [f'"{m}"' for m in methods]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
