"""CUDA-only checks, skipped on a machine without an NVIDIA GPU (all development and CI machines):
the local attention kernels against the float32 reference, and tiny-flux on the GPU with the
cache, quantization and compile. `make gpu-check` runs this file on a borrowed GPU; the CPU suite
proves the same logic everywhere else, these prove the CUDA kernels and device paths themselves."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from conftest import FLUX_CALL, generate

import accel
from accel.cache.fbcache import FirstBlockCache
from accel.models.registry import FAMILIES
from accel.parallel.kernels import attention_with_lse, choose_kernel, enabled_backends, reference_attention_with_lse
from accel.quality import psnr

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability(0)


# --- attention kernels ------------------------------------------------------------------------------

# Forcing one torch SDPA backend (the switches attention_with_lse honours) selects that kernel.
BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}
# bf16 inputs, float32 accumulation in every kernel: out differs from the float32 reference by the
# rounding of the softmax weights to bf16 (a few 1e-3 at these sizes); lse is accumulated in float32.
OUT_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}
LSE_TOLERANCE = 2e-3


def qkv(
    dtype: torch.dtype, q_len: int, k_len: int, dim: int = 128, seq_major: bool = False
) -> tuple[torch.Tensor, ...]:
    """(B, H, S, D) tensors; `seq_major`: stored as (B, S, H, D) and transposed, as models hand them to SDPA."""
    generator = torch.Generator("cuda").manual_seed(0)

    def make(n: int) -> torch.Tensor:
        if seq_major:
            return torch.randn(2, n, 4, dim, generator=generator, device="cuda", dtype=dtype).transpose(1, 2)
        return torch.randn(2, 4, n, dim, generator=generator, device="cuda", dtype=dtype)

    return make(q_len), make(k_len), make(k_len)


def assert_matches_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None, scale: float | None = None
) -> None:
    out, lse = attention_with_lse(q, k, v, bias, scale)
    ref_out, ref_lse = reference_attention_with_lse(q, k, v, bias, scale)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert lse.shape == q.shape[:-1] and lse.dtype == torch.float32
    tolerance = OUT_TOLERANCE[q.dtype]
    torch.testing.assert_close(out.float(), ref_out.float(), atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(lse, ref_lse, atol=LSE_TOLERANCE, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernel", list(BACKENDS))
def test_unmasked_kernel_matches_reference(kernel: str, dtype: torch.dtype) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if kernel == "cudnn" and capability() < (9, 0):
        pytest.skip(f"cuDNN attention is chosen on compute capability 9.0 or newer; this GPU is {capability()}")
    q, k, v = qkv(dtype, 300, 300)  # not a multiple of any tile size
    with sdpa_kernel([getattr(SDPBackend, BACKENDS[kernel])]):
        assert choose_kernel("cuda", dtype, 128, False, capability(), enabled_backends()) == kernel
        assert_matches_reference(q, k, v)
        # A ring hop (fewer queries than keys), in the strides models give, with an explicit scale.
        assert_matches_reference(*qkv(dtype, 77, 300, seq_major=True), scale=0.3)


def test_default_choice_matches_reference() -> None:
    """No backend forced: the kernel attention_with_lse picks on this GPU (cuDNN on Hopper, else flash)."""
    q, k, v = qkv(torch.bfloat16, 1000, 1000)
    assert choose_kernel("cuda", q.dtype, 128, False, capability(), enabled_backends()) == (
        "cudnn" if capability() >= (9, 0) else "flash"
    )
    assert_matches_reference(q, k, v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_masked_keys_use_the_efficient_kernel_and_are_ignored(dtype: torch.dtype) -> None:
    """Padded keys (the last ones of a sequence padded to the parallel degree) masked with -inf."""
    q, k, v = qkv(dtype, 256, 321)
    bias = torch.zeros(2, 1, 1, 321, device="cuda", dtype=dtype)
    bias[..., 300:] = float("-inf")
    assert choose_kernel("cuda", dtype, 128, True, capability(), enabled_backends()) == "efficient"
    assert_matches_reference(q, k, v, bias)
    out, lse = attention_with_lse(q, k, v, bias)
    noisy = v.clone()
    noisy[:, :, 300:] = 1e3  # whatever the pad keys hold must not reach the output
    again, again_lse = attention_with_lse(q, k, noisy, bias)
    torch.testing.assert_close(again, out, atol=0, rtol=0)
    torch.testing.assert_close(again_lse, lse, atol=0, rtol=0)


def test_unmasked_float32_matches_reference() -> None:
    q, k, v = qkv(torch.float32, 200, 200, dim=64)
    assert choose_kernel("cuda", q.dtype, 64, False, capability(), enabled_backends()) == "efficient"
    assert_matches_reference(q, k, v)


# --- tiny-flux on the GPU -------------------------------------------------------------------------

# The transformer's matmuls run in exact float32 (TF32 is off for matmuls by default), but cuDNN
# convolutions in the VAE use TF32 by default: pixels then differ from the CPU run by ~1e-3.
CPU_TOLERANCE = 1e-2
COMPILE_TOLERANCE = 1e-3  # inductor's Triton kernels reorder float32 sums
# int8wo: the CPU floor (tests/test_quant.py; seen 82 dB on tiny-flux). fp8dq, run in bfloat16 as on
# real models: per-row e4m3 weights and activations emulated on the CPU gave 49.9 dB against the
# unquantized bf16 pipeline; the floor leaves room for the GPU's own rounding and still fails garbage.
MIN_PSNR = {"int8wo": 60.0, "fp8dq": 35.0}


def cuda_pipeline(dtype: str = "float32") -> Any:
    pipe = accel.load_pipeline("tiny-flux", dtype=dtype, device="cuda")
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def cuda_flux() -> Any:
    return cuda_pipeline()


@pytest.fixture(scope="module")
def cuda_reference(cuda_flux: Any) -> np.ndarray:
    return generate(cuda_flux, FLUX_CALL)


def test_cuda_pipeline_matches_the_cpu_one(
    cuda_flux: Any, cuda_reference: np.ndarray, flux_reference: np.ndarray
) -> None:
    assert next(cuda_flux.transformer.parameters()).device.type == "cuda"
    assert np.abs(cuda_reference - flux_reference).max() <= CPU_TOLERANCE


def test_cache_off_is_identical_and_on_skips_after_warmup(cuda_flux: Any, cuda_reference: np.ndarray) -> None:
    steps = FLUX_CALL["num_inference_steps"]
    never = FirstBlockCache(cuda_flux.transformer, FAMILIES["flux"].blocks, threshold=0.0)
    try:
        np.testing.assert_array_equal(generate(cuda_flux, FLUX_CALL), cuda_reference)
        assert never.stats.calls == steps and never.stats.cached == 0
    finally:
        never.remove()
    handle = accel.apply(cuda_flux, {"cache": {"threshold": 1e9, "warmup_steps": 2}})
    try:
        cached = generate(cuda_flux, FLUX_CALL)
        assert [r.cached for r in handle.cache_stats.records] == [False, False] + [True] * (steps - 2)
    finally:
        handle.remove()
    assert not np.array_equal(cached, cuda_reference), "skipping blocks must change the output"
    np.testing.assert_array_equal(generate(cuda_flux, FLUX_CALL), cuda_reference)  # remove() restores it


def test_regional_compile_equals_eager_without_recompiling(cuda_flux: Any, cuda_reference: np.ndarray) -> None:
    handle = accel.apply(cuda_flux, {"compile": {"enabled": True}})
    try:
        first = generate(cuda_flux, FLUX_CALL)
        with torch._dynamo.config.patch(error_on_recompile=True):
            second = generate(cuda_flux, FLUX_CALL)
    finally:
        handle.remove()
    assert np.abs(first - cuda_reference).max() <= COMPILE_TOLERANCE
    assert np.abs(second - cuda_reference).max() <= COMPILE_TOLERANCE
    np.testing.assert_array_equal(generate(cuda_flux, FLUX_CALL), cuda_reference)  # eager again after remove()


@pytest.mark.parametrize("scheme, dtype", [("int8wo", "float32"), ("fp8dq", "bfloat16")])
def test_quantized_output_is_within_the_stated_psnr(scheme: str, dtype: str) -> None:
    if scheme == "fp8dq" and capability() < (8, 9):
        pytest.skip(f"fp8dq needs compute capability 8.9 or newer; this GPU is {capability()}")
    pipe = cuda_pipeline(dtype)  # quantization replaces weights for good: a pipeline of its own
    reference = generate(pipe, FLUX_CALL)
    handle = accel.apply(pipe, {"quant": {"type": scheme}})
    output = generate(pipe, FLUX_CALL)
    assert handle.quant.quantized, "no layer was quantized"
    weights = [layer.weight for layer in pipe.transformer.modules() if isinstance(layer, torch.nn.Linear)]
    assert any(type(w.data) is not torch.Tensor for w in weights) and all(w.device.type == "cuda" for w in weights)
    assert np.abs(output - reference).max() > 0  # it did change the weights
    assert psnr(output, reference) >= MIN_PSNR[scheme]
