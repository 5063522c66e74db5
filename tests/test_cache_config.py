"""The cache methods by name (accel/cache/config.py): the registry holds the recipe's methods, the
configs' fields are the [cache] keys, the module loads without torch, and `accel.apply` installs
each method's engine from its config."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields
from typing import Any, get_args, get_type_hints

import pytest

import accel
from accel.cache.blocks import BlockCache
from accel.cache.config import CACHE_METHODS
from accel.cache.fbcache import FirstBlockCache
from accel.cache.magcache import MagCache
from accel.cache.taylorseer import TaylorSeerCache
from accel.recipe.sections import CacheSection
from conftest import FLUX_CALL, generate


def test_the_registry_names_the_recipes_methods_in_its_order() -> None:
    assert list(CACHE_METHODS) == list(get_args(get_type_hints(CacheSection)["method"]))
    assert all(config.name == name for name, config in CACHE_METHODS.items())


def test_every_cache_key_is_some_methods_and_every_config_field_a_cache_key() -> None:
    keys = {f.name for f in fields(CacheSection)} - {"method"}
    assert {f.name for config in CACHE_METHODS.values() for f in fields(config)} == keys


def test_the_config_module_and_the_recipe_load_without_torch() -> None:
    probe = "import sys, accel.cache.config, accel.recipe; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize(
    "settings, engine, installed",
    [
        ({"threshold": 0.1, "warmup_steps": 1}, FirstBlockCache, {"first_blocks": 1, "last_blocks": 0}),
        ({"method": "dbcache", "threshold": 0.1, "first_blocks": 2, "last_blocks": 1}, BlockCache, {"last_blocks": 1}),
        ({"method": "taylorseer", "interval": 4, "taylor_order": 2}, TaylorSeerCache, {"interval": 4}),
        ({"method": "magcache", "threshold": 0.1, "mag_ratios": [[1.0, 0.9]]}, MagCache, {"mag_ratios": [[1.0, 0.9]]}),
    ],
)
def test_apply_installs_each_method_from_its_config(
    tiny_flux: Any, settings: dict[str, Any], engine: type, installed: dict[str, Any]
) -> None:
    handle = accel.apply(tiny_flux, {"cache": settings})
    try:
        assert [type(cache) for cache in handle.caches] == [engine]
        assert all(getattr(handle.caches[0], key) == value for key, value in installed.items())
        generate(tiny_flux, FLUX_CALL)
        assert handle.cache_stats is not None and handle.cache_stats.calls == FLUX_CALL["num_inference_steps"]
    finally:
        handle.remove()
