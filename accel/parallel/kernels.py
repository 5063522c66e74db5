"""The one place that picks the local attention kernel returning (out, log-sum-exp).

Ring attention needs each block's log-sum-exp to merge partial outputs, which plain
`F.scaled_dot_product_attention` does not return; the aten kernels below do.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None = None, scale: float | None = None) -> tuple[Tensor, Tensor]:
    """Softmax attention over (B, H, S, D) tensors: (out in q's dtype, lse float32 of shape (B, H, Sq)).

    `bias` is additive (0 or -inf), broadcastable to (B, H, Sq, Sk), in q's dtype.
    """
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias, scale=scale)
        return out, lse.float()
    if q.device.type == "cuda":
        return _cuda_attention_with_lse(q, k, v, bias, scale)
    return reference_attention_with_lse(q, k, v, bias, scale)


def _flash_fits(dtype: torch.dtype, masked: bool) -> bool:
    return dtype in (torch.float16, torch.bfloat16) and not masked


def _cuda_attention_with_lse(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale: float | None) -> tuple[Tensor, Tensor]:
    if _flash_fits(q.dtype, bias is not None) and q.shape[-1] <= 256:
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
        return out, lse.float()
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


def reference_attention_with_lse(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None = None, scale: float | None = None) -> tuple[Tensor, Tensor]:
    """Plain float32 math: the fallback for other devices and the tests' yardstick."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias.float()
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return (weights @ v.float()).to(q.dtype), lse
