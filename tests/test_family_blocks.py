"""First Block Cache on tiny instances of every registered family's real diffusers transformer.

`tests/test_fbcache.py` checks the engine on toy transformers; this checks the data each family
gives it. A family's `blocks=` plan names the block lists and what each block returns, in order:
if a name or the order were wrong, a cached call would hand the transformer its streams swapped
or mis-shaped. Each transformer here is the real class from a small config (seeded, float32,
two or more blocks in every list, two heads), called directly with random inputs of the shapes
its pipeline passes.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the suite may reach a model hub

from dataclasses import replace  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from block_cases import Inputs  # noqa: E402
from families import FAMILY_CASES  # noqa: E402

from accel.cache.fbcache import FirstBlockCache  # noqa: E402
from accel.models.base import BlockList  # noqa: E402
from accel.models.registry import FAMILIES  # noqa: E402

# MochiRoPE enters a float32 CPU autocast region, which torch warns about and skips; harmless here.
pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast:UserWarning")


CASES = {name: (case.block_transformer, case.block_inputs) for name, case in FAMILY_CASES.items()}
DRIFTS = (0.0, 0.01, 0.02)  # three calls, as three neighbouring denoising steps

# Families whose plan is known to be wrong, with why (xfail(strict=True) keeps them honest).
KNOWN_WRONG: dict[str, str] = {}


def _families() -> list[Any]:
    return [
        pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=KNOWN_WRONG[name]))
        if name in KNOWN_WRONG
        else name
        for name in CASES
    ]


def _run(model: nn.Module, inputs: Inputs) -> torch.Tensor:
    output, *others = model(**inputs)
    output = torch.stack(output) if isinstance(output, list) else output  # Z-Image: one tensor per sample
    # LTX-2 also predicts its audio, Cosmos 3 its sound (a list per modality, None where there is none):
    # compared too, appended to the video flattened.
    others = [torch.stack(other) if isinstance(other, list) else other for other in others if other is not None]
    return torch.cat([output.flatten(), *(other.flatten() for other in others)]) if others else output


def _blocks(model: nn.Module, plan: tuple[BlockList, ...]) -> list[nn.Module]:
    return [block for spec in plan for block in getattr(model, spec.attr)]


def _count_calls(blocks: list[nn.Module]) -> tuple[list[int], list[int]]:
    """Per block: how often it was called, and how many of its submodule calls ran inside it.

    Forward pre-hooks on a block fire on every call, skipped or not: `nn.Module.__call__` runs
    them and then `self.forward`, which is the cache's instance attribute. So they count calls.
    Hooks on a block's submodules fire only when the block's original forward actually runs,
    so they count real work.
    """
    calls = [0] * len(blocks)
    work = [0] * len(blocks)
    for index, block in enumerate(blocks):

        def on_call(module: nn.Module, args: Any, index: int = index) -> None:
            calls[index] += 1

        def on_work(module: nn.Module, args: Any, index: int = index) -> None:
            work[index] += 1

        block.register_forward_pre_hook(on_call)
        for submodule in block.modules():
            if submodule is not block:
                submodule.register_forward_pre_hook(on_work)
    return calls, work


def test_every_registered_family_is_covered() -> None:
    assert set(CASES) == set(FAMILIES)


@pytest.mark.parametrize("name", list(CASES))
def test_tiny_transformer_has_the_planned_structure(name: str) -> None:
    build, _ = CASES[name]
    model = build()
    family = FAMILIES[name]
    assert type(model).__name__ == family.transformer_class
    for spec in family.blocks:
        assert len(getattr(model, spec.attr)) >= 2, f"{spec.attr} needs two blocks to test skipping"


@pytest.mark.parametrize("name", _families())
@torch.no_grad()
def test_threshold_zero_is_bit_identical(name: str) -> None:
    build, make_inputs = CASES[name]
    model = build()
    reference = [_run(model, make_inputs(drift)) for drift in DRIFTS]
    cache = FirstBlockCache(model, FAMILIES[name].blocks, threshold=0.0, primary_stream=FAMILIES[name].primary_stream)
    outputs = [_run(model, make_inputs(drift)) for drift in DRIFTS]
    assert all(torch.equal(out, ref) for out, ref in zip(outputs, reference))
    assert cache.stats.calls == len(DRIFTS) and cache.stats.cached == 0


@pytest.mark.parametrize("name", _families())
@torch.no_grad()
def test_cached_call_on_same_inputs_reproduces_the_full_output(name: str) -> None:
    """Same inputs: block 0 moves by zero, so the cached output is block 0's + the skipped residual."""
    build, make_inputs = CASES[name]
    model = build()
    plan = FAMILIES[name].blocks
    blocks = _blocks(model, plan)
    calls, work = _count_calls(blocks)
    cache = FirstBlockCache(model, plan, threshold=1e9, primary_stream=FAMILIES[name].primary_stream)

    full = _run(model, make_inputs(0.0))
    work_once = list(work)
    cached = _run(model, make_inputs(0.0))

    assert [record.cached for record in cache.stats.records] == [False, True]
    assert cache.stats.records[1].change == 0.0
    # The hooks fire around the cache's instance forward: every block is *called* on both calls...
    assert calls == [2] * len(blocks)
    # ...but only block 0 does its work again; later blocks pass their inputs through.
    assert all(count > 0 for count in work_once)
    assert work[0] == 2 * work_once[0], "block 0 runs on every call"
    assert work[1:] == work_once[1:], "later blocks run only on the computed call"
    assert cached.shape == full.shape
    torch.testing.assert_close(cached, full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", _families())
@torch.no_grad()
def test_cached_calls_on_drifting_inputs_are_finite(name: str) -> None:
    build, make_inputs = CASES[name]
    model = build()
    cache = FirstBlockCache(model, FAMILIES[name].blocks, threshold=1e9, primary_stream=FAMILIES[name].primary_stream)
    outputs = [_run(model, make_inputs(drift)) for drift in DRIFTS]
    assert [record.cached for record in cache.stats.records] == [False, True, True]
    for output in outputs[1:]:
        assert output.shape == outputs[0].shape
        assert torch.isfinite(output).all()


@pytest.mark.parametrize("name", _families())
@torch.no_grad()
def test_remove_restores_the_uncached_transformer(name: str) -> None:
    build, make_inputs = CASES[name]
    model = build()
    reference = [_run(model, make_inputs(drift)) for drift in DRIFTS]
    plan = FAMILIES[name].blocks
    cache = FirstBlockCache(model, plan, threshold=1e9, primary_stream=FAMILIES[name].primary_stream)
    for drift in DRIFTS:
        _run(model, make_inputs(drift))
    assert cache.stats.cached == len(DRIFTS) - 1
    cache.remove()
    assert all("forward" not in block.__dict__ for block in _blocks(model, plan))
    outputs = [_run(model, make_inputs(drift)) for drift in DRIFTS]
    assert all(torch.equal(out, ref) for out, ref in zip(outputs, reference))


TWO_STREAM = [name for name in CASES if any(len(spec.returns) > 1 for spec in FAMILIES[name].blocks)]


@pytest.mark.parametrize("name", TWO_STREAM)
@torch.no_grad()
def test_a_plan_with_the_returns_reversed_is_caught(name: str) -> None:
    """The same-input check has teeth: reversing each list's `returns` makes it fail or raise."""
    build, make_inputs = CASES[name]
    model = build()
    wrong = tuple(replace(spec, returns=spec.returns[::-1]) for spec in FAMILIES[name].blocks)
    try:
        FirstBlockCache(model, wrong, threshold=1e9, primary_stream=FAMILIES[name].primary_stream)
        full = _run(model, make_inputs(0.0))
        cached = _run(model, make_inputs(0.0))
    except (RuntimeError, ValueError):
        return  # streams of different lengths cannot be mixed up silently
    assert cached.shape != full.shape or not torch.allclose(cached, full, rtol=0, atol=1e-5)
