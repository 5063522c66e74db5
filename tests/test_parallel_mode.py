"""The SDPA router: only calls made while it is active are routed, and unsupported calls are refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from toy_transformers import FLUX_HAND_PLAN

from accel.errors import NotAvailableError
from accel.parallel.mesh import Degrees, ParallelMesh
from accel.parallel.mode import AttentionRouter, key_mask
from accel.parallel.engine import ContextParallel


def test_only_sdpa_inside_the_router_is_routed() -> None:
    calls: list[tuple[int, ...]] = []

    def attend(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None
    ) -> torch.Tensor:
        calls.append((*q.shape, scale))
        return torch.zeros_like(q)

    q = torch.randn(1, 2, 3, 4)
    with AttentionRouter(attend):
        routed = F.scaled_dot_product_attention(q, q, q, scale=0.5)
        other = torch.add(q, 1)  # every other torch function runs as usual
    outside = F.scaled_dot_product_attention(q, q, q)
    assert calls == [(1, 2, 3, 4, 0.5)]
    assert torch.equal(routed, torch.zeros_like(q)) and torch.equal(other, q + 1)
    assert torch.allclose(outside, F.softmax(q @ q.transpose(-1, -2) / 2, -1) @ q, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"attn_mask": torch.ones(3, 3, dtype=torch.bool)}, r"mask is not a boolean per-key mask \(shape \(3, 3\)"),
        ({"attn_mask": torch.ones(1, 2, 1, 3, dtype=torch.bool)}, "mask is not a boolean per-key mask"),
        (
            {"attn_mask": torch.zeros(1, 1, 1, 3)},
            r"mask is not a boolean per-key mask \(shape \(1, 1, 1, 3\), torch.float32\)",
        ),
        ({"is_causal": True}, "calls attention with a causal flag or dropout"),
        ({"dropout_p": 0.1}, "calls attention with a causal flag or dropout"),
    ],
)
def test_unsupported_calls_are_refused_not_computed_wrongly(kwargs: dict, message: str) -> None:
    q = torch.randn(1, 2, 3, 4)
    with AttentionRouter(lambda *a: q), pytest.raises(NotAvailableError, match=message):
        F.scaled_dot_product_attention(q, q, q, **kwargs)


@pytest.mark.parametrize("shape", [(3,), (1, 3), (1, 1, 3), (2, 1, 1, 3)])
def test_per_key_masks_reach_the_engine(shape: tuple[int, ...]) -> None:
    seen: list[torch.Tensor] = []
    q = torch.randn(2, 2, 3, 4)
    mask = torch.tensor([True, False, True]).expand(shape)
    with AttentionRouter(lambda q, k, v, m, s: seen.append(m) or q):
        F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    assert seen[0] is mask and key_mask(mask).shape == (shape[0] if len(shape) == 4 else 1, 3)


def test_a_pairwise_mask_reaches_the_engine_as_its_key_mask_where_the_plan_says_so() -> None:
    """HunyuanVideo 1.5 builds (B, 1, L, L) = m[q] & m[k] in every block: with `pairwise` the engine
    gets the per-key mask m (the diagonal); without, the square mask is refused as before."""
    seen: list[torch.Tensor] = []
    q = torch.randn(2, 2, 3, 4)
    token = torch.tensor([[True, False, True], [True, True, False]])
    square = token[:, None, :, None] & token[:, None, None, :]
    with AttentionRouter(lambda q, k, v, m, s: seen.append(m) or q, pairwise=True):
        F.scaled_dot_product_attention(q, q, q, attn_mask=square)
    assert torch.equal(key_mask(seen[0]), token)
    with (
        AttentionRouter(lambda *a: q),
        pytest.raises(NotAvailableError, match=r"not a boolean per-key mask \(shape \(2, 1, 3, 3\)"),
    ):
        F.scaled_dot_product_attention(q, q, q, attn_mask=square)


def test_a_whole_sequence_float_mask_reaches_the_engine_without_diffusers_padding() -> None:
    """LTX-2 IC-LoRA's (B, L, L) bias on a cut sequence of s tokens: diffusers' prepare_attention_mask
    appends s zero columns and repeats it per head, (B, H, L, L + s); the engine gets the (B, H, L, L)
    view, a whole-sequence pair mask."""
    from accel.parallel.mode import is_whole_pairwise

    seen: list[torch.Tensor] = []
    q = torch.randn(2, 4, 3, 8)  # 3 of the sequence's 7 tokens on this rank
    bias = torch.randn(2, 4, 7, 7)
    padded = F.pad(bias, (0, 3))
    with AttentionRouter(lambda q, k, v, m, s: seen.append(m) or q):
        F.scaled_dot_product_attention(q, q, q, attn_mask=padded)
    assert seen[0].shape == (2, 4, 7, 7) and seen[0].data_ptr() == padded.data_ptr() and torch.equal(seen[0], bias)
    assert is_whole_pairwise(seen[0], 3) and not is_whole_pairwise(seen[0], 7)


def test_local_calls_keep_plain_sdpa_masks_included() -> None:
    q, mask = torch.randn(1, 2, 3, 4), torch.zeros(1, 1, 3, 3)  # a float mask the engine would refuse
    with AttentionRouter(lambda *a: pytest.fail("routed"), is_local=lambda: True):
        local = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    assert torch.equal(local, F.scaled_dot_product_attention(q, q, q, attn_mask=mask))


def test_the_router_is_left_even_when_the_forward_fails() -> None:
    class Broken(torch.nn.Module):
        def forward(
            self,
            hidden_states: torch.Tensor,
            img_ids: torch.Tensor,
            encoder_hidden_states: torch.Tensor,
            txt_ids: torch.Tensor,
            controlnet_block_samples: None = None,
            controlnet_single_block_samples: None = None,
        ) -> torch.Tensor:  # FLUX's arguments the plan names
            raise RuntimeError("inside")

    mesh = ParallelMesh(Degrees(), None, None, None, None, None, sequence_rank=0)  # one rank: no groups needed
    module = Broken()
    engine = ContextParallel(module, FLUX_HAND_PLAN, mesh)
    with pytest.raises(RuntimeError, match="inside"):
        module(torch.zeros(1, 4, 2), torch.zeros(4, 3), torch.zeros(1, 2, 2), torch.zeros(2, 3))
    q = torch.randn(1, 1, 2, 4)
    assert torch.allclose(
        F.scaled_dot_product_attention(q, q, q), F.softmax(q @ q.transpose(-1, -2) / 2, -1) @ q, atol=1e-6
    )
    engine.remove()
    assert "forward" not in vars(module)


def test_per_tensor_results_keep_the_latest_where_bounded() -> None:
    """Pair masks are cached with keep=1: one mask every block shares is computed once; masks a model
    makes anew per block (LTX-2's, repeated per head by diffusers) are not all held until the forward ends."""
    from accel.parallel.cuts import PerTensor

    computed: list[int] = []
    cache = PerTensor(keep=1)
    shared, fresh = torch.zeros(2), [torch.zeros(2) for _ in range(3)]
    for tensor in (shared, shared, *fresh):
        cache.get(tensor, lambda: computed.append(1) or torch.ones(1))
    assert len(computed) == 4 and len(cache._entries) == 1
