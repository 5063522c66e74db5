"""Recipe loading and validation: the user's only interface, so every message is pinned exactly."""

from __future__ import annotations

import dataclasses
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from accel.errors import RecipeError
from accel.recipe import Recipe, load_recipe
from accel.recipe.sections import SECTIONS, BenchSection, CacheSection, ParallelSection, QuantSection, BenchVariant

FULL: dict[str, Any] = {
    "model": {
        "name": "flux",
        "dtype": "bfloat16",
        "device": "cuda",
        "pipeline": "FluxKontextPipeline",
        "lora": ["style.safetensors@0.8"],
    },
    "generate": {
        "prompt": "a fox",
        "negative_prompt": "blurry",
        "steps": 20,
        "height": 512,
        "width": 768,
        "frames": 9,
        "guidance_scale": 3.5,
        "true_cfg_scale": 1.5,
        "image": "in.png",
        "mask": "mask.png",
        "seed": 7,
        "conditions": ["first.png", "end.png@-1:0.8"],
        "inputs": {"pose_video": "pose.mp4"},
        "arguments": {"mode": "replace", "sizes": [1, 2]},
    },
    "cache": {
        "threshold": 0.12,
        "method": "dbcache",
        "first_blocks": 4,
        "last_blocks": 2,
        "calibrator": "taylorseer",
        "taylor_order": 2,
        "interval": 3,
        "disable_before": 0,
        "disable_after": 0,
        "interval_offset": 0,
        "extrapolate_early": False,
        "mag_ratios": [],
        "warmup_steps": 2,
        "max_consecutive_cached": 3,
        "max_cached_steps": 10,
    },
    "parallel": {"gpus": 16, "ulysses": 2, "ring": 2, "cfg": 2, "tp": 2, "timeout": 120.0, "plan": "automatic"},
    "vae": {"parallel": True, "tiling": True, "all_ranks": True},
    "quant": {"type": "fp8dq", "scope": "transformer", "exclude": ["*.proj_out", "norm*"]},
    "compile": {"enabled": True, "mode": "max-autotune", "scope": "transformer", "backend": "inductor"},
    "memory": {"text_encoder": "rank0", "vae": "replicated", "offload": "none"},
    "bench": {
        "variants": [
            {"name": "cache", "cache": {"threshold": 0.08}},
            {"name": "int8", "quant": {"type": "int8wo", "exclude": []}, "generate": {"steps": 8}},
        ],
        "repeats": 5,
        "warmup": 2,
    },
}


def dump_toml(data: dict[str, Any]) -> str:
    """Minimal TOML writer for `to_dict` output (no writer in the stdlib); JSON scalars are valid TOML."""

    def inline(value: Any) -> str:
        if isinstance(value, dict):
            return "{" + ", ".join(f"{k} = {inline(v)}" for k, v in value.items()) + "}"
        if isinstance(value, list):
            return "[" + ", ".join(inline(v) for v in value) + "]"
        return json.dumps(value)

    lines: list[str] = []
    for section, values in data.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {inline(v)}" for k, v in values.items() if k != "variants"]
        for variant in values.get("variants", []):
            lines.append(f"[[{section}.variants]]")
            lines += [f"{k} = {inline(v)}" for k, v in variant.items()]
    return "\n".join(lines) + "\n"


def raises(message: str) -> Any:
    """pytest.raises matching the whole message, not a prefix of it."""
    return pytest.raises(RecipeError, match=f"^{re.escape(message)}$")


# --- defaults, round trips ----------------------------------------------------------------------


def test_defaults() -> None:
    r = Recipe.from_dict({})
    assert r == Recipe()
    assert r.source == "<dict>"
    assert (r.model.name, r.model.dtype, r.model.device) == ("", "auto", "auto")
    assert r.generate.steps is None and r.generate.prompt is None and r.generate.seed == 0
    assert (r.cache.threshold, r.cache.warmup_steps, r.cache.max_consecutive_cached) == (0.0, 0, 0)
    assert (r.parallel.ulysses, r.parallel.ring, r.parallel.cfg, r.world_size) == (1, 1, 1, 1)
    assert (r.vae.parallel, r.vae.tiling) == (False, False)
    assert (r.quant.type, r.quant.scope, r.quant.exclude) == ("none", "blocks", ())
    assert (r.compile.enabled, r.compile.mode, r.compile.scope) == (False, "default", "blocks")
    assert (r.bench.variants, r.bench.repeats, r.bench.warmup) == ((), 3, 1)
    assert r.variants == ()


def test_missing_keys_take_defaults_per_key() -> None:
    r = Recipe.from_dict({"cache": {"warmup_steps": 4}})
    assert r.cache == CacheSection(threshold=0.0, warmup_steps=4, max_consecutive_cached=0)


def test_full_values_and_normalization() -> None:
    r = Recipe.from_dict(FULL)
    assert r.generate.height == 512 and r.generate.guidance_scale == 3.5
    assert r.quant.exclude == ("*.proj_out", "norm*")  # lists become tuples: the recipe is frozen
    assert r.compile.mode == "max-autotune"
    assert [v.name for v in r.variants] == ["cache", "int8"]


def test_ints_are_accepted_for_floats_and_stored_as_floats() -> None:
    r = Recipe.from_dict({"cache": {"threshold": 1}, "generate": {"true_cfg_scale": 4}})
    assert r.cache.threshold == 1.0 and type(r.cache.threshold) is float
    assert type(r.generate.true_cfg_scale) is float


def test_to_dict_round_trips_and_is_toml_friendly() -> None:
    r = Recipe.from_dict(FULL)
    d = r.to_dict()
    assert d == FULL
    assert Recipe.from_dict(d) == r
    default = Recipe().to_dict()
    assert default["generate"] == {"seed": 0}  # None values are omitted: TOML has no null
    assert default["quant"]["exclude"] == [] and default["bench"]["variants"] == []
    assert list(default) == list(SECTIONS)


def test_toml_file_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "recipe.toml"
    path.write_text(dump_toml(Recipe.from_dict(FULL).to_dict()))
    r = load_recipe(path)
    assert r == Recipe.from_dict(FULL)
    assert r.source == str(path)


def test_json_recipe_and_run_report_load(tmp_path: Path) -> None:
    """A .json recipe holds the tables, or is an `accel run --json` report whose `recipe` is the run's."""
    tables, report = tmp_path / "recipe.json", tmp_path / "run.json"
    tables.write_text(json.dumps(Recipe.from_dict(FULL).to_dict()))
    report.write_text(json.dumps({"model": "tiny-flux", "steps": 2, "recipe": Recipe.from_dict(FULL).to_dict()}))
    assert load_recipe(tables) == Recipe.from_dict(FULL) == load_recipe(report)
    assert load_recipe(report).source == str(report)
    tables.write_text('{"cache": {"threshold": }}')
    with pytest.raises(json.JSONDecodeError) as parsed:
        json.loads(tables.read_text())
    with raises(f"{tables}: not valid JSON: {parsed.value}"):
        load_recipe(tables)
    tables.write_text("[1, 2]")
    with raises(f"{tables}: a recipe must be a table of sections, got [1, 2]"):
        load_recipe(tables)


def test_hand_written_toml(tmp_path: Path) -> None:
    path = tmp_path / "r.toml"
    path.write_text(
        '[model]\nname = "tiny-flux"\n\n[cache]\nthreshold = 0.2\n\n[parallel]\nulysses = 2\n\n'
        '[bench]\nrepeats = 2\n\n[[bench.variants]]\nname = "off"\ncache.threshold = 0\n\n'
        '[[bench.variants]]\nname = "tiled"\nvae = {tiling = true}\n'
    )
    r = load_recipe(str(path))
    assert r.model.name == "tiny-flux" and r.cache.threshold == 0.2 and r.world_size == 2
    off, tiled = BenchVariant("off", {"cache": {"threshold": 0.0}}), BenchVariant("tiled", {"vae": {"tiling": True}})
    assert r.variants == (off, tiled)
    assert r.bench.repeats == 2


def test_world_size() -> None:
    assert ParallelSection(ulysses=2, ring=3, cfg=2).world_size == 12
    assert Recipe.from_dict({"parallel": {"ring": 4, "cfg": 2}}).world_size == 8
    assert Recipe.from_dict({"parallel": {"gpus": 3}}).world_size == 3


def test_recipe_is_frozen() -> None:
    r = Recipe.from_dict(FULL)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.cache.threshold = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        r.variants[0].overrides["cache"]["threshold"] = 1.0  # type: ignore[index]


def test_every_key_has_help() -> None:
    assert list(SECTIONS) == [f.name for f in dataclasses.fields(Recipe) if f.name != "source"]
    for cls in SECTIONS.values():
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help"


# --- overrides and variants ---------------------------------------------------------------------


def test_with_overrides_deep_merges() -> None:
    base = Recipe.from_dict(FULL, source="r.toml")
    r = base.with_overrides({"cache": {"threshold": 0.3}, "parallel": {"cfg": 1, "gpus": 0}})
    assert r.cache == CacheSection(
        threshold=0.3,
        method="dbcache",
        first_blocks=4,
        last_blocks=2,
        calibrator="taylorseer",
        taylor_order=2,
        warmup_steps=2,
        max_consecutive_cached=3,
        max_cached_steps=10,
    )
    assert r.parallel.world_size == 8  # ulysses 2 × ring 2 × tp 2
    assert r.model == base.model and r.variants == base.variants
    assert r.source == "r.toml"
    assert base.cache.threshold == 0.12  # the original is untouched


def test_with_overrides_replaces_lists_and_none_resets_to_family_default() -> None:
    base = Recipe.from_dict(FULL)
    r = base.with_overrides({"quant": {"exclude": ["x"]}, "generate": {"steps": None}})
    assert r.quant == QuantSection(type="fp8dq", scope="transformer", exclude=("x",))
    assert r.generate.steps is None


def test_with_overrides_revalidates() -> None:
    with raises("command line: [cache] threshold must be a number >= 0, got -0.5"):
        Recipe().with_overrides({"cache": {"threshold": -0.5}})
    with raises("flags: unknown key [parallel] cgf (did you mean 'cfg'?)"):
        Recipe().with_overrides({"parallel": {"cgf": 2}}, source="flags")
    with raises("command line: [vae] must be a table, got true"):
        Recipe().with_overrides({"vae": True})
    with raises("command line: overrides must be a table of sections, got 'cache.threshold=1'"):
        Recipe().with_overrides("cache.threshold=1")  # type: ignore[arg-type]


def test_variants_accessor_is_validated_and_normalized() -> None:
    r = Recipe.from_dict(
        {"bench": {"variants": [{"name": "q", "quant": {"exclude": ["a"]}, "cache": {"threshold": 1}}]}}
    )
    (v,) = r.variants
    assert v.name == "q"
    assert v.overrides == {"quant": {"exclude": ("a",)}, "cache": {"threshold": 1.0}}
    assert type(v.overrides["cache"]["threshold"]) is float


def test_variant_applies_overrides() -> None:
    base = Recipe.from_dict(FULL, source="r.toml")
    fast = base.variant("int8")
    assert fast.quant == QuantSection(type="int8wo", scope="transformer", exclude=())
    assert fast.generate.steps == 8 and fast.generate.prompt == "a fox"
    assert fast.cache == base.cache
    assert fast.bench == BenchSection(variants=(), repeats=5, warmup=2)  # a variant is one concrete run
    assert fast.source == "r.toml"
    assert base.variant("cache").cache.threshold == 0.08


def test_unknown_variant() -> None:
    base = Recipe.from_dict(FULL, source="r.toml")
    with raises("r.toml: [bench] has no variant 'cahce' (did you mean 'cache'?)"):
        base.variant("cahce")
    with raises("r.toml: [bench] has no variant 'zzz' (valid variants: cache, int8)"):
        base.variant("zzz")
    with raises("<dict>: [bench] has no variant 'cache' (the recipe defines none)"):
        Recipe().variant("cache")


# --- error messages -----------------------------------------------------------------------------

ERRORS: list[tuple[Any, str]] = [
    # structure
    ([1, 2], "a recipe must be a table of sections, got [1, 2]"),
    ({"cahce": {}}, "unknown section [cahce] (did you mean [cache]?)"),
    (
        {"xyz": {}},
        "unknown section [xyz] (valid sections: model, generate, cache, parallel, vae, quant, compile, memory, bench)",
    ),
    ({"steps": 4}, "key 'steps' is not in a section (did you mean [generate] steps?)"),
    ({"cache": 3}, "[cache] must be a table, got 3"),
    ({"generate": "fox"}, "[generate] must be a table, got 'fox'"),
    ({"cache": {"treshold": 0.1}}, "unknown key [cache] treshold (did you mean 'threshold'?)"),
    (
        {"cache": {"foo": 1}},
        "unknown key [cache] foo (valid keys: threshold, method, first_blocks, last_blocks, calibrator, taylor_order, "
        "interval, disable_before, disable_after, interval_offset, extrapolate_early, mag_ratios, warmup_steps, "
        "max_consecutive_cached, "
        "max_cached_steps)",
    ),
    (
        {"model": {"bad\nkey": 1}},
        "unknown key [model] 'bad\\nkey' (valid keys: name, dtype, device, pipeline, lora, components)",
    ),
    # numbers
    ({"cache": {"threshold": -1}}, "[cache] threshold must be a number >= 0, got -1"),
    ({"cache": {"threshold": float("nan")}}, "[cache] threshold must be a number >= 0, got nan"),
    ({"cache": {"threshold": float("inf")}}, "[cache] threshold must be a number >= 0, got inf"),
    ({"cache": {"threshold": "0.1"}}, "[cache] threshold must be a number >= 0, got '0.1'"),
    ({"cache": {"warmup_steps": -1}}, "[cache] warmup_steps must be an integer >= 0, got -1"),
    ({"cache": {"max_consecutive_cached": 1.5}}, "[cache] max_consecutive_cached must be an integer >= 0, got 1.5"),
    (
        {"cache": {"method": "magic"}},
        "[cache] method must be one of fbcache, dbcache, taylorseer, magcache, got 'magic'",
    ),
    ({"cache": {"first_blocks": 0, "method": "dbcache"}}, "[cache] first_blocks must be an integer >= 1, got 0"),
    ({"cache": {"taylor_order": 3}}, "[cache] taylor_order must be 1 or 2, got 3"),
    ({"cache": {"calibrator": "taylor"}}, "[cache] calibrator must be none or taylorseer, got 'taylor'"),
    (
        {"cache": {"first_blocks": 4}},
        '[cache] first_blocks is for method = "dbcache", not "fbcache"; set method = "dbcache" or remove first_blocks',
    ),
    (
        {"cache": {"last_blocks": 1, "method": "taylorseer"}},
        '[cache] last_blocks is for method = "dbcache", not "taylorseer"; set method = "dbcache" or remove last_blocks',
    ),
    (
        {"cache": {"threshold": 0.1, "method": "taylorseer"}},
        '[cache] threshold is for method = "fbcache", "dbcache" or "magcache", not '
        '"taylorseer"; set method = "fbcache" or remove threshold',
    ),
    (
        {"cache": {"interval": 4}},
        '[cache] interval is for method = "taylorseer", not "fbcache"; set method = "taylorseer" or remove interval',
    ),
    ({"cache": {"interval": 1, "method": "taylorseer"}}, "[cache] interval must be an integer >= 2, got 1"),
    (
        {"cache": {"taylor_order": 2, "method": "dbcache"}},
        '[cache] taylor_order is for method = "taylorseer" or calibrator = "taylorseer"; '
        "set one of them or remove taylor_order",
    ),
    (
        {"cache": {"method": "magcache", "threshold": 0.1}},
        '[cache] method = "magcache" needs mag_ratios, the per-step residual-magnitude '
        "ratios of this pipeline; measure them with accel tune RECIPE --calibrate",
    ),
    (
        {"cache": {"mag_ratios": [[1.0, 0.9]]}},
        '[cache] mag_ratios is for method = "magcache", not "fbcache"; set method = "magcache" or remove mag_ratios',
    ),
    (
        {"cache": {"method": "magcache", "mag_ratios": [[1.0, -0.5]]}},
        "[cache] mag_ratios must be a list of lists of positive numbers, got [[1.0, -0.5]]",
    ),
    (
        {"cache": {"method": "taylorseer", "disable_before": 3, "disable_after": 3}},
        "[cache] disable_after (3) must be above disable_before (3), or 0 for none",
    ),
    (
        {"cache": {"method": "taylorseer", "interval": 4, "interval_offset": 5}},
        "[cache] interval_offset (5) must be below interval (4); an offset of a whole interval or more is the same "
        "schedule as interval_offset = 1",
    ),
    (
        {"cache": {"interval_offset": 1}},
        '[cache] interval_offset is for method = "taylorseer", not "fbcache"; set method = "taylorseer" or remove '
        "interval_offset",
    ),
    ({"generate": {"steps": "ten"}}, "[generate] steps must be an integer >= 1, got 'ten'"),
    ({"generate": {"steps": 0}}, "[generate] steps must be an integer >= 1, got 0"),
    ({"generate": {"steps": 10.0}}, "[generate] steps must be an integer >= 1, got 10.0"),
    ({"generate": {"height": 8}}, "[generate] height must be an integer >= 16, got 8"),
    ({"generate": {"width": 15}}, "[generate] width must be an integer >= 16, got 15"),
    ({"generate": {"frames": 0}}, "[generate] frames must be an integer >= 1, got 0"),
    ({"generate": {"guidance_scale": -0.1}}, "[generate] guidance_scale must be a number >= 0, got -0.1"),
    ({"generate": {"true_cfg_scale": 0.5}}, "[generate] true_cfg_scale must be a number >= 1, got 0.5"),
    ({"generate": {"seed": -1}}, "[generate] seed must be an integer >= 0, got -1"),
    ({"generate": {"seed": None}}, "[generate] seed must be an integer >= 0, got None"),
    ({"parallel": {"ulysses": 0}}, "[parallel] ulysses must be an integer >= 1, got 0"),
    ({"parallel": {"ring": 0}}, "[parallel] ring must be an integer >= 1, got 0"),
    ({"parallel": {"cfg": 3}}, "[parallel] cfg must be 1 or 2, got 3"),
    ({"parallel": {"cfg": 2.0}}, "[parallel] cfg must be 1 or 2, got 2.0"),
    ({"bench": {"repeats": 0}}, "[bench] repeats must be an integer >= 1, got 0"),
    ({"bench": {"warmup": -1}}, "[bench] warmup must be an integer >= 0, got -1"),
    # strings and choices
    ({"model": {"name": 3}}, "[model] name must be a string, got 3"),
    ({"model": {"dtype": "fp16"}}, "[model] dtype must be one of auto, float32, float16, bfloat16, got 'fp16'"),
    ({"model": {"device": "tpu"}}, "[model] device must be one of auto, cpu, cuda, got 'tpu'"),
    ({"generate": {"prompt": ["a"]}}, "[generate] prompt must be a string, got ['a']"),
    ({"quant": {"type": "int3"}}, "[quant] type must be one of none, int8wo, int8dq, fp8dq, fp8wo, int4wo, got 'int3'"),
    ({"quant": {"exclude": "proj*"}}, "[quant] exclude must be a list of strings, got 'proj*'"),
    ({"quant": {"exclude": ["a", 1]}}, "[quant] exclude must be a list of strings, got ['a', 1]"),
    (
        {"compile": {"mode": "fast"}},
        "[compile] mode must be one of default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs, got 'fast'",
    ),
    ({"compile": {"scope": "model"}}, "[compile] scope must be blocks or transformer, got 'model'"),
    # bench variants
    ({"bench": {"variants": 3}}, "[bench] variants must be a list of tables, got 3"),
    ({"bench": {"variants": [3]}}, "[bench] variant #1 must be a table, got 3"),
    ({"bench": {"variants": [{"name": "a"}, {"cache": {}}]}}, '[bench] variant #2 has no name (add name = "...")'),
    ({"bench": {"variants": [{"name": ""}]}}, "[bench] variant #1 name must be a non-empty string, got ''"),
    ({"bench": {"variants": [{"name": 1}]}}, "[bench] variant #1 name must be a non-empty string, got 1"),
    (
        {"bench": {"variants": [{"name": "a"}, {"name": "a"}]}},
        "[bench] variant name 'a' is used twice (names must be unique)",
    ),
    (
        {"bench": {"variants": [{"name": "fast", "cache": {"treshold": 0.1}}]}},
        "[bench] variant 'fast': unknown key [cache] treshold (did you mean 'threshold'?)",
    ),
    (
        {"bench": {"variants": [{"name": "fast", "bench": {"repeats": 1}}]}},
        "[bench] variant 'fast': cannot contain [bench] (variants share the recipe's repeats and warmup)",
    ),
    (
        {"bench": {"variants": [{"name": "fast", "cahce": {}}]}},
        "[bench] variant 'fast': unknown section [cahce] (did you mean [cache]?)",
    ),
    (
        {"bench": {"variants": [{"name": "fast", "threshold": 0.1}]}},
        "[bench] variant 'fast': key 'threshold' is not in a section (did you mean [cache] threshold?)",
    ),
    (
        {"bench": {"variants": [{"name": "fast", "cache": 0.1}]}},
        "[bench] variant 'fast': [cache] must be a table, got 0.1",
    ),
    (
        {"bench": {"variants": [{"name": "fast", "parallel": {"cfg": 4}}]}},
        "[bench] variant 'fast': [parallel] cfg must be 1 or 2, got 4",
    ),
    (
        {"bench": {"variants": [{"name": "fast", "generate": {"steps": None}}]}},
        "[bench] variant 'fast': [generate] steps must be an integer >= 1, got None",
    ),
]


@pytest.mark.parametrize(("data", "message"), ERRORS, ids=[m[:50] for _, m in ERRORS])
def test_error_messages(data: Any, message: str) -> None:
    with raises(f"recipe.toml: {message}"):
        Recipe.from_dict(data, source="recipe.toml")


def test_default_source_is_named() -> None:
    with raises("<dict>: [parallel] cfg must be 1 or 2, got 3"):
        Recipe.from_dict({"parallel": {"cfg": 3}})


def test_long_values_are_shortened_to_keep_one_line() -> None:
    with raises(f"<dict>: [generate] steps must be an integer >= 1, got '{'x' * 56}..."):
        Recipe.from_dict({"generate": {"steps": "x" * 100}})


@pytest.mark.parametrize(
    ("section", "key", "value", "message"),
    [
        ("vae", "parallel", 1, "must be true or false, got 1"),
        ("vae", "tiling", 0, "must be true or false, got 0"),
        ("vae", "tiling", "yes", "must be true or false, got 'yes'"),
        ("compile", "enabled", 1.0, "must be true or false, got 1.0"),
        ("parallel", "ulysses", True, "must be an integer >= 1, got true"),
        ("parallel", "cfg", True, "must be 1 or 2, got true"),
        ("generate", "seed", False, "must be an integer >= 0, got false"),
        ("cache", "threshold", True, "must be a number >= 0, got true"),
        ("generate", "guidance_scale", False, "must be a number >= 0, got false"),
    ],
)
def test_bools_and_ints_are_not_interchangeable(section: str, key: str, value: Any, message: str) -> None:
    with raises(f"<dict>: [{section}] {key} {message}"):
        Recipe.from_dict({section: {key: value}})


def test_toml_true_is_not_one(tmp_path: Path) -> None:
    path = tmp_path / "r.toml"
    path.write_text("[parallel]\nring = true\n")
    with raises(f"{path}: [parallel] ring must be an integer >= 1, got true"):
        load_recipe(path)


# --- files ---------------------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with raises(f"{path}: no such file"):
        load_recipe(path)


def test_invalid_toml(tmp_path: Path) -> None:
    text = "[cache]\nthreshold = \n"
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(tomllib.TOMLDecodeError) as parsed:
        tomllib.loads(text)
    with raises(f"{path}: not valid TOML: {parsed.value}"):
        load_recipe(path)


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[generate]\nprompt = "caf\xe9"\n')
    with raises(f"{path}: not valid TOML: not UTF-8 text"):
        load_recipe(path)


def test_unreadable_path(tmp_path: Path) -> None:
    with raises(f"{tmp_path}: cannot read: Is a directory"):
        load_recipe(tmp_path)


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "recipe.toml"
    path.write_text("[cahce]\nthreshold = 0.1\n")
    with raises(f"{path}: unknown section [cahce] (did you mean [cache]?)"):
        load_recipe(path)
    path.write_text('[[bench.variants]]\nname = "fast"\ncache = {treshold = 0.1}\n')
    with raises(f"{path}: [bench] variant 'fast': unknown key [cache] treshold (did you mean 'threshold'?)"):
        load_recipe(path)
    path.write_text("cache = 3\n")
    with raises(f"{path}: [cache] must be a table, got 3"):
        load_recipe(path)


def test_unaccelerated_keeps_what_is_generated_and_turns_every_accelerator_off() -> None:
    recipe = Recipe.from_dict(
        {
            "model": {"name": "tiny-flux", "dtype": "float32"},
            "generate": {"steps": 7, "seed": 3},
            "cache": {"threshold": 0.1},
            "parallel": {"ulysses": 2},
            "vae": {"parallel": True},
            "quant": {"type": "int8wo"},
            "compile": {"enabled": True},
            "bench": {"variants": [{"name": "a"}]},
        }
    )
    plain = recipe.unaccelerated()
    assert plain.model == recipe.model and plain.generate == recipe.generate
    assert (
        plain.to_dict()
        == Recipe.from_dict({"model": recipe.to_dict()["model"], "generate": recipe.to_dict()["generate"]}).to_dict()
    )
