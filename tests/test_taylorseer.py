"""`method = "taylorseer"`: attention and feed-forward outputs inside every block, computed every
`interval` steps and extrapolated between, on toy transformers (the families run it in
tests/test_parallel_families.py and tests/test_fake_cuda.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from accel.cache.taylorseer import TaylorSeerCache
from accel.models.base import BlockList


class StepAttention(nn.Module):
    """Named as diffusers names attention modules; its output is polynomial in the step (`temb`)
    plus a function of the input, and it returns a tuple with a None, as some processors do."""

    def __init__(self, dim: int, quadratic: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.direction = nn.Parameter(torch.randn(dim))
        self.curve = nn.Parameter(torch.randn(dim) if quadratic else torch.zeros(dim))
        self.calls = 0

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> tuple[torch.Tensor, None]:
        self.calls += 1
        return temb * self.direction + temb**2 * self.curve + 0 * self.proj(x), None


class StepFeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.direction = nn.Parameter(torch.randn(dim))
        self.calls = 0

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return temb * self.direction


class Block(nn.Module):
    def __init__(self, dim: int, quadratic: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)  # not extrapolated: it runs on every call
        self.attn = StepAttention(dim, quadratic)
        self.ff = StepFeedForward(dim)

    def forward(self, hidden_states: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        attended, _ = self.attn(self.norm(hidden_states), temb)
        hidden_states = hidden_states + attended
        return hidden_states + self.ff(hidden_states, temb)


class Model(nn.Module):
    block_lists = (BlockList("blocks", returns=("hidden_states",)),)

    def __init__(self, quadratic: bool = False, depth: int = 3, dim: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(dim, quadratic) for _ in range(depth)).double()

    def forward(self, hidden_states: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            hidden_states = block(hidden_states, temb)
        return hidden_states


def run(model: Model, steps: int) -> list[torch.Tensor]:
    x = torch.randn(1, 5, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        return [model(x, torch.tensor(float(step), dtype=torch.float64)) for step in range(steps)]


@pytest.mark.parametrize("order, quadratic", [(1, False), (2, True)])
def test_outputs_polynomial_in_the_step_are_reproduced_while_extrapolating(order: int, quadratic: bool) -> None:
    """No scheduler: the step is the call count. The first order + 1 calls compute (too few to
    extrapolate before), then every third; the others run no attention or feed-forward at all."""
    model = Model(quadratic)
    expected = run(model, 9)
    for block in model.blocks:
        block.attn.calls = block.ff.calls = 0
    cache = TaylorSeerCache(model, model.block_lists, interval=3, taylor_order=order)
    got = run(model, 9)
    computed = [step < order + 1 or step % 3 == 0 for step in range(9)]
    assert [not record.cached for record in cache.stats.records] == computed
    assert all(block.attn.calls == block.ff.calls == sum(computed) for block in model.blocks)
    for output, reference in zip(got, expected):
        torch.testing.assert_close(output, reference, rtol=0, atol=1e-9)


def test_extrapolate_early_reuses_the_first_output_then_extrapolates_at_full_order() -> None:
    """diffusers' schedule: step 0 computed, steps 1-2 reuse its outputs (order 0), 3 computed,
    4-5 extrapolated linearly from 0 and 3, exact for outputs linear in the step."""
    model = Model()
    expected = run(model, 6)
    for block in model.blocks:
        block.attn.calls = block.ff.calls = 0
    cache = TaylorSeerCache(model, model.block_lists, interval=3, extrapolate_early=True)
    got = run(model, 6)
    assert [not record.cached for record in cache.stats.records] == [True, False, False, True, False, False]
    assert all(block.attn.calls == block.ff.calls == 2 for block in model.blocks)
    for step in (0, 3, 4, 5):
        torch.testing.assert_close(got[step], expected[step], rtol=0, atol=1e-9)
    assert not torch.allclose(got[1], expected[1])  # reuse of step 0's outputs, not the step-1 ones


def test_disable_before_and_after_compute_the_ends_of_the_schedule() -> None:
    model = Model()
    cache = TaylorSeerCache(model, model.block_lists, interval=4, disable_before=2, disable_after=8)
    run(model, 10)
    # 0, 1: before 2; 2: the interval starts there; 3-5 extrapolated; 6: the next interval; 7; 8, 9: from disable_after
    # on
    assert [not record.cached for record in cache.stats.records] == [
        True,
        True,
        True,
        False,
        False,
        False,
        True,
        False,
        True,
        True,
    ]


def test_interval_offset_places_the_first_interval_as_diffusers_taylorseer_does() -> None:
    """diffusers' every-4 schedule with disable_cache_before_step = 1 computes steps 0, 2, 6, 10 of 12
    (step 1 reuses step 0, the first line runs through 0 and 2); without the offset the first
    interval starts at disable_before and the same schedule cannot be written."""
    model = Model()
    cache = TaylorSeerCache(
        model, model.block_lists, interval=4, disable_before=1, interval_offset=1, extrapolate_early=True
    )
    run(model, 12)
    assert [step for step, record in enumerate(cache.stats.records) if not record.cached] == [0, 2, 6, 10]
    cache.remove()
    with pytest.raises(ValueError, match=r"interval_offset must be in \[0, interval = 4\), got 4"):
        TaylorSeerCache(model, model.block_lists, interval=4, interval_offset=4)


def test_an_interval_longer_than_the_run_extrapolates_every_call_after_warm_up() -> None:
    model = Model()
    cache = TaylorSeerCache(model, model.block_lists, interval=1000, taylor_order=1)
    run(model, 6)
    assert [record.cached for record in cache.stats.records] == [False, False, True, True, True, True]


def test_remove_restores_the_modules_and_a_model_without_them_is_refused() -> None:
    model = Model()
    expected = run(model, 4)
    cache = TaylorSeerCache(model, model.block_lists, interval=1000)
    run(model, 4)
    cache.remove()
    assert all("forward" not in vars(block.attn) and "forward" not in vars(block.ff) for block in model.blocks)
    assert all(torch.equal(a, b) for a, b in zip(run(model, 4), expected))

    class Plain(nn.Module):
        block_lists = (BlockList("blocks", returns=("hidden_states",)),)

        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(2, 2)])

    with pytest.raises(ValueError, match="Plain's blocks have no attention or feed-forward module to extrapolate"):
        TaylorSeerCache(Plain(), Plain.block_lists, interval=3)
    with pytest.raises(ValueError, match=r"interval must be at least 2 \(1 computes every step\), got 1"):
        TaylorSeerCache(model, model.block_lists, interval=1)
