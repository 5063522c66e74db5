"""The one place that picks the local attention kernel returning (out, log-sum-exp).

Ring attention needs each block's log-sum-exp to merge partial outputs, which plain
`F.scaled_dot_product_attention` does not return; the aten kernels below do. `choose_kernel` is
a pure function of what is known on the host (device, dtype, head size, mask, GPU generation),
so the choice is tested without a GPU and never reads tensor data.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

Kernel = Literal["cpu_flash", "flash", "cudnn", "efficient", "reference"]

# cuDNN's fused attention is the fastest bf16 kernel on Hopper (sm90) and later; on older GPUs
# flash is as fast and has been exercised longer.
CUDNN_MIN_CAPABILITY = (9, 0)


def choose_kernel(
    device_type: str,
    dtype: torch.dtype,
    head_dim: int,
    masked: bool,
    capability: tuple[int, int] | None,
    enabled: frozenset[str] = frozenset({"flash", "cudnn", "efficient"}),
) -> Kernel:
    """The kernel for one local attention call. `capability`: the CUDA GPU's (None: unknown, as
    under fake tensors); `enabled`: torch's SDPA backends the user left on (`sdpa_kernel`)."""
    if device_type == "cpu":
        return "cpu_flash"
    if device_type != "cuda":
        return "reference"
    half = dtype in (torch.float16, torch.bfloat16)
    if (
        half
        and not masked
        and head_dim <= 128
        and "cudnn" in enabled
        and capability is not None
        and capability >= CUDNN_MIN_CAPABILITY
    ):
        return "cudnn"
    if half and not masked and head_dim <= 256 and "flash" in enabled:
        return "flash"
    if "efficient" in enabled:
        return "efficient"
    return "reference"


def cuda_capability(index: int) -> tuple[int, int] | None:
    """The GPU's compute capability (None where torch sees no CUDA: fake tensors on a CPU build)."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(index)


@torch.compiler.assume_constant_result
def _cuda_kernel(index: int, dtype: torch.dtype, head_dim: int, masked: bool) -> str:
    """The choice on this GPU, from host facts only; compiled code takes it as a constant rather
    than tracing torch's backend switches."""
    return choose_kernel("cuda", dtype, head_dim, masked, cuda_capability(index), enabled_backends())


def enabled_backends() -> frozenset[str]:
    """torch's global SDPA switches (set by `torch.nn.attention.sdpa_kernel`), honoured here too."""
    switches = {
        "flash": torch.backends.cuda.flash_sdp_enabled,
        "cudnn": getattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: False),
        "efficient": torch.backends.cuda.mem_efficient_sdp_enabled,
    }
    return frozenset(name for name, enabled in switches.items() if enabled())


def attention_with_lse(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None = None, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """Softmax attention over (B, H, S, D) tensors: (out in q's dtype, lse float32 of shape (B, H, Sq)).

    `bias` is additive (0 or -inf), broadcastable to (B, H, Sq, Sk), in q's dtype.
    """
    if q.device.type == "cuda":
        kernel = _cuda_kernel(q.device.index or 0, q.dtype, q.shape[-1], bias is not None)
    else:
        kernel = choose_kernel(q.device.type, q.dtype, q.shape[-1], bias is not None, None)
    return KERNELS[kernel](q, k, v, bias, scale)


def _cpu_flash(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale: float | None) -> tuple[Tensor, Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias, scale=scale)
    return out, lse.float()


def _flash(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale: float | None) -> tuple[Tensor, Tensor]:
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
    return out, lse.float()


def _cudnn(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale: float | None) -> tuple[Tensor, Tensor]:
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, False, False, scale=scale
    )
    return out, lse.reshape(q.shape[:-1]).float()  # cuDNN returns (B, H, Sq, 1)


def _efficient(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale: float | None) -> tuple[Tensor, Tensor]:
    if bias is not None:
        bias = _aligned_bias(bias, q, k)
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, False, scale=scale)
    return out, lse[..., : q.shape[-2]].float()  # the efficient kernel pads lse to a multiple of 32


def _aligned_bias(bias: Tensor, q: Tensor, k: Tensor) -> Tensor:
    """The memory-efficient kernel wants the bias's last dim stored on a 16-element boundary."""
    batch, heads, q_len, k_len = q.shape[0], q.shape[1], q.shape[-2], k.shape[-2]
    padded = math.ceil(k_len / 16) * 16
    storage = bias.new_zeros(*bias.shape[:-1], padded)
    storage[..., :k_len] = bias
    return storage[..., :k_len].expand(batch, heads, q_len, k_len)


def reference_attention_with_lse(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None = None, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """Plain float32 math: the fallback for other devices and the tests' yardstick."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias.float()
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return (weights @ v.float()).to(q.dtype), lse


KERNELS = {
    "cpu_flash": _cpu_flash,
    "flash": _flash,
    "cudnn": _cudnn,
    "efficient": _efficient,
    "reference": reference_attention_with_lse,
}
