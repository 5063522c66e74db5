"""The SDPA router: only calls made while it is active are routed, and unsupported calls are refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from accel.errors import NotAvailableError
from accel.models.registry import FAMILIES
from accel.parallel.mesh import Degrees, ParallelMesh
from accel.parallel.mode import AttentionRouter
from accel.parallel.plan import ContextParallel


def test_only_sdpa_inside_the_router_is_routed() -> None:
    calls: list[tuple[int, ...]] = []

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
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
        ({"attn_mask": torch.ones(3, 3, dtype=torch.bool)}, "calls attention with a mask, causal flag or dropout"),
        ({"is_causal": True}, "calls attention with a mask, causal flag or dropout"),
        ({"dropout_p": 0.1}, "calls attention with a mask, causal flag or dropout"),
    ],
)
def test_unsupported_calls_are_refused_not_computed_wrongly(kwargs: dict, message: str) -> None:
    q = torch.randn(1, 2, 3, 4)
    with AttentionRouter(lambda *a: q), pytest.raises(NotAvailableError, match=message):
        F.scaled_dot_product_attention(q, q, q, **kwargs)


def test_the_router_is_left_even_when_the_forward_fails() -> None:
    class Broken(torch.nn.Module):
        def forward(self, hidden_states: torch.Tensor, img_ids: torch.Tensor, encoder_hidden_states: torch.Tensor,
                    txt_ids: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("inside")

    mesh = ParallelMesh(Degrees(), None, None, None, None, None, sequence_rank=0)  # one rank: no groups needed
    module = Broken()
    engine = ContextParallel(module, FAMILIES["flux"].parallel, mesh)
    with pytest.raises(RuntimeError, match="inside"):
        module(torch.zeros(1, 4, 2), torch.zeros(4, 3), torch.zeros(1, 2, 2), torch.zeros(2, 3))
    q = torch.randn(1, 1, 2, 4)
    assert torch.allclose(F.scaled_dot_product_attention(q, q, q), F.softmax(q @ q.transpose(-1, -2) / 2, -1) @ q, atol=1e-6)
    engine.remove()
    assert "forward" not in vars(module)
