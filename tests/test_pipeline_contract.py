"""Pipelines behave as without accel: our own equivalents of diffusers' pipeline checks, run on
pipelines with `accel.apply` in place, against the same calls without it; and the one-line refusals
where a diffusers feature cannot run beside an accelerator (a second apply over shared modules,
diffusers' cache enabled after apply, a one-block cache, safetensors and QKV fusing on int8).

Kept fast: every check on the session's tiny FLUX and Wan pipelines (an image family with embedded
guidance, a video family with true CFG, two calls a step), two steps, the smallest sizes and 16
text tokens; the quantized checks share one fresh FLUX (quantization cannot be undone); the other
families get the cheapest check only (latents with a step callback, the cache in place)."""

from __future__ import annotations

import copy
import inspect
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline
from test_parallel_families import FAMILY_CASES

import accel
from accel.errors import UserError
from accel.instance import wrappers
from accel.models.registry import FAMILIES

FLUX = dict(prompt="a red fox", height=32, width=32, num_inference_steps=2, guidance_scale=3.5,
            max_sequence_length=16)  # 16 text tokens, not 512: fast; embedded guidance (Wan runs true CFG)
WAN = dict(prompt="a red fox", negative_prompt="blurry", height=32, width=32, num_frames=5,
           num_inference_steps=2, guidance_scale=5.0, max_sequence_length=16)
NEVER_REUSES = {"cache": {"threshold": 1e-12}}  # the cache in place; no change is that small


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
        blocks = [*tiny_flux.transformer.transformer_blocks, *tiny_flux.transformer.single_transformer_blocks]
        assert all(wrappers(block, "forward") == ["accel.cache"] for block in blocks)
        assert refusal(lambda: accel.apply(other, NEVER_REUSES)) == SHARED
        assert all(wrappers(block, "forward") == ["accel.cache"] for block in blocks)  # nothing stacked
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
        assert handle.cache_stats.calls == 2  # two steps: accel's cache alone
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


def test_qkv_fused_before_apply_is_quantized_and_runs() -> None:
    pipe = accel.load_pipeline("tiny-flux")
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.fuse_qkv_projections()
    handle = accel.apply(pipe, {"quant": {"type": "int8wo"}})
    assert "transformer_blocks.0.attn.to_qkv" in handle.quant.quantized
    assert torch.isfinite(pipe(**FLUX, output_type="latent").images).all()


# -- the contract harness ----------------------------------------------------------------------------
# Each family's call, its per-prompt count keyword, and a threshold at which its cache reuses steps.
CASES = {"flux": (FLUX, "num_images_per_prompt", 0.5), "wan": (WAN, "num_videos_per_prompt", 0.5)}


def run_contract_calls(pipe: Any, family: str, capsys: pytest.CaptureFixture[str], as_np: bool = True) -> dict[str, Any]:
    """The calls diffusers' pipeline tests make, as one family's pipeline runs them now: a step callback
    reading `latents`, two outputs per prompt, `return_dict=False` with `output_type="pt"`, the same
    call as numpy through the output object, and as latents with the progress bar on."""
    call, per_prompt, _ = CASES[family]
    call = dict(call, **{per_prompt: 2})
    seen: list[torch.Tensor] = []

    def on_step_end(pipeline: Any, step: int, timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        seen.append(tensors["latents"].clone())
        return tensors

    pt = pipe(**call, generator=torch.Generator().manual_seed(0), output_type="pt", return_dict=False,
              callback_on_step_end=on_step_end, callback_on_step_end_tensor_inputs=["latents"])
    assert isinstance(pt, tuple)
    pixels = None
    if as_np:
        result = pipe(**call, generator=torch.Generator().manual_seed(0), output_type="np")
        pixels = np.asarray(result.frames if hasattr(result, "frames") else result.images)
    capsys.readouterr()
    pipe.set_progress_bar_config(disable=False)
    try:
        latent = pipe(**call, generator=torch.Generator().manual_seed(0), output_type="latent", return_dict=False)[0]
    finally:
        pipe.set_progress_bar_config(disable=True)
    progress = capsys.readouterr().err
    return dict(pt=pt[0], np=pixels, latent=latent, seen=seen, progress=progress)


def assert_consistent(outputs: dict[str, Any], steps: int) -> None:
    """What holds within one pipeline whatever accelerates it: a callback at every step, the last one
    seeing the latents the pipeline returns; "pt" and "np" the same pixels; the bar counting the steps."""
    assert len(outputs["seen"]) == steps
    torch.testing.assert_close(outputs["seen"][-1], outputs["latent"], rtol=0, atol=0)
    assert outputs["pt"].shape[0] == 2  # two per prompt
    if outputs["np"] is not None:
        np.testing.assert_array_equal(np.moveaxis(outputs["pt"].numpy(), -3, -1), outputs["np"])
    assert f"{steps}/{steps}" in outputs["progress"]


def assert_equal_outputs(got: dict[str, Any], expected: dict[str, Any]) -> None:
    for key in ("pt", "latent"):
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0, msg=key)
    np.testing.assert_array_equal(got["np"], expected["np"])
    assert len(got["seen"]) == len(expected["seen"])
    for mine, theirs in zip(got["seen"], expected["seen"]):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("family", list(CASES))
def test_contract_with_the_cache_equals_the_plain_pipeline(request: pytest.FixtureRequest, family: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    pipe = request.getfixturevalue(f"tiny_{family}")
    steps = CASES[family][0]["num_inference_steps"]
    plain = run_contract_calls(pipe, family, capsys)
    assert_consistent(plain, steps)

    handle = accel.apply(pipe, NEVER_REUSES)  # every accelerator wrapper in place, no step reused
    try:
        never = run_contract_calls(pipe, family, capsys)
        assert handle.cache_stats.calls > 0 and handle.cache_stats.cached == 0
        assert_equal_outputs(never, plain)
        # A component swap after apply: the new scheduler (a copy, unwrapped) runs as it would without accel.
        scheduler = pipe.scheduler
        pipe.scheduler = copy.deepcopy(scheduler)
        try:
            call = dict(CASES[family][0], **{CASES[family][1]: 2})
            swapped = pipe(**call, generator=torch.Generator().manual_seed(0), output_type="latent").to_tuple()[0]
        finally:
            pipe.scheduler = scheduler
        torch.testing.assert_close(swapped, plain["latent"], rtol=0, atol=0)
    finally:
        handle.remove()

    handle = accel.apply(pipe, {"cache": {"threshold": CASES[family][2]}})  # a threshold that reuses
    try:
        reusing = run_contract_calls(pipe, family, capsys, as_np=False)  # pt and np are equal above
        assert handle.cache_stats.cached > 0
        assert_consistent(reusing, steps)
    finally:
        handle.remove()


def test_contract_with_int8_weights_and_a_pickle_save_round_trip(int8_flux: Any, capsys: pytest.CaptureFixture[str],
                                                                  tmp_path: Path) -> None:
    outputs = run_contract_calls(int8_flux, "flux", capsys, as_np=False)
    assert_consistent(outputs, FLUX["num_inference_steps"])
    int8_flux.transformer.save_pretrained(tmp_path, safe_serialization=False)  # what pipe.save_pretrained writes for it
    transformer = type(int8_flux.transformer).from_pretrained(tmp_path)
    assert type(transformer.transformer_blocks[0].attn.to_q.weight).__name__ == "Int8Tensor"
    assert wrappers(transformer.transformer_blocks[0], "save_pretrained") == []  # plain modules: no wrapper was saved
    loaded = FluxPipeline.from_pipe(int8_flux, transformer=transformer)
    call = dict(FLUX, num_images_per_prompt=2)
    again = loaded(**call, generator=torch.Generator().manual_seed(0), output_type="pt", return_dict=False)[0]
    torch.testing.assert_close(again, outputs["pt"], rtol=0, atol=0)


def test_applied_pipeline_saves_plain_modules_and_follows_to_dtype(tiny_flux: Any, tmp_path: Path) -> None:
    call = dict(FLUX, output_type="latent", num_inference_steps=1)
    tiny_flux.to(torch.float64)  # float32 -> float64 -> float32 is exact: the session's pipeline is unchanged after
    try:
        plain = tiny_flux(**call, generator=torch.Generator().manual_seed(0)).images
        handle = accel.apply(tiny_flux, NEVER_REUSES)
        try:
            tiny_flux.save_pretrained(tmp_path)  # safetensors: nothing quantized
            tiny_flux.to(torch.float32).to(torch.float64)  # to(dtype) after apply keeps accel's wrappers acting
            applied = tiny_flux(**call, generator=torch.Generator().manual_seed(0)).images
            assert handle.cache_stats.calls == 1
        finally:
            handle.remove()
    finally:
        tiny_flux.to(torch.float32)
    assert applied.dtype == torch.float64
    torch.testing.assert_close(applied, plain, rtol=0, atol=0)
    loaded = FluxPipeline.from_pretrained(tmp_path, dtype=torch.float32)
    saved = loaded.transformer.state_dict()
    assert wrappers(loaded.transformer.transformer_blocks[0], "forward") == []  # a plain pipeline comes back
    assert sorted(saved) == sorted(tiny_flux.transformer.state_dict())
    for name, tensor in tiny_flux.transformer.state_dict().items():
        torch.testing.assert_close(saved[name], tensor, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("family", [name for name in FAMILY_CASES if name not in CASES])
def test_every_family_with_the_cache_in_place_equals_the_plain_pipeline(family: str) -> None:
    """The cheapest of the checks on every other family: latents through `return_dict=False`, a step
    callback reading them, the cache in place but never reusing: exactly the plain pipeline's."""
    pipe = FAMILIES[family].tiny()
    pipe.set_progress_bar_config(disable=True)
    call = dict(FAMILY_CASES[family].call, num_inference_steps=2, output_type="latent", return_dict=False)
    callbacks = "callback_on_step_end" in inspect.signature(pipe.__call__).parameters  # HunyuanVideo 1.5 takes none

    def run() -> tuple[torch.Tensor, list[int]]:
        steps: list[int] = []
        extra = dict(callback_on_step_end=lambda p, i, t, tensors: steps.append(i) or tensors,
                     callback_on_step_end_tensor_inputs=["latents"]) if callbacks else {}
        output = pipe(**call, **extra, generator=torch.Generator().manual_seed(0))[0]
        return output, steps

    plain, plain_steps = run()
    handle = accel.apply(pipe, NEVER_REUSES)
    try:
        applied, applied_steps = run()
        assert handle.cache_stats.calls > 0 and handle.cache_stats.cached == 0
    finally:
        handle.remove()
    assert applied_steps == plain_steps == ([0, 1] if callbacks else [])
    torch.testing.assert_close(applied, plain, rtol=0, atol=0)
