"""Tiny pipelines of every family: real classes, offline, seeded, deterministic, prompt-driven, reloadable.

Later cache and context-parallel tests compare outputs bit for bit, so these pin down the
properties they rely on.
"""

from __future__ import annotations

import inspect
import os

# huggingface_hub reads this once at import: set it before diffusers comes in, in case this
# module is the first to import it. Loading below also passes local_files_only=True.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import diffusers  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from accel.models.registry import FAMILIES  # noqa: E402
from families import FAMILY_CASES  # noqa: E402
from family_case import TinyCase  # noqa: E402


PROMPT = "a red fox in the snow, photograph"


def generate(pipe: diffusers.DiffusionPipeline, case: TinyCase, prompt: str = PROMPT, seed: int = 0) -> np.ndarray:
    out = pipe(prompt=prompt, generator=torch.Generator().manual_seed(seed), **case.call)
    return getattr(out, case.output_attr)


def state(pipe: diffusers.DiffusionPipeline, case: TinyCase) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{key}": value for name in case.components for key, value in getattr(pipe, name).state_dict().items()
    }


@pytest.fixture(scope="module", params=list(FAMILY_CASES))
def case(request: pytest.FixtureRequest) -> TinyCase:
    return FAMILY_CASES[request.param].tiny


@pytest.fixture(scope="module")
def pipe(case: TinyCase) -> diffusers.DiffusionPipeline:
    pipe = case.build(0)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def baseline(pipe: diffusers.DiffusionPipeline, case: TinyCase) -> np.ndarray:
    return generate(pipe, case)


def test_real_pipeline_classes_in_float32_eval_mode(pipe: diffusers.DiffusionPipeline, case: TinyCase) -> None:
    assert type(pipe) is case.pipeline_class
    for name in case.components:
        module = getattr(pipe, name)
        assert all(p.dtype == torch.float32 for p in module.parameters()), name
        assert not any(m.training for m in module.modules()), f"{name} left in training mode"


def test_structure_has_repeated_blocks_and_heads(pipe: diffusers.DiffusionPipeline, case: TinyCase) -> None:
    transformer = pipe.transformer
    for attr in case.block_lists:
        assert len(getattr(transformer, attr)) >= 2, attr
    assert FAMILIES[case.name].heads_in(transformer.config) >= 4


def test_same_seed_gives_identical_weights(case: TinyCase) -> None:
    first, second, other = state(case.build(0), case), state(case.build(0), case), state(case.build(1), case)
    assert first.keys() == second.keys() == other.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    differing = [k for k in first if not torch.equal(first[k], other[k])]
    # Every randomly initialised part of every component must depend on the seed.
    for name in case.components:
        assert any(k.startswith(f"{name}.") for k in differing), name


def test_build_leaves_caller_rng_and_dtype_alone(case: TinyCase) -> None:
    rng_before = torch.random.get_rng_state()
    case.build(3)
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    assert torch.get_default_dtype() == torch.float32


def test_output_shape_and_range(baseline: np.ndarray, case: TinyCase) -> None:
    assert baseline.shape == case.output_shape
    assert baseline.dtype == np.float32
    assert np.isfinite(baseline).all()
    assert baseline.min() >= 0.0 and baseline.max() <= 1.0
    assert baseline.std() > 0.01, "output is flat: the decoder or denoiser is degenerate"


def test_output_is_bit_identical_across_calls_and_builds(
    pipe: diffusers.DiffusionPipeline, case: TinyCase, baseline: np.ndarray
) -> None:
    assert np.array_equal(generate(pipe, case), baseline)
    fresh = case.build(0)
    fresh.set_progress_bar_config(disable=True)
    assert np.array_equal(generate(fresh, case), baseline)


def test_prompt_and_noise_seed_change_output(
    pipe: diffusers.DiffusionPipeline, case: TinyCase, baseline: np.ndarray
) -> None:
    other_prompt = generate(pipe, case, prompt="a blue car on a road")
    assert np.abs(other_prompt - baseline).mean() > 1e-5
    other_noise = generate(pipe, case, seed=1)
    assert np.abs(other_noise - baseline).mean() > 1e-3


def _shape(value: Any) -> tuple[Any, ...]:
    """A tensor's shape, or a list's per-sample shapes (Z-Image)."""
    return tuple(tuple(item.shape) for item in value) if isinstance(value, list) else tuple(value.shape)


def test_text_and_latent_tokens_reach_the_transformer(pipe: diffusers.DiffusionPipeline, case: TinyCase) -> None:
    seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def record(_module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        arguments = inspect.signature(pipe.transformer.forward).bind(*args, **kwargs).arguments
        seen.append(tuple(_shape(arguments[name]) for name in case.inputs))

    handle = pipe.transformer.register_forward_pre_hook(record, with_kwargs=True)
    try:
        generate(pipe, case)
    finally:
        handle.remove()
    if case.negative_text_shape is None:
        assert seen == [(case.latent_shape, case.text_shape)] * case.transformer_calls
    else:  # positive then negative call in every step
        assert seen == [(case.latent_shape, case.text_shape), (case.latent_shape, case.negative_text_shape)] * (
            case.transformer_calls // 2
        )


def test_short_max_sequence_length_runs(pipe: diffusers.DiffusionPipeline, case: TinyCase) -> None:
    if "max_sequence_length" not in inspect.signature(type(pipe).__call__).parameters:
        pytest.skip(f"{type(pipe).__name__} pads its prompts to fixed lengths and takes no max_sequence_length")
    out = pipe(prompt=PROMPT, generator=torch.Generator().manual_seed(0), max_sequence_length=32, **case.call)
    assert getattr(out, case.output_attr).shape == case.output_shape


@pytest.mark.parametrize("loader", ["own_class", "DiffusionPipeline"])
def test_save_and_reload_is_bit_identical(
    pipe: diffusers.DiffusionPipeline,
    case: TinyCase,
    baseline: np.ndarray,
    loader: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if case.name == "wan":
        # WanTransformer3DModel keeps some modules in float32, and diffusers then insists on
        # low_cpu_mem_usage loading, which needs accelerate.
        pytest.importorskip("accelerate", reason="diffusers needs accelerate to load WanTransformer3DModel")
    if case.name == "qwenimage21":
        pytest.skip(FAMILY_CASES["qwenimage21"].no_reload)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pipe.save_pretrained(tmp_path)
    cls = case.pipeline_class if loader == "own_class" else diffusers.DiffusionPipeline
    loaded = cls.from_pretrained(tmp_path, local_files_only=True)
    loaded.set_progress_bar_config(disable=True)
    assert type(loaded) is case.pipeline_class
    for name in ("tokenizer", "tokenizer_2"):
        if hasattr(pipe, name):
            text = "Héllo, wörld! 123 fox"
            assert getattr(loaded, name)(text).input_ids == getattr(pipe, name)(text).input_ids
            assert getattr(loaded, name).model_max_length == getattr(pipe, name).model_max_length
    before, after = state(pipe, case), state(loaded, case)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert np.abs(generate(loaded, case) - baseline).max() <= case.reload_tolerance
