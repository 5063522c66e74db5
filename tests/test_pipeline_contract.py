"""Pipelines behave as without accel: our own equivalents of diffusers' pipeline checks, run on
pipelines with `accel.apply` in place, against the same calls without it; and the one-line refusals
where a diffusers feature cannot run beside an accelerator (a second apply over shared modules,
diffusers' cache enabled after apply, a one-block cache, safetensors and QKV fusing on int8).

Kept fast: the session's tiny FLUX and Wan pipelines (an image family with embedded guidance and
true CFG, a video family with two calls a step), two steps, the smallest sizes; the quantized
checks share one fresh FLUX (quantization cannot be undone)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline

import accel
from accel.errors import UserError

FLUX = dict(prompt="a red fox", negative_prompt="blurry", true_cfg_scale=2.0, height=32, width=32,
            num_inference_steps=2, guidance_scale=3.5)
WAN = dict(prompt="a red fox", negative_prompt="blurry", height=32, width=32, num_frames=5,
           num_inference_steps=2, guidance_scale=5.0)
NEVER_REUSES = {"cache": {"threshold": 0.0}}


def refusal(action: Any) -> str:
    with pytest.raises(UserError) as caught:
        action()
    return str(caught.value)


def files_in(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


# -- a pipeline over the same modules ---------------------------------------------------------------
SHARED = (
    "accel.apply: pipe.transformer is the transformer of a FluxPipeline already accelerated by accel.apply "
    "(from_pipe and Pipeline(**pipe.components) share modules), so accel's changes already act here; call "
    "remove() on that FluxPipeline's handle first, or load the pipeline again for a separate one"
)


@pytest.mark.parametrize("build", ["from_pipe", "components"])
def test_second_apply_over_shared_modules_is_refused_naming_the_first(tiny_flux: Any, build: str) -> None:
    other = FluxPipeline.from_pipe(tiny_flux) if build == "from_pipe" else FluxPipeline(**tiny_flux.components)
    handle = accel.apply(tiny_flux, NEVER_REUSES)
    try:
        wrapped = {name: list(vars(block).get("_accel_wrapped", {})) for name, block in tiny_flux.transformer.named_children()}
        assert refusal(lambda: accel.apply(other, NEVER_REUSES)) == SHARED
        assert {name: list(vars(block).get("_accel_wrapped", {})) for name, block in tiny_flux.transformer.named_children()} == wrapped
    finally:
        handle.remove()
    accel.apply(other, NEVER_REUSES).remove()  # the first removed: the second applies
    accel.apply(tiny_flux, {}).remove()  # and the refused apply left nothing behind on the first


# -- diffusers' own cache, enabled after apply --------------------------------------------------------
def test_diffusers_cache_enabled_after_apply_is_refused_before_the_step(tiny_flux: Any) -> None:
    from diffusers.hooks import FirstBlockCacheConfig

    handle = accel.apply(tiny_flux, {"cache": {"threshold": 0.5}})
    steps: list[int] = []
    try:
        tiny_flux.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.4))
        message = refusal(lambda: tiny_flux(**FLUX, output_type="latent",
                                            callback_on_step_end=lambda p, i, t, kw: steps.append(i) or kw))
        assert message == (
            "[cache]: pipe.transformer.enable_cache() was called after accel.apply; diffusers' own cache cannot run "
            "beside accel's cache or across parallel ranks; call pipe.transformer.disable_cache(), or remove() "
            "accel's handle before enabling it"
        )
        assert steps == [] and handle.cache_stats.calls == 0  # refused before any step ran
        tiny_flux.transformer.disable_cache()
        tiny_flux(**FLUX, output_type="latent")
        assert handle.cache_stats.calls == 4  # two steps, two CFG branches: accel's cache alone
    finally:
        if tiny_flux.transformer.is_cache_enabled:
            tiny_flux.transformer.disable_cache()
        handle.remove()


# -- a transformer with one block ---------------------------------------------------------------------
@pytest.mark.parametrize("method", ["fbcache", "dbcache"])
def test_one_block_cache_refusal_advises_what_works(tiny_flux: Any, method: str) -> None:
    one = copy.deepcopy(tiny_flux.transformer)
    one.transformer_blocks = torch.nn.ModuleList(one.transformer_blocks[:1])
    one.single_transformer_blocks = torch.nn.ModuleList()
    pipe = FluxPipeline.from_pipe(tiny_flux, transformer=one)
    assert refusal(lambda: accel.apply(pipe, {"cache": {"method": method, "threshold": 0.5}})) == (
        f"[cache] method = '{method}': FluxTransformer2DModel has 1 block, and the block cache needs one to decide "
        "and one to cache; use method = 'taylorseer' or 'magcache', or turn the cache off"
    )
    assert "_accel_wrapped" not in vars(one.transformer_blocks[0])


# -- int8 weights: what torchao cannot do, refused; what it can, round trips -------------------------
@pytest.fixture(scope="module")
def int8_flux() -> Any:
    """A fresh tiny FLUX under int8wo (quantization stays after remove(): no other test may share it)."""
    pipe = accel.load_pipeline("tiny-flux")
    pipe.set_progress_bar_config(disable=True)
    handle = accel.apply(pipe, {"quant": {"type": "int8wo"}})
    yield pipe
    handle.remove()


def safetensors_refusal(where: str) -> str:
    return (
        f"[quant] type = 'int8wo': {where}.save_pretrained() cannot write torchao's quantized weights as safetensors; "
        "pass safe_serialization=False (from_pretrained loads that back quantized), or save before accel.apply"
    )


def test_int8_safetensors_save_and_qkv_fusing_are_refused_in_one_line(int8_flux: Any, tmp_path: Path) -> None:
    assert refusal(lambda: int8_flux.save_pretrained(tmp_path)) == safetensors_refusal("pipe")
    assert refusal(lambda: int8_flux.transformer.save_pretrained(tmp_path, safe_serialization=True)) == (
        safetensors_refusal("pipe.transformer"))
    assert files_in(tmp_path) == []  # refused before any component was written
    assert refusal(int8_flux.transformer.fuse_qkv_projections) == (
        "[quant] type = 'int8wo': pipe.transformer.fuse_qkv_projections() cannot concatenate torchao's quantized q, k "
        "and v weights; call it before accel.apply (the fused layers are then quantized)"
    )
    assert all(getattr(block.attn, "fused_projections", False) is False for block in int8_flux.transformer.transformer_blocks)


def test_int8_pickle_save_round_trips_quantized(int8_flux: Any, tmp_path: Path) -> None:
    expected = int8_flux(**FLUX, generator=torch.Generator().manual_seed(0), output_type="np").images
    int8_flux.transformer.save_pretrained(tmp_path, safe_serialization=False)  # what pipe.save_pretrained writes for it
    transformer = type(int8_flux.transformer).from_pretrained(tmp_path)
    assert type(transformer.transformer_blocks[0].attn.to_q.weight).__name__ == "Int8Tensor"
    assert "_accel_wrapped" not in vars(transformer.transformer_blocks[0])  # plain modules: accel's wrappers were not saved
    loaded = FluxPipeline.from_pipe(int8_flux, transformer=transformer)
    output = loaded(**FLUX, generator=torch.Generator().manual_seed(0), output_type="np").images
    np.testing.assert_array_equal(output, expected)


def test_qkv_fused_before_apply_is_quantized_and_runs() -> None:
    pipe = accel.load_pipeline("tiny-flux")
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.fuse_qkv_projections()
    handle = accel.apply(pipe, {"quant": {"type": "int8wo"}})
    assert "transformer_blocks.0.attn.to_qkv" in handle.quant.quantized
    assert np.isfinite(pipe(**FLUX, output_type="np").images).all()
