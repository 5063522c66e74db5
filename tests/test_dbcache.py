"""DBCache (first Fn blocks decide, last Bn always run) and the TaylorSeer calibrator, on the toy
transformers of tests/toy_transformers.py; First Block Cache's own tests are tests/test_fbcache.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from accel.cache.blocks import BlockCache
from accel.cache.calibrate import TaylorSeer
from accel.models.base import BlockList
from toy_transformers import JointTransformer, SingleTensorTransformer, TwoListTransformer, all_blocks, inputs

STRUCTURES = [TwoListTransformer, SingleTensorTransformer, JointTransformer]


def make(structure: type, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return structure().eval()


def drifting_inputs(calls: int, drift: float = 0.01) -> list[tuple[torch.Tensor, ...]]:
    base, step = inputs(0), inputs(1)
    return [tuple(b + drift * i * s for b, s in zip(base, step)) for i in range(calls)]


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("first, last", [(2, 0), (1, 1), (2, 1)])
@torch.no_grad()
def test_threshold_zero_is_bit_identical(structure: type, first: int, last: int) -> None:
    model = make(structure)
    sequence = drifting_inputs(4)
    reference = [model(*args) for args in sequence]
    cache = BlockCache(
        model, model.block_lists, threshold=0.0, first_blocks=first, last_blocks=last, calibrator="taylorseer"
    )
    assert all(torch.equal(model(*args), expected) for args, expected in zip(sequence, reference))
    assert cache.stats.calls == 4 and cache.stats.cached == 0


# TwoListTransformer: 3 double blocks then 3 single blocks, one sequence of six. (2, 2) puts the
# head in the double list and the tail in the single list; (4, 1) puts both in the single list.
@pytest.mark.parametrize(
    "structure, first, last",
    [
        (TwoListTransformer, 2, 2),
        (TwoListTransformer, 4, 1),
        (TwoListTransformer, 1, 4),
        (SingleTensorTransformer, 2, 1),
        (JointTransformer, 1, 2),
    ],
)
@torch.no_grad()
def test_a_cached_call_runs_exactly_the_head_and_the_tail(structure: type, first: int, last: int) -> None:
    model = make(structure)
    cache = BlockCache(model, model.block_lists, threshold=1e9, first_blocks=first, last_blocks=last)
    for args in drifting_inputs(5):
        model(*args)
    calls = [block.calls for block in all_blocks(model)]
    middle = len(calls) - first - last
    assert calls == [5] * first + [1] * middle + [5] * last
    assert [record.cached for record in cache.stats.records] == [False] + [True] * 4


def _block_streams(
    model: nn.Module, args: tuple[torch.Tensor, ...], replace: dict[int, dict[str, torch.Tensor]] | None = None
) -> list[dict[str, torch.Tensor]]:
    """Stream values before block 0 and after each block (after block i, `replace[i]` instead of
    what it computed, when given), running the blocks by hand as the toy transformers do."""
    hidden, text, temb = args
    streams = [{"hidden_states": hidden, "encoder_hidden_states": text}]
    index = 0
    for spec in model.block_lists:
        for block in getattr(model, spec.attr):
            output = block(streams[-1]["hidden_states"], streams[-1]["encoder_hidden_states"], temb)
            values = output if isinstance(output, tuple) else (output,)
            streams.append(
                replace[index] if replace and index in replace else streams[-1] | dict(zip(spec.returns, values))
            )
            index += 1
    return streams


@pytest.mark.parametrize("first, last", [(2, 2), (4, 1)])
@torch.no_grad()
def test_the_tail_runs_on_the_head_output_plus_the_middle_residual(first: int, last: int) -> None:
    """Cached call: after block first−1 the streams are this call's; after the middle they are the
    head output + (middle end − head output) of the computed call; the tail then runs on those."""
    model = make(TwoListTransformer)
    computed, now = drifting_inputs(2, drift=0.05)
    BlockCache(model, model.block_lists, threshold=1e9, first_blocks=first, last_blocks=last)
    model(*computed)
    got = model(*now)

    plain = make(TwoListTransformer)
    before = _block_streams(plain, computed)
    head_then, middle_then = before[first], before[6 - last]
    head_now = _block_streams(plain, now)[first]
    middle_now = {name: head_now[name] + (middle_then[name] - head_then[name]) for name in middle_then}
    expected = _block_streams(plain, now, replace={5 - last: middle_now})[-1]
    torch.testing.assert_close(got, plain.out(expected["hidden_states"]), rtol=0, atol=1e-6)


@torch.no_grad()
def test_fbcache_is_dbcache_with_one_head_block_and_no_tail() -> None:
    from accel.cache.fbcache import FirstBlockCache

    outputs = []
    for cls, options in ((FirstBlockCache, {}), (BlockCache, {"first_blocks": 1, "last_blocks": 0})):
        model = make(TwoListTransformer)
        cache = cls(model, model.block_lists, threshold=0.05, **options)
        outputs.append(
            ([model(*args) for args in drifting_inputs(6, drift=0.02)], [r.cached for r in cache.stats.records])
        )
    (fb, fb_cached), (db, db_cached) = outputs
    assert fb_cached == db_cached and any(fb_cached) and not all(fb_cached)
    assert all(torch.equal(a, b) for a, b in zip(fb, db))


@torch.no_grad()
def test_max_cached_steps_caps_the_cached_calls_of_a_generation() -> None:
    model = make(SingleTensorTransformer)
    cache = BlockCache(model, model.block_lists, threshold=1e9, first_blocks=1, max_cached_steps=2)
    for args in drifting_inputs(6):
        model(*args)
    assert [record.cached for record in cache.stats.records] == [False, True, True, False, False, False]


def test_counts_that_leave_no_middle_block_are_refused() -> None:
    model = make(SingleTensorTransformer)  # four blocks
    with pytest.raises(
        ValueError,
        match=r"the transformer has 4 blocks: first_blocks \(3\) \+ last_blocks \(1\) must leave at least one to cache",
    ):
        BlockCache(model, model.block_lists, threshold=1.0, first_blocks=3, last_blocks=1)
    with pytest.raises(ValueError, match="taylor_order must be 1 or 2, got 3"):
        BlockCache(model, model.block_lists, threshold=1.0, calibrator="taylorseer", taylor_order=3)
    assert all("forward" not in vars(block) for block in all_blocks(model)), "a refused cache leaves no wrapper behind"


@pytest.mark.parametrize("first, last", [(1, 0), (2, 1)])
@torch.no_grad()
def test_remove_restores_the_original_forwards(first: int, last: int) -> None:
    model = make(TwoListTransformer)
    reference = [model(*args) for args in drifting_inputs(3)]
    cache = BlockCache(
        model, model.block_lists, threshold=1e9, first_blocks=first, last_blocks=last, calibrator="taylorseer"
    )
    model(*drifting_inputs(1)[0])
    cache.remove()
    assert all(torch.equal(model(*args), expected) for args, expected in zip(drifting_inputs(3), reference))


# -- TaylorSeer ---------------------------------------------------------------------------------------------------


class LinearInStepBlock(nn.Module):
    """Adds a fixed direction scaled by the step (fed as `temb`): a residual exactly linear in the
    step, and one that also has a quadratic term."""

    def __init__(self, dim: int, quadratic: bool) -> None:
        super().__init__()
        self.direction = nn.Parameter(torch.randn(dim))
        self.curve = nn.Parameter(torch.randn(dim) if quadratic else torch.zeros(dim))
        self.calls = 0

    def forward(self, hidden_states: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return hidden_states + temb * self.direction + temb**2 * self.curve


class StepModel(nn.Module):
    block_lists = (BlockList("blocks", returns=("hidden_states",)),)

    def __init__(self, quadratic: bool, depth: int = 4, dim: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(LinearInStepBlock(dim, quadratic) for _ in range(depth)).double()

    def forward(self, hidden_states: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            hidden_states = block(hidden_states, temb)
        return hidden_states


def _steps(model: StepModel, count: int) -> list[torch.Tensor]:
    """float64, so that the comparison sees the extrapolation's error, not float32 rounding at residuals near 30."""
    x = torch.randn(1, 5, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return [model(x, torch.tensor(float(step), dtype=torch.float64)) for step in range(count)]


@pytest.mark.parametrize("order, quadratic", [(1, False), (2, True)])
@torch.no_grad()
def test_taylorseer_reproduces_a_residual_polynomial_in_the_step_while_caching(order: int, quadratic: bool) -> None:
    """Steps are the call counts (no scheduler here): a middle residual of degree `order` in the
    step is extrapolated exactly, while the first `order + 1` calls compute and the rest are cached."""
    model = StepModel(quadratic)
    expected = _steps(model, 7)
    model.blocks[1].calls = 0
    cache = BlockCache(
        model,
        model.block_lists,
        threshold=1e9,
        first_blocks=1,
        last_blocks=1,
        calibrator="taylorseer",
        taylor_order=order,
        warmup_steps=order + 1,
    )
    got = _steps(model, 7)
    assert [record.cached for record in cache.stats.records] == [False] * (order + 1) + [True] * (6 - order)
    assert model.blocks[1].calls == order + 1
    for output, reference in zip(got, expected):
        torch.testing.assert_close(output, reference, rtol=0, atol=1e-5)


@torch.no_grad()
def test_reusing_the_residual_is_what_taylorseer_improves_on() -> None:
    """The same run without the calibrator is off by the drift of the middle's residual."""
    model = StepModel(quadratic=False)
    expected = _steps(model, 5)
    BlockCache(model, model.block_lists, threshold=1e9, first_blocks=1, last_blocks=1, warmup_steps=2)
    got = _steps(model, 5)
    assert (got[-1] - expected[-1]).abs().max() > 0.1


def test_taylorseer_extrapolates_over_uneven_step_gaps() -> None:
    seer = TaylorSeer(2)
    for step in (0, 1, 4):  # computed at steps 0, 1 and 4 (cached in between)
        seer.record(step, {"x": torch.tensor([2.0 * step**2 - step + 3])})
    torch.testing.assert_close(seer.predict(6)["x"], torch.tensor([2.0 * 36 - 6 + 3]))
    assert TaylorSeer(1).predict(3) == {}
