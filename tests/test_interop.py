"""accel beside diffusers' own features: attention backends, diffusers' cache hooks, LoRA (with and
without quantization), step callbacks that draw from the global RNG, and the pipeline's output forms."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import accel
import interop_cases as cases
from rankpool import COLLECTIVE_TIMEOUT_S
from accel.errors import UserError
from accel.parallel.mode import bypassing_backend

TOLERANCE = 1e-4  # as test_parallel_flux: parallel against one process
QUICK_S = COLLECTIVE_TIMEOUT_S / 3  # an error, not a collective timeout


# -- attention backends ---------------------------------------------------------------------------
def backend_refusal(backend: str) -> str:
    return (
        f"NotAvailableError: [parallel] ulysses 2 × ring 1: pipe.transformer uses the diffusers attention backend "
        f"'{backend}', which bypasses the scaled_dot_product_attention that context parallelism routes; call "
        'pipe.transformer.set_attention_backend("native") before accel.apply, or run on one process'
    )


def unrouted(name: str, why: str) -> str:
    return (
        f"NotAvailableError: context parallelism: {name}'s forward sent no attention call through the parallel engine "
        f"({why} torch's scaled_dot_product_attention), so each rank attended only its own shard; "
        'call set_attention_backend("native") on it, use processors that call scaled_dot_product_attention, '
        "or run on one process"
    )


@pytest.mark.parametrize("where", ["processors", "default"])
def test_a_backend_that_bypasses_sdpa_is_refused_at_apply_on_every_rank(rank_pools, where: str) -> None:
    """set_attention_backend("flex"), or flex as diffusers' global default (the DIFFUSERS_ATTN_BACKEND
    setting, here through diffusers' attention_backend context manager: the variable is read at import)."""
    results = rank_pools(2).run(cases.backend_refusal, "flex", where, timeout=120)
    for message, seconds in results:
        assert message == backend_refusal("flex")
        assert seconds < QUICK_S


@cases.global_backend_kept()
def test_backend_detection_follows_processors_then_the_default() -> None:
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry, attention_backend

    transformer, other = cases.fresh_flux().transformer, cases.fresh_flux().transformer
    assert bypassing_backend(transformer) is None
    with attention_backend("flex"):
        assert bypassing_backend(transformer) == "flex"
        transformer.set_attention_backend("native")  # a processor's own choice beats the default
        assert bypassing_backend(transformer) is None
    transformer.set_attention_backend("_native_math")  # calls SDPA inside an sdpa_kernel context
    assert bypassing_backend(transformer) is None
    transformer.set_attention_backend("flex")
    assert bypassing_backend(transformer) == "flex"
    # diffusers 0.42 makes the last set_attention_backend the process default too, and reset only
    # clears the processors' own choice: both transformers then run flex.
    assert _AttentionBackendRegistry._active_backend == "flex" and bypassing_backend(other) == "flex"
    transformer.reset_attention_backend()
    assert bypassing_backend(transformer) == "flex"
    transformer.set_attention_backend("native")
    assert bypassing_backend(transformer) is None and bypassing_backend(other) is None


def test_a_backend_set_after_apply_fails_the_forward_on_every_rank(rank_pools) -> None:
    for message in rank_pools(2).run(cases.backend_after_apply, "flex", timeout=120):
        assert message == unrouted("FluxTransformer2DModel", "its diffusers attention backend 'flex' bypasses")


def test_the_native_backend_still_equals_one_process(rank_pools, flux_reference: np.ndarray) -> None:
    for output in rank_pools(2).run(cases.native_backend_output):
        assert np.abs(output - flux_reference).max() <= TOLERANCE


def test_a_forward_that_routes_no_attention_raises_on_every_rank(rank_pools) -> None:
    """A toy transformer computing attention by hand (matmul + softmax) under Ulysses 2 raises; the
    same attention through SDPA equals one process."""
    for hand_error, sdpa_error in rank_pools(2).run(cases.toy_attention_runs):
        assert hand_error == unrouted("HandAttention", "its attention processors bypass")
        assert sdpa_error <= 1e-5


# -- diffusers' own cache hooks -------------------------------------------------------------------
DIFFUSERS_CACHE_AT_APPLY = (
    "UserError: {asked}: pipe.transformer already has diffusers' own cache enabled (enable_cache), which cannot run "
    "beside accel's cache or across parallel ranks (each rank would decide alone); call "
    "pipe.transformer.disable_cache() before accel.apply and use accel's [cache] instead"
)


def test_diffusers_cache_with_parallel_is_refused_at_apply_on_every_rank(rank_pools) -> None:
    for message, seconds in rank_pools(2).run(cases.diffusers_cache_refusal, "before", timeout=120):
        assert message == DIFFUSERS_CACHE_AT_APPLY.format(asked="[parallel]")
        assert seconds < QUICK_S


def test_diffusers_cache_enabled_after_apply_fails_fast_on_every_rank(rank_pools) -> None:
    for message, seconds in rank_pools(2).run(cases.diffusers_cache_refusal, "after", timeout=120):
        assert message == (
            "NotAvailableError: context parallelism: FluxTransformer2DModel has diffusers' own cache enabled "
            "(enable_cache), which decides on each rank's shard alone; call disable_cache() on it and use accel's "
            "[cache] instead, or run on one process"
        )
        assert seconds < QUICK_S


def test_two_caches_are_refused_on_one_process() -> None:
    pipe = cases.fresh_flux()
    pipe.transformer.enable_cache(cases._fbcache_config())
    message = cases.error_of(lambda: accel.apply(pipe, {"cache": {"threshold": 0.1}}))
    assert message == DIFFUSERS_CACHE_AT_APPLY.format(asked="[cache]")
    accel.apply(pipe, {"vae": {"tiling": True}}).remove()  # neither cache nor ranks: diffusers' cache is fine
    pipe.transformer.disable_cache()
    handle = accel.apply(pipe, {"cache": {"threshold": 0.1}})  # the refused apply left nothing applied
    assert len(handle.caches) == 1
    handle.remove()


# -- LoRA -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    pytest.importorskip("peft")
    directory = tmp_path_factory.mktemp("lora")
    cases.make_lora(str(directory))
    return str(directory)


@pytest.fixture(scope="module")
def lora_reference(lora_dir: str) -> list[np.ndarray]:
    """LoRA loaded, fused, then unfused and unloaded, on a pipeline without accel."""
    return cases.lora_after_apply(lora_dir, None)


def test_lora_reference_is_meaningful(lora_reference: list[np.ndarray], flux_reference: np.ndarray) -> None:
    loaded, fused, unloaded = lora_reference
    assert np.abs(loaded - flux_reference).max() > 1e-2, "the LoRA changes the image"
    assert np.abs(fused - loaded).max() <= TOLERANCE and np.abs(unloaded - flux_reference).max() <= TOLERANCE


def test_a_recipe_lora_is_fused_at_its_scale_before_accelerating(
    rank_pools, lora_dir: str, lora_reference: list[np.ndarray]
) -> None:
    """`[model] lora`: the transformer holds plain weights W + scale * B A (no adapter layers left), so
    Ulysses 2 and int8 quantization see an ordinary checkpoint; at scale 1 it makes the fused image."""
    from safetensors.torch import load_file

    half = accel.load_pipeline("tiny-flux", lora=[f"{lora_dir}@0.5"])
    plain = cases.fresh_flux()
    assert not [name for name, _ in half.transformer.named_modules() if "lora" in name]
    lora = load_file(f"{lora_dir}/pytorch_lora_weights.safetensors")
    down, up = (lora[f"transformer.transformer_blocks.0.attn.to_k.lora_{part}.weight"] for part in "AB")
    expected = plain.transformer.transformer_blocks[0].attn.to_k.weight + 0.5 * (
        up @ down
    )  # alpha = rank: no extra factor
    assert torch.allclose(half.transformer.transformer_blocks[0].attn.to_k.weight, expected, atol=1e-6)
    assert np.abs(cases.fused_lora_run(lora_dir, {}) - lora_reference[1]).max() <= TOLERANCE
    for output in rank_pools(2).run(cases.fused_lora_run, lora_dir, {"parallel": {"ulysses": 2}}):
        assert np.abs(output - lora_reference[1]).max() <= TOLERANCE
    quantized = cases.fused_lora_run(lora_dir, {"quant": {"type": "int8wo"}})
    assert 0 < np.abs(quantized - lora_reference[1]).max() < 5e-3  # int8 error only


def test_accel_run_fuses_the_lora_flag(tmp_path: Path, lora_dir: str, lora_reference: list[np.ndarray]) -> None:
    """`accel run --lora` writes the fused LoRA's image (the reference call is the recipe's)."""
    from PIL import Image

    from accel.cli import app

    out = tmp_path / "lora.png"
    call = cases.FLUX_CALL
    result = CliRunner().invoke(
        app,
        [
            "run",
            "tiny-flux",
            "--lora",
            lora_dir,
            "--prompt",
            call["prompt"],
            "--steps",
            str(call["num_inference_steps"]),
            "--height",
            str(call["height"]),
            "--width",
            str(call["width"]),
            "--guidance",
            str(call["guidance_scale"]),
            "--warmup",
            "0",
            "-o",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.stderr
    written = np.asarray(Image.open(out), dtype=np.float32) / 255
    assert np.abs(written - lora_reference[1][0]).max() <= 1 / 255 + 1e-6


@pytest.mark.parametrize(
    "value, message",
    [
        (
            "{missing}",
            "[model] lora: {missing} does not exist; pass a LoRA .safetensors file, its folder, or a hub repo id",
        ),
        (
            "{lora}@half",
            "[model] lora: {lora}@half: write PATH@SCALE (a .safetensors file, a folder, or a hub repo id; SCALE 1 "
            "when "
            "left out), e.g. style.safetensors@0.8",
        ),
    ],
    ids=["missing", "scale"],
)
def test_a_bad_lora_flag_is_one_line_before_loading(tmp_path: Path, lora_dir: str, value: str, message: str) -> None:
    from accel.cli import app

    paths = {"missing": str(tmp_path / "nope.safetensors"), "lora": lora_dir}
    for gpus in ([], ["--gpus", "2"]):  # before any rank starts
        result = CliRunner().invoke(
            app, ["run", "tiny-flux", "--lora", value.format(**paths), *gpus, "-o", str(tmp_path / "o.png")]
        )
        assert result.exit_code == 2
        assert result.stderr.strip() == "error: " + message.format(**paths)


def test_a_file_that_is_not_a_lora_for_the_model_is_one_line(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    pytest.importorskip("peft")
    save_file({"foo.weight": torch.zeros(2, 2)}, tmp_path / "foo.safetensors")
    save_file(
        {
            "transformer.nowhere.lora_A.weight": torch.zeros(4, 8),
            "transformer.nowhere.lora_B.weight": torch.zeros(8, 4),
        },
        tmp_path / "other.safetensors",
    )
    with pytest.raises(UserError) as refused:
        accel.load_pipeline("tiny-flux", lora=[str(tmp_path / "foo.safetensors")])
    assert str(refused.value) == (
        f"[model] lora: {tmp_path / 'foo.safetensors'} is not a LoRA FluxPipeline can load (Invalid LoRA "
        "checkpoint. Make sure all LoRA param names contain `'lora'` substring.)"
    )
    with pytest.raises(UserError) as refused:
        accel.load_pipeline("tiny-flux", lora=[str(tmp_path / "other.safetensors")])
    assert str(refused.value).startswith(f"[model] lora: {tmp_path / 'other.safetensors'} ")


def test_lora_after_apply_equals_lora_without_accel(
    rank_pools, lora_dir: str, lora_reference: list[np.ndarray]
) -> None:
    for outputs in rank_pools(2).run(cases.lora_after_apply, lora_dir, {"parallel": {"ulysses": 2}}):
        for output, expected in zip(outputs, lora_reference, strict=True):  # loaded, fused, unloaded
            assert np.abs(output - expected).max() <= TOLERANCE


def test_lora_after_apply_with_the_cache_equals_one_process(lora_dir: str, lora_reference: list[np.ndarray]) -> None:
    outputs = cases.lora_after_apply(lora_dir, {"cache": {"threshold": 1e-9}})  # computes every step: exact
    for output, expected in zip(outputs, lora_reference, strict=True):
        assert np.abs(output - expected).max() <= TOLERANCE


def test_int8_quantization_keeps_lora_layers_and_refuses_fusing(
    lora_dir: str, lora_reference: list[np.ndarray]
) -> None:
    pipe = cases.fresh_flux()
    pipe.load_lora_weights(lora_dir, adapter_name="test")
    handle = accel.apply(pipe, {"quant": {"type": "int8wo"}})
    try:
        lora = {
            name: m
            for name, m in pipe.transformer.named_modules()
            if isinstance(m, torch.nn.Linear) and ".lora_" in name
        }
        assert len(lora) == 2 * 3 * (
            len(pipe.transformer.transformer_blocks) + len(pipe.transformer.single_transformer_blocks)
        )
        for name, module in lora.items():
            assert type(module.weight) is torch.nn.Parameter and module.weight.dtype == torch.float32, name
        assert sorted(handle.quant.kept["LoRA adapter"]) == sorted(lora)
        assert "transformer_blocks.0.attn.to_q.base_layer" in handle.quant.quantized
        assert type(pipe.transformer.transformer_blocks[0].attn.to_q.base_layer.weight).__name__ == "Int8Tensor"
        output = cases.generate(pipe)
        assert np.abs(output - lora_reference[0]).max() < 5e-3  # int8 error only: the LoRA still applies
        for method in ("fuse_lora", "unfuse_lora"):
            expected = (
                f"[quant] type = 'int8wo': pipe.{method}() cannot merge LoRA weights into the quantized transformer; "
                "keep the LoRA unfused (it runs beside the quantized layers), or fuse it before accel.apply"
            )
            with pytest.raises(UserError, match=f"^{re.escape(expected)}$"):
                getattr(pipe, method)()
        assert np.array_equal(cases.generate(pipe), output), "the refused call changed nothing"
    finally:
        handle.remove()
    assert "fuse_lora" not in vars(pipe) and "unfuse_lora" not in vars(pipe)


# -- a step callback that draws from the global RNG ----------------------------------------------
def test_callback_drawing_global_noise_agrees_across_ranks(rank_pools) -> None:
    pipe = cases.fresh_flux()
    expected = {}
    with torch.random.fork_rng():
        for seed in (100, 101):  # one process seeded as rank 0, and as rank 1
            torch.manual_seed(seed)
            expected[seed] = cases.generate(pipe, callback_on_step_end=cases.noisy_callback)
    assert np.abs(expected[100] - expected[101]).max() > 1e-2, "the callback's noise shows in the image"
    for output in rank_pools(2).run(cases.callback_noise_output, {"parallel": {"ulysses": 2}}, 100):
        assert np.abs(output - expected[100]).max() <= TOLERANCE


# -- output forms ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "one, parallel",
    [
        ({}, {"parallel": {"ulysses": 2}}),
        ({"cache": {"threshold": 0.4}}, {"parallel": {"ulysses": 2}, "cache": {"threshold": 0.4}}),
    ],
    ids=["ulysses2", "ulysses2-cache"],
)
def test_latent_output_and_tuple_return_equal_one_process(
    rank_pools, one: dict[str, Any], parallel: dict[str, Any]
) -> None:
    latents, images = cases.output_forms(one)
    assert latents.ndim == 3 and images.shape == (1, 64, 64, 3)  # packed FLUX latents; one RGB image
    for got_latents, got_images in rank_pools(2).run(cases.output_forms, parallel):
        assert got_latents.shape == latents.shape and np.abs(got_latents - latents).max() <= TOLERANCE
        assert np.abs(got_images - images).max() <= TOLERANCE
