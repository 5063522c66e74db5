"""Functions the rank pool runs on every rank for test_interop (diffusers features used beside accel).

Each builds a fresh tiny pipeline, since the features under test (attention backends, diffusers'
cache, LoRA, quantization) change a pipeline for good or until undone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import parallel_cases

import accel
from accel.errors import UserError

FLUX_CALL = dict(prompt="a red fox", height=64, width=64, num_inference_steps=4, guidance_scale=3.5)


def fresh_flux() -> Any:
    pipe = accel.load_pipeline("tiny-flux")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe: Any, seed: int = 0, **extra: Any) -> np.ndarray:
    call = FLUX_CALL | {"output_type": "np"} | extra
    return np.asarray(pipe(**call, generator=torch.Generator().manual_seed(seed)).images)


def error_of(action: Callable[[], Any]) -> str:
    """`Type: message` of the accel error `action` stops with, or "no error"."""
    try:
        action()
    except UserError as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


# -- attention backends ---------------------------------------------------------------------------
@contextmanager
def global_backend_kept() -> Iterator[None]:
    """Put diffusers' global attention backend back afterwards: `set_attention_backend` sets it for
    the whole process, not only for the transformer it is called on."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    saved = _AttentionBackendRegistry._active_backend
    try:
        yield
    finally:
        _AttentionBackendRegistry.set_active_backend(saved)


@global_backend_kept()
def backend_refusal(backend: str, where: str) -> tuple[str, float]:
    """(the error apply(Ulysses 2) stops with, seconds it took) with `backend` set on the processors
    (`where` = "processors") or as diffusers' global default ("default", what DIFFUSERS_ATTN_BACKEND sets)."""
    from diffusers.models.attention_dispatch import attention_backend

    pipe = fresh_flux()
    start = time.perf_counter()
    if where == "processors":
        pipe.transformer.set_attention_backend(backend)
        message = error_of(lambda: accel.apply(pipe, {"parallel": {"ulysses": 2}}))
    else:
        with attention_backend(backend):
            message = error_of(lambda: accel.apply(pipe, {"parallel": {"ulysses": 2}}))
    assert "forward" not in vars(pipe.transformer), "a refused apply leaves nothing behind"
    return message, time.perf_counter() - start


@global_backend_kept()
def backend_after_apply(backend: str) -> str:
    """The error a Ulysses 2 generation stops with when `backend` is set after apply."""
    pipe = fresh_flux()
    handle = accel.apply(pipe, {"parallel": {"ulysses": 2}})
    try:
        pipe.transformer.set_attention_backend(backend)
        return error_of(lambda: generate(pipe))
    finally:
        handle.remove()


@global_backend_kept()
def native_backend_output() -> np.ndarray:
    """Ulysses 2 with the native backend set explicitly on every processor."""
    pipe = fresh_flux()
    pipe.transformer.set_attention_backend("native")
    handle = accel.apply(pipe, {"parallel": {"ulysses": 2}})
    try:
        return generate(pipe)
    finally:
        handle.remove()


class HandAttention(torch.nn.Module):
    """Joint (text, image) attention over 2 heads computed by hand (matmul + softmax), never through SDPA."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        img_ids: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        txt_ids: torch.Tensor,
        controlnet_block_samples: None = None,
        controlnet_single_block_samples: None = None,
    ) -> torch.Tensor:  # FLUX's arguments the plan names
        x = self.heads(torch.cat([encoder_hidden_states, hidden_states], dim=1))
        out = self.attend(x)
        return out.transpose(1, 2).flatten(2)[:, encoder_hidden_states.shape[1] :]

    @staticmethod
    def heads(x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(2, (2, -1)).transpose(1, 2)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x @ x.transpose(-1, -2) / x.shape[-1] ** 0.5, dim=-1) @ x


class SdpaAttention(HandAttention):
    def attend(self, x: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(x, x, x)


def toy_attention_runs() -> tuple[str, float]:
    """(the error HandAttention stops with under Ulysses 2, max-abs difference of SdpaAttention under
    Ulysses 2 from one process)."""
    from toy_transformers import FLUX_HAND_PLAN

    from accel.parallel.mesh import Degrees, build_mesh
    from accel.parallel.engine import ContextParallel

    mesh = build_mesh(Degrees(ulysses=2), "cpu")
    generator = torch.Generator().manual_seed(0)
    inputs = (
        torch.randn(1, 6, 8, generator=generator),
        torch.zeros(6, 3),
        torch.randn(1, 4, 8, generator=generator),
        torch.zeros(4, 3),
    )
    hand, sdpa = HandAttention(), SdpaAttention()
    expected = sdpa(*inputs)
    assert torch.allclose(hand(*inputs), expected, atol=1e-5)  # the same attention, computed two ways
    engines = [ContextParallel(module, FLUX_HAND_PLAN, mesh) for module in (hand, sdpa)]
    try:
        return error_of(lambda: hand(*inputs)), (sdpa(*inputs) - expected).abs().max().item()
    finally:
        for engine in engines:
            engine.remove()


# -- diffusers' own cache -------------------------------------------------------------------------
def _fbcache_config() -> Any:
    from diffusers.hooks import FirstBlockCacheConfig

    return FirstBlockCacheConfig(threshold=0.4)


def diffusers_cache_refusal(when: str) -> tuple[str, float]:
    """(error, seconds) of Ulysses 2 with diffusers' cache enabled `when` = "before" apply or "after"
    it (then the generation stops)."""
    pipe = fresh_flux()
    start = time.perf_counter()
    if when == "before":
        pipe.transformer.enable_cache(_fbcache_config())
        return error_of(lambda: accel.apply(pipe, {"parallel": {"ulysses": 2}})), time.perf_counter() - start
    handle = accel.apply(pipe, {"parallel": {"ulysses": 2}})
    try:
        pipe.transformer.enable_cache(_fbcache_config())
        start = time.perf_counter()
        message = error_of(lambda: generate(pipe))
        dist.barrier()  # both ranks are free for the next collective: nothing was left half done
        return message, time.perf_counter() - start
    finally:
        handle.remove()


# -- LoRA -----------------------------------------------------------------------------------------
def make_lora(directory: str, seed: int = 0, targets: tuple[str, ...] = ("to_q", "to_k", "to_v")) -> None:
    """Save a seeded random LoRA (rank 4 on `targets`) for tiny-flux in diffusers' format
    (directory/pytorch_lora_weights.safetensors)."""
    from diffusers import FluxPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    transformer = fresh_flux().transformer
    with torch.random.fork_rng():
        torch.manual_seed(seed)  # init_lora_weights=False: lora_B is random too, so the LoRA changes the image
        transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=list(targets), init_lora_weights=False))
    FluxPipeline.save_lora_weights(directory, transformer_lora_layers=get_peft_model_state_dict(transformer))


def fused_lora_run(lora: str, recipe: dict[str, Any]) -> np.ndarray:
    """The image of tiny-flux loaded with `[model] lora` fused in, under `recipe`."""
    pipe = accel.load_pipeline("tiny-flux", lora=[lora])
    pipe.set_progress_bar_config(disable=True)
    handle = accel.apply(pipe, recipe)
    try:
        return generate(pipe)
    finally:
        handle.remove()


def lora_after_apply(lora_dir: str, recipe: dict[str, Any] | None) -> list[np.ndarray]:
    """Images of a LoRA loaded after `apply(recipe)` (None: no accel at all), then fused, then unfused
    and unloaded."""
    pipe = fresh_flux()
    handle = accel.apply(pipe, recipe) if recipe is not None else None
    try:
        pipe.load_lora_weights(lora_dir, adapter_name="test")
        loaded = generate(pipe)
        pipe.fuse_lora()
        fused = generate(pipe)
        pipe.unfuse_lora()
        pipe.unload_lora_weights()
        return [loaded, fused, generate(pipe)]
    finally:
        if handle is not None:
            handle.remove()


# -- global random state --------------------------------------------------------------------------
def noisy_callback(pipe: Any, step: int, timestep: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A step callback that draws from the global random state."""
    latents = kwargs["latents"]
    return {"latents": latents + 0.1 * torch.randn(latents.shape)}


def callback_noise_output(recipe: dict[str, Any], seed_base: int) -> np.ndarray:
    """Output under `recipe` when each rank's global RNG is seeded `seed_base + rank` before the call."""
    pipe = fresh_flux()
    handle = accel.apply(pipe, recipe)
    try:
        torch.manual_seed(seed_base + dist.get_rank())
        return generate(pipe, callback_on_step_end=noisy_callback)
    finally:
        handle.remove()


# -- output forms ---------------------------------------------------------------------------------
def output_forms(recipe: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """(latents of output_type="latent", images of return_dict=False) under `recipe`."""
    pipe = fresh_flux()
    handle = accel.apply(pipe, recipe)
    try:
        latents = pipe(**FLUX_CALL, output_type="latent", generator=torch.Generator().manual_seed(0)).images
        images = pipe(**FLUX_CALL, output_type="np", return_dict=False, generator=torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    assert isinstance(images, tuple) and len(images) == 1
    return np.asarray(latents), np.asarray(images[0])


def switched_lora_outputs(
    registered: dict[str, str], asked: list[Any], call: dict[str, Any], recipe: dict[str, Any], key: str
) -> list[np.ndarray]:
    """tiny-flux (a copy of its own, by `key`) under `recipe`, its adapters switched per request as
    accel serve switches them, in the order `asked`: each output at seed 5."""
    from accel.serve.loras import Adapters

    pipe = parallel_cases.tiny_pipeline("tiny-flux", key=key)
    handle = accel.apply(pipe, recipe)
    adapters = Adapters(pipe, registered, most=2, compiled=bool(recipe.get("compile", {}).get("enabled")))
    try:
        outputs = []
        for chosen in asked:
            adapters.use(tuple(chosen))
            outputs.append(pipe(**call, generator=torch.Generator().manual_seed(5), output_type="np").images)
        return outputs
    finally:
        handle.remove()
