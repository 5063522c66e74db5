"""First Block Cache on transformers of every block structure the families use."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from accel.cache.fbcache import FirstBlockCache
from accel.steps import StepEvents
from accel.launch.environment import free_port
from toy_transformers import (
    JointTransformer,
    SingleTensorTransformer,
    TwoListTransformer,
    all_blocks,
    inputs,
)

STRUCTURES = [TwoListTransformer, SingleTensorTransformer, JointTransformer]


def make(structure: type, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return structure().eval()


def drifting_inputs(calls: int, drift: float = 0.01) -> list[tuple[torch.Tensor, ...]]:
    """Inputs that change a little from call to call, as latents do between denoising steps."""
    base = inputs(0)
    step = inputs(1)
    return [tuple(b + drift * i * s for b, s in zip(base, step)) for i in range(calls)]


@pytest.mark.parametrize("structure", STRUCTURES)
@torch.no_grad()
def test_threshold_zero_is_bit_identical(structure: type) -> None:
    model = make(structure)
    sequence = drifting_inputs(5)
    reference = [model(*args) for args in sequence]
    cache = FirstBlockCache(model, model.block_lists, threshold=0.0)
    outputs = [model(*args) for args in sequence]
    assert all(torch.equal(a, b) for a, b in zip(outputs, reference))
    assert cache.stats.calls == 5 and cache.stats.cached == 0


@pytest.mark.parametrize("structure", STRUCTURES)
@torch.no_grad()
def test_huge_threshold_caches_every_call_after_the_first(structure: type) -> None:
    model = make(structure)
    cache = FirstBlockCache(model, model.block_lists, threshold=1e9)
    for args in drifting_inputs(6):
        model(*args)
    blocks = all_blocks(model)
    assert blocks[0].calls == 6, "block 0 runs on every call"
    assert all(block.calls == 1 for block in blocks[1:]), "later blocks run only on the first call"
    assert [record.cached for record in cache.stats.records] == [False] + [True] * 5
    assert cache.stats.hit_rate == pytest.approx(5 / 6)


@pytest.mark.parametrize("structure", STRUCTURES)
@torch.no_grad()
def test_cached_call_adds_the_residual_of_the_skipped_blocks(structure: type) -> None:
    """Cached output = block 0's output + (last computed output of the last block − its block-0 output)."""
    model = make(structure)
    first, second = drifting_inputs(2, drift=0.05)
    FirstBlockCache(model, model.block_lists, threshold=1e9)
    model(*first)
    cached_output = model(*second)

    plain = make(structure)  # same seed, same weights, no cache
    streams = _block_streams(plain, first)
    after_first, final = streams[1], streams[-1]
    now_after_first = _block_streams(plain, second)[1]
    expected_streams = {k: now_after_first[k] + (final[k] - after_first[k]) for k in final}
    expected = _finish(plain, expected_streams, second)
    torch.testing.assert_close(cached_output, expected, rtol=0, atol=1e-6)


def _block_streams(model: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> list[dict[str, torch.Tensor]]:
    """Stream values before block 0 and after every block, by running the blocks by hand."""
    hidden, text, temb = args
    streams = [{"hidden_states": hidden, "encoder_hidden_states": text}]
    for spec in model.block_lists:
        for block in getattr(model, spec.attr):
            output = block(streams[-1]["hidden_states"], streams[-1]["encoder_hidden_states"], temb)
            values = output if isinstance(output, tuple) else (output,)
            streams.append(streams[-1] | dict(zip(spec.returns, values)))
    return streams


def _finish(model: torch.nn.Module, streams: dict[str, torch.Tensor], args: tuple[torch.Tensor, ...]) -> torch.Tensor:
    if isinstance(model, TwoListTransformer):
        return model.out(streams["hidden_states"])
    if isinstance(model, JointTransformer):
        return torch.cat([streams["encoder_hidden_states"], streams["hidden_states"]], dim=1)
    return streams["hidden_states"]


@torch.no_grad()
def test_relative_change_is_mean_abs_difference_over_mean_abs_previous() -> None:
    model = make(SingleTensorTransformer)
    first, second = drifting_inputs(2, drift=0.3)
    cache = FirstBlockCache(model, model.block_lists, threshold=1e-12)
    model(*first)
    model(*second)
    block0 = make(SingleTensorTransformer).blocks[0]
    r1 = block0(*first) - first[0]
    r2 = block0(*second) - second[0]
    expected = ((r2 - r1).abs().mean() / r1.abs().mean()).item()
    assert cache.stats.records[0].change is None
    assert cache.stats.records[1].change == pytest.approx(expected, rel=1e-5)
    assert not cache.stats.records[1].cached, "a change above the threshold must compute"


@torch.no_grad()
def test_warmup_steps_always_compute() -> None:
    model = make(TwoListTransformer)
    cache = FirstBlockCache(model, model.block_lists, threshold=1e9, warmup_steps=3)
    for args in drifting_inputs(6):
        model(*args)
    assert [r.cached for r in cache.stats.records] == [False, False, False, True, True, True]


@torch.no_grad()
def test_max_consecutive_cached_forces_a_full_call() -> None:
    model = make(JointTransformer)
    cache = FirstBlockCache(model, model.block_lists, threshold=1e9, max_consecutive_cached=2)
    for args in drifting_inputs(8):
        model(*args)
    assert [r.cached for r in cache.stats.records] == [False, True, True, False, True, True, False, True]


@pytest.mark.parametrize("structure", STRUCTURES)
@torch.no_grad()
def test_remove_restores_the_original_forwards(structure: type) -> None:
    model = make(structure)
    args = drifting_inputs(3)
    reference = [model(*a) for a in args]
    cache = FirstBlockCache(model, model.block_lists, threshold=1e9)
    [model(*a) for a in args]
    cache.remove()
    assert all("forward" not in block.__dict__ for block in all_blocks(model))
    assert all(torch.equal(model(*a), r) for a, r in zip(args, reference))


def test_a_transformer_with_one_block_is_refused() -> None:
    model = SingleTensorTransformer(depth=1)
    with pytest.raises(ValueError, match="at least two blocks"):
        FirstBlockCache(model, model.block_lists, threshold=0.1)


class FakeScheduler:
    def __init__(self) -> None:
        self.timesteps = torch.arange(4)

    def set_timesteps(self, n: int) -> None:
        self.timesteps = torch.arange(n)

    def step(self, *args: object) -> None:
        return None


def _generate(model: torch.nn.Module, scheduler: FakeScheduler, steps: int, cfg: bool) -> None:
    """A pipeline's loop: set_timesteps, then per step a cond call (and an uncond call), then step."""
    cond, uncond = inputs(0), inputs(7)
    scheduler.set_timesteps(steps)
    for i in range(steps):
        model(*(c + 0.001 * i for c in cond))
        if cfg:
            model(*(u + 0.001 * i for u in uncond))
        scheduler.step()


@torch.no_grad()
def test_cond_and_uncond_calls_keep_separate_state() -> None:
    """Cond and uncond inputs differ a lot; each branch compares only with itself, so both cache."""
    model = make(SingleTensorTransformer)
    pipe = SimpleNamespace(scheduler=FakeScheduler())
    events = StepEvents.of(pipe)
    cache = FirstBlockCache(model, model.block_lists, threshold=0.05, events=events)
    _generate(model, pipe.scheduler, steps=4, cfg=True)
    records = cache.stats.records
    assert [(r.step, r.branch) for r in records] == [(s, b) for s in range(4) for b in (0, 1)]
    assert [r.cached for r in records] == [False, False] + [True] * 6
    assert all(r.change < 0.05 for r in records[2:])


@torch.no_grad()
def test_state_resets_at_each_generation_and_remove_unwraps_the_scheduler() -> None:
    model = make(SingleTensorTransformer)
    pipe = SimpleNamespace(scheduler=FakeScheduler())
    cache = FirstBlockCache(model, model.block_lists, threshold=1e9, events=StepEvents.of(pipe), warmup_steps=1)
    _generate(model, pipe.scheduler, steps=3, cfg=False)
    _generate(model, pipe.scheduler, steps=3, cfg=False)
    assert [(r.step, r.cached) for r in cache.stats.records] == [(0, False), (1, True), (2, True)]
    cache.remove()
    assert "step" not in pipe.scheduler.__dict__ and "set_timesteps" not in pipe.scheduler.__dict__


# -- every rank decides the same ---------------------------------------------------------------


def _rank_main(rank: int, world: int, port: int, results: dict) -> None:  # type: ignore[type-arg]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = SingleTensorTransformer().eval()
        torch.manual_seed(0)
        block0 = SingleTensorTransformer().eval().blocks[0]  # the same block, uncached, for local sums
        # Rank 1's input moves 100x more than rank 0's between calls: alone, rank 0 would cache
        # and rank 1 would not. Reduced, both see one change and decide the same.
        drift = 0.001 if rank == 0 else 0.1
        base, step = inputs(rank), inputs(10 + rank)
        sequence = [tuple(b + drift * i * s for b, s in zip(base, step)) for i in range(3)]
        cache = FirstBlockCache(model, model.block_lists, threshold=0.02, group=dist.group.WORLD)
        with torch.no_grad():
            for args in sequence:
                model(*args)
            r0, r1 = (block0(*args) - args[0] for args in sequence[:2])
        local = ((r1 - r0).abs().sum().item(), r0.abs().sum().item())
        results[rank] = ([(rec.change, rec.cached) for rec in cache.stats.records], local)
    finally:
        dist.destroy_process_group()


def test_decision_is_reduced_across_ranks() -> None:
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_rank_main, args=(2, free_port(), results), nprocs=2, join=True)
    (records0, (num0, den0)), (records1, (num1, den1)) = results[0], results[1]
    assert num0 / den0 < 0.02 < num1 / den1, "alone, the ranks would decide differently"
    assert records0 == records1, "every rank sees the same change and takes the same branch"
    assert records0[0] == (None, False)
    assert records0[1][0] == pytest.approx((num0 + num1) / (den0 + den1), rel=1e-5)
    assert records0[1][1] is False
