"""Pipelines behave as without accel: our own equivalents of diffusers' pipeline checks, run on
pipelines with `accel.apply` in place, against the same calls without it; and the one-line refusals
where a diffusers feature cannot run beside an accelerator (a second apply over shared modules,
diffusers' cache enabled after apply, a one-block cache, safetensors and QKV fusing on int8).

Every family runs the whole contract (its tiny seeded pipeline, two steps, 32 px where it allows, 16
text tokens where the pipeline takes a length): never reusing, bit for bit the plain pipeline, also
after `to("cpu")`, attention slicing, a component swap, model CPU offload and disk-backed group
offload onto the CPU; reusing, and with int8 weights, the same contract on its own numbers. What
needs a GPU (`to("cuda")`, offload onto it, streamed group offload) is checked where one exists."""

from __future__ import annotations

import copy
import inspect
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline
from families import FAMILY_CASES

import accel
from accel.errors import UserError
from accel.hooks import wrappers
from accel.models.registry import FAMILIES

FLUX = dict(
    prompt="a red fox", height=32, width=32, num_inference_steps=2, guidance_scale=3.5, max_sequence_length=16
)  # 16 text tokens, not 512: fast; embedded guidance (Wan runs true CFG)
WAN = dict(
    prompt="a red fox",
    negative_prompt="blurry",
    height=32,
    width=32,
    num_frames=5,
    num_inference_steps=2,
    guidance_scale=5.0,
    max_sequence_length=16,
)
NEVER_REUSES = {"cache": {"threshold": 1e-12}}  # the cache in place; no change is that small


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """One intra-op thread for this file's tiny models: their ops are too small to share out, and two
    threads on a busy 2-core machine spin against each other (a call 20 times slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
        message = refusal(
            lambda: tiny_flux(
                **FLUX, output_type="latent", callback_on_step_end=lambda p, i, t, kw: steps.append(i) or kw
            )
        )
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
        safetensors_refusal("pipe.transformer")
    )
    assert files_in(tmp_path) == []  # refused before any component was written
    assert refusal(int8_flux.transformer.fuse_qkv_projections) == (
        "[quant] type = 'int8wo': pipe.transformer.fuse_qkv_projections() cannot concatenate torchao's quantized q, k "
        "and v weights; call it before accel.apply (the fused layers are then quantized)"
    )
    assert all(
        getattr(block.attn, "fused_projections", False) is False for block in int8_flux.transformer.transformer_blocks
    )


def test_qkv_fused_before_apply_is_quantized_and_runs() -> None:
    pipe = accel.load_pipeline("tiny-flux")
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.fuse_qkv_projections()
    handle = accel.apply(pipe, {"quant": {"type": "int8wo"}})
    assert "transformer_blocks.0.attn.to_qkv" in handle.quant.quantized
    assert torch.isfinite(pipe(**FLUX, output_type="latent").images).all()


# -- the contract harness ----------------------------------------------------------------------------
# Every family's smallest call: two steps (the second can reuse), FLUX's and Wan's as above, the
# others' parallel-test call at 32 px with 16 text tokens where the pipeline takes a length (a family
# case's contract_size and contract_steps where those do not serve).
REUSES = {"cache": {"threshold": 100.0}}  # every call after a step's first decision reuses


def family_call(pipe: Any, family: str) -> dict[str, Any]:
    if family in ("flux", "wan"):
        return dict(FLUX if family == "flux" else WAN)
    call = dict(
        FAMILY_CASES[family].call,
        num_inference_steps=FAMILY_CASES[family].contract_steps,
        **FAMILY_CASES[family].contract_size,
    )
    if "max_sequence_length" in inspect.signature(pipe.__call__).parameters:
        call["max_sequence_length"] = 16
    return call


def per_prompt_keyword(pipe: Any, family: str) -> str | None:
    """num_images_per_prompt or num_videos_per_prompt, as the pipeline's signature names it."""
    parameters = inspect.signature(pipe.__call__).parameters
    found = [name for name in ("num_images_per_prompt", "num_videos_per_prompt") if name in parameters]
    return found[0] if found and FAMILY_CASES[family].one_per_prompt is None else None


def takes_callbacks(pipe: Any) -> bool:
    return "callback_on_step_end" in inspect.signature(pipe.__call__).parameters  # HunyuanVideo 1.5 takes none


def pixels_of(result: Any, pipe: Any) -> np.ndarray:
    """The output object's pixels: `frames` (video), `images`, Kandinsky 5's `image`, or the field the
    family names (Cosmos 3's one-sample `video`), as accel reads them."""
    from accel.generate import output_array

    return np.asarray(output_array(result, pipe))


def run_contract_calls(
    pipe: Any, family: str, capsys: pytest.CaptureFixture[str], as_np: bool = True
) -> dict[str, Any]:
    """The calls diffusers' pipeline tests make, as one family's pipeline takes them: two outputs per
    prompt through `return_dict=False` with `output_type="pt"`, numpy through the output object, and
    latents with a step callback reading `latents` and the progress bar on."""
    call = family_call(pipe, family)
    per_prompt = per_prompt_keyword(pipe, family)
    pt = pipe(
        **call,
        **({per_prompt: 2} if per_prompt else {}),
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
        return_dict=False,
    )
    assert isinstance(pt, tuple)
    pixels = (
        pixels_of(pipe(**call, generator=torch.Generator().manual_seed(0), output_type="np"), pipe) if as_np else None
    )
    seen: list[torch.Tensor] = []

    def on_step_end(pipeline: Any, step: int, timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        seen.append(tensors["latents"].clone())
        return tensors

    callback = (
        dict(callback_on_step_end=on_step_end, callback_on_step_end_tensor_inputs=["latents"])
        if takes_callbacks(pipe)
        else {}
    )
    capsys.readouterr()
    pipe.set_progress_bar_config(disable=False)
    try:
        latent = pipe(
            **call, **callback, generator=torch.Generator().manual_seed(0), output_type="latent", return_dict=False
        )[0]
    finally:
        pipe.set_progress_bar_config(disable=True)
    steps = call["num_inference_steps"]
    return dict(pt=pt[0], np=pixels, latent=latent, seen=seen, bar=f"{steps}/{steps}" in capsys.readouterr().err)


def assert_consistent(outputs: dict[str, Any], plain: dict[str, Any]) -> None:
    """What holds within one pipeline whatever accelerates it, as it holds for the plain pipeline: a
    callback at every step, the last one seeing the latents returned where the plain one does, the
    same shapes (outputs per prompt), the bar counting the steps."""
    assert len(outputs["seen"]) == len(plain["seen"])
    if plain["seen"] and torch.equal(plain["seen"][-1], plain["latent"]):
        torch.testing.assert_close(outputs["seen"][-1], outputs["latent"], rtol=0, atol=0)
    assert outputs["pt"].shape == plain["pt"].shape and outputs["latent"].shape == plain["latent"].shape
    assert outputs["bar"] and plain["bar"]


def assert_equal_outputs(got: dict[str, Any], expected: dict[str, Any]) -> None:
    for key in ("pt", "latent"):
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0, msg=key)
    np.testing.assert_array_equal(got["np"], expected["np"])
    assert len(got["seen"]) == len(expected["seen"]) and got["bar"] == expected["bar"]
    for mine, theirs in zip(got["seen"], expected["seen"]):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


FAMILY_NAMES = list(FAMILY_CASES)
_shared: dict[str, Any] = {}
_plain: dict[str, dict[str, Any]] = {}


def fresh_pipeline(family: str) -> Any:
    pipe = FAMILIES[family].tiny()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def shared_pipeline(request: pytest.FixtureRequest, family: str) -> Any:
    """The family's tiny pipeline, built once (FLUX's and Wan's are the session's); tests leave it plain."""
    if family in ("flux", "wan"):
        return request.getfixturevalue(f"tiny_{family}")
    if family not in _shared:
        _shared[family] = fresh_pipeline(family)
    return _shared[family]


def plain_outputs(request: pytest.FixtureRequest, family: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """The plain pipeline's contract calls, once per family (the seeded tiny weights are the same in
    every fresh copy, so fresh pipelines compare against these too)."""
    if family not in _plain:
        _plain[family] = run_contract_calls(shared_pipeline(request, family), family, capsys)
    return _plain[family]


def processor_types(transformer: torch.nn.Module) -> dict[str, type]:
    """The attention processors in place (Mochi's and Z-Image's transformers list none themselves)."""
    return {
        name: type(module.processor) for name, module in transformer.named_modules() if hasattr(module, "processor")
    }


def latent_call(pipe: Any, family: str) -> torch.Tensor:
    call = family_call(pipe, family)
    return pipe(**call, generator=torch.Generator().manual_seed(0), output_type="latent", return_dict=False)[0]


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_contract_with_the_cache_equals_the_plain_pipeline(
    request: pytest.FixtureRequest, family: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Never reusing, the applied pipeline is the plain one bit for bit: after `to("cpu")`, attention
    slicing (a no-op for every DiT pipeline in diffusers 0.42: no component has `set_attention_slice`)
    and a scheduler swap, and under model CPU offload onto the CPU; reusing, it keeps the contract."""
    pipe = shared_pipeline(request, family)
    plain = plain_outputs(request, family, capsys)
    processors = processor_types(pipe.transformer)
    handle = accel.apply(pipe, NEVER_REUSES)  # every accelerator wrapper in place, no step reused
    scheduler = pipe.scheduler
    try:
        applied = processor_types(pipe.transformer)
        pipe.to("cpu")
        pipe.enable_attention_slicing()
        assert processor_types(pipe.transformer) == applied  # accel's kept
        pipe.scheduler = copy.deepcopy(scheduler)  # a component swap: the copy runs as it would without accel
        never = run_contract_calls(pipe, family, capsys)
        assert handle.cache_stats.calls > 0 and handle.cache_stats.cached == 0
        assert_equal_outputs(never, plain)
        before = handle.cache_stats.records
        pipe.enable_model_cpu_offload(device="cpu")  # accelerate's hooks over accel's wrappers, onto the CPU
        try:
            offloaded = latent_call(pipe, family)
        finally:
            pipe.remove_all_hooks()
        assert handle.cache_stats.records != before and handle.cache_stats.cached == 0  # accel's wrappers acted
        torch.testing.assert_close(offloaded, plain["latent"], rtol=0, atol=0)
    finally:
        pipe.scheduler = scheduler
        pipe.disable_attention_slicing()
        handle.remove()
    assert processor_types(pipe.transformer) == processors

    handle = accel.apply(pipe, REUSES)
    try:
        reusing = run_contract_calls(pipe, family, capsys, as_np=False)
        assert handle.cache_stats.cached > 0
        assert_consistent(reusing, plain)
    finally:
        handle.remove()


def group_offloaded(pipe: Any, folder: Path) -> Any:
    pipe.transformer.enable_group_offload(
        torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1, offload_to_disk_path=str(folder)
    )
    return pipe


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_group_offload_after_apply_equals_the_plain_pipeline(family: str, tmp_path: Path) -> None:
    """diffusers' block-level group offload over accel's wrappers, onto the CPU from the disk: each group's
    weights are emptied after it runs and read back before, so a wrapper that bypassed the hooks would
    compute on garbage. Equal to the same offload without accel (the disk round trip itself moves FLUX
    by 2e-7), and `remove()` under the hooks undoes exactly. Fresh pipelines: diffusers has no public
    way to turn group offload off."""
    expected = latent_call(group_offloaded(fresh_pipeline(family), tmp_path / "plain"), family)
    pipe = fresh_pipeline(family)
    handle = accel.apply(pipe, NEVER_REUSES)
    group_offloaded(pipe, tmp_path / "applied")
    try:
        torch.testing.assert_close(latent_call(pipe, family), expected, rtol=0, atol=0)
        assert handle.cache_stats.calls > 0
    finally:
        handle.remove()
    assert any((tmp_path / "applied").glob("*.safetensors"))  # the weights went through the disk
    torch.testing.assert_close(latent_call(pipe, family), expected, rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_contract_with_int8_weights(
    request: pytest.FixtureRequest, family: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """int8 weights change the numbers, not the contract (a fresh pipeline: quantization stays)."""
    plain = plain_outputs(request, family, capsys)
    pipe = fresh_pipeline(family)
    handle = accel.apply(pipe, {"quant": {"type": "int8wo"}})
    assert handle.quant.quantized
    assert_consistent(run_contract_calls(pipe, family, capsys, as_np=False), plain)


def test_offload_refusals_are_diffusers_own_with_accel_applied(tiny_flux: Any) -> None:
    """What diffusers refuses on a CPU-only machine it refuses the same with accel applied, and the
    pipeline still runs after."""

    def refusals() -> list[str]:
        found = []
        for action in (
            tiny_flux.enable_model_cpu_offload,
            lambda: tiny_flux.transformer.enable_group_offload(
                torch.device("cpu"), num_blocks_per_group=1, use_stream=True
            ),
        ):
            with pytest.raises((RuntimeError, ValueError)) as caught:
                action()
            found.append(f"{type(caught.value).__name__}: {caught.value}")
        return found

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine offloads: the refusals are CPU-only")
    plain = refusals()
    assert plain[0] == "RuntimeError: `enable_model_cpu_offload` requires accelerator, but not found"
    handle = accel.apply(tiny_flux, NEVER_REUSES)
    try:
        assert refusals() == plain
        tiny_flux(**FLUX, output_type="latent")
        assert handle.cache_stats.calls == 2
    finally:
        handle.remove()


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU: to('cuda'), offload onto it, streamed group offload"
)
@pytest.mark.parametrize("placement", ["to", "model_offload", "group_offload_stream"])
def test_placement_on_the_gpu_after_apply_equals_the_plain_pipeline(placement: str) -> None:
    """Applied on the CPU, then placed on the GPU as a user would: the plain pipeline's latents on the
    GPU, with accel's wrappers acting; streamed group offload also with a cache that reuses (a cached
    step skips blocks, whose prefetch diffusers falls back from)."""

    def place(pipe: Any) -> None:
        if placement == "to":
            pipe.to("cuda")
        elif placement == "model_offload":
            pipe.enable_model_cpu_offload()
        else:
            pipe.to("cuda")
            pipe.transformer.to("cpu")
            pipe.transformer.enable_group_offload(
                torch.device("cuda"), offload_type="block_level", num_blocks_per_group=1, use_stream=True
            )

    plain_pipe = fresh_pipeline("flux")
    place(plain_pipe)
    plain = latent_call(plain_pipe, "flux")
    for recipe in [NEVER_REUSES] + ([REUSES] if placement == "group_offload_stream" else []):
        pipe = fresh_pipeline("flux")
        handle = accel.apply(pipe, recipe)
        place(pipe)
        got = latent_call(pipe, "flux")
        assert handle.cache_stats.calls > 0
        if recipe is NEVER_REUSES:
            torch.testing.assert_close(got, plain, rtol=0, atol=0)
        else:
            reference = fresh_pipeline("flux").to("cuda")
            reference_handle = accel.apply(reference, recipe)
            torch.testing.assert_close(got, latent_call(reference, "flux"), rtol=0, atol=0)
            assert handle.cache_stats.cached == reference_handle.cache_stats.cached > 0


def test_int8_pickle_save_round_trip_loads_the_same_pipeline(int8_flux: Any, tmp_path: Path) -> None:
    expected = latent_call(int8_flux, "flux")
    int8_flux.transformer.save_pretrained(tmp_path, safe_serialization=False)  # what pipe.save_pretrained writes for it
    transformer = type(int8_flux.transformer).from_pretrained(tmp_path)
    assert type(transformer.transformer_blocks[0].attn.to_q.weight).__name__ == "Int8Tensor"
    assert wrappers(transformer.transformer_blocks[0], "save_pretrained") == []  # plain modules: no wrapper was saved
    loaded = FluxPipeline.from_pipe(int8_flux, transformer=transformer)
    torch.testing.assert_close(latent_call(loaded, "flux"), expected, rtol=0, atol=0)


# Where diffusers 0.42 itself fails after `to(torch.float64)` (Kandinsky 5 projects float32 text
# embeddings with float64 weights), the applied pipeline must fail the same way.
FLOAT64_FAILS = {"kandinsky5": "RuntimeError: mat1 and mat2 must have the same dtype, but got Float and Double"}


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_applied_pipeline_saves_plain_modules_and_follows_to_dtype(family: str, tmp_path: Path) -> None:
    """`to(dtype)` after apply keeps accel's wrappers acting, equal to the plain pipeline changed the same
    way (or failing as it does); `save_pretrained` of an applied pipeline writes plain modules that load
    back unwrapped."""
    if FAMILY_CASES[family].no_reload:
        pytest.skip(FAMILY_CASES[family].no_reload)

    def run(pipe: Any) -> torch.Tensor | str:
        try:
            return latent_call(pipe, family)
        except RuntimeError as error:
            return f"{type(error).__name__}: {error}"

    plain_pipe = fresh_pipeline(family)
    expected_state = plain_pipe.transformer.state_dict()
    plain = run(plain_pipe.to(torch.float64))
    pipe = fresh_pipeline(family)
    handle = accel.apply(pipe, NEVER_REUSES)
    try:
        pipe.save_pretrained(tmp_path)  # safetensors: nothing quantized
        pipe.to(torch.float64)
        applied = run(pipe)
        assert pipe.transformer.dtype == torch.float64
        assert handle.cache_stats.calls > 0 or family in FLOAT64_FAILS
    finally:
        handle.remove()
    if family in FLOAT64_FAILS:
        assert applied == plain == FLOAT64_FAILS[family]
    else:
        torch.testing.assert_close(applied, plain, rtol=0, atol=0)
    loaded = type(pipe).from_pretrained(tmp_path, dtype=torch.float32)
    assert [name for name, module in loaded.transformer.named_modules() if wrappers(module, "forward")] == []
    saved = loaded.transformer.state_dict()
    assert sorted(saved) == sorted(expected_state)
    for name, tensor in expected_state.items():
        torch.testing.assert_close(saved[name], tensor, rtol=0, atol=0, msg=name)
