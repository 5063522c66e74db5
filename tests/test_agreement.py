"""Ranks called with different arguments stop, every one of them, with one message naming what
differs (accel.parallel.agree.agree_on_arguments), before any other collective of the call: no
wrong image, no hang, no gloo "collective mismatch"; the rank pool stays usable afterwards."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import parallel_cases as cases
from accel.parallel.agree import _differences, _describe

ULYSSES = {"parallel": {"ulysses": 2}}
CALL = dict(prompt="a red fox", height=64, width=64, num_inference_steps=2, guidance_scale=3.5)
TAIL = "; call the pipeline with the same arguments on every rank"


def run(
    rank_pools: Any,
    rank0: dict[str, Any],
    rank1: dict[str, Any],
    args1: tuple[Any, ...] = (),
    seeds: tuple[int, int] = (0, 0),
) -> list[tuple[str, Any]]:
    runs = rank_pools(2).run(cases.per_rank_call, "tiny-flux", ULYSSES, [((), rank0), (args1, rank1)], list(seeds))
    assert all(restored for _, _, restored in runs), "remove() must give back the pipeline's class and attributes"
    return [(kind, value) for kind, value, _ in runs]


_reference: dict[str, np.ndarray] = {}


def reference() -> np.ndarray:
    if "flux" not in _reference:
        _reference["flux"] = cases.tiny_run("tiny-flux", {}, CALL)[0]
    return _reference["flux"]


def test_different_steps_stop_every_rank_with_one_message_and_the_pool_stays_usable(rank_pools: Any) -> None:
    runs = run(rank_pools, CALL, dict(CALL, num_inference_steps=1))
    message = "UserError: ranks were called with different num_inference_steps (rank 0: 2, rank 1: 1)" + TAIL
    assert runs == [("error", message)] * 2
    for kind, output in run(rank_pools, CALL, CALL):  # no rank was left inside a collective
        assert kind == "ok" and np.abs(output - reference()).max() <= 1e-4


@pytest.mark.parametrize(
    "change, named",
    [
        (dict(prompt="a blue fox"), "prompt (rank 0: 'a red fox', rank 1: 'a blue fox')"),
        (dict(height=48), "height (rank 0: 64, rank 1: 48)"),
        (
            dict(prompt="x" * 100, width=48, guidance_scale=2.0),
            f"prompt (rank 0: 'a red fox', rank 1: '{'x' * 38}…), width (rank 0: 64, rank 1: 48) and "
            "guidance_scale (rank 0: 3.5, rank 1: 2.0)",
        ),
    ],
)
def test_each_differing_setting_is_named_with_its_value_per_rank(rank_pools: Any, change: dict, named: str) -> None:
    assert (
        run(rank_pools, CALL, dict(CALL, **change))
        == [("error", f"UserError: ranks were called with different {named}{TAIL}")] * 2
    )


def test_positional_keyword_and_default_spellings_agree_and_rank_0_seed_wins(rank_pools: Any) -> None:
    # FluxPipeline.__call__(prompt, prompt_2, negative_prompt, negative_prompt_2, true_cfg_scale, height,
    # width, num_inference_steps, …): rank 1 spells the call positionally, with defaults written out,
    # and seeds differently; rank 0's noise wins (agree_on_noise), so both give the seed-0 image.
    positional = ("a red fox", None, None, None, 1.0, 64, 64, 2)
    for kind, output in run(
        rank_pools, CALL, dict(guidance_scale=3.5, max_sequence_length=512), positional, seeds=(0, 7)
    ):
        assert kind == "ok" and np.abs(output - reference()).max() <= 1e-4


def test_a_call_one_rank_cannot_bind_stops_the_others_too(rank_pools: Any) -> None:
    (kind0, error0), (kind1, error1) = run(rank_pools, CALL, dict(CALL, bogus=1))
    assert kind0 == kind1 == "error"
    assert error1.startswith("TypeError: ") and "bogus" in error1
    assert error0.startswith("UserError: rank 1 could not call the pipeline (TypeError: ") and error0.endswith(TAIL)


def test_message_groups_ranks_and_summarises_tensors_without_their_contents() -> None:
    import torch

    steps = [(rank, {"num_inference_steps": _describe(2 if rank != 5 else 3)}) for rank in range(8)]
    assert _differences(steps) == ["num_inference_steps (ranks 0-4, 6, 7: 2, rank 5: 3)"]
    same = [(rank, {"latents": _describe(torch.full((1, 4), float(rank)))}) for rank in range(2)]
    assert _differences(same) == []  # contents are not compared (rank 0's latents win)
    shapes = [(rank, {"latents": _describe(torch.zeros(1, 4 + rank))}) for rank in range(2)]
    assert _differences(shapes) == ["latents (rank 0: tensor 1x4 float32 on cpu, rank 1: tensor 1x5 float32 on cpu)"]
    kwargs = [
        (rank, {"joint_attention_kwargs": _describe({"scale": 1.0, "mask": torch.ones(2), "fn": print})})
        for rank in range(2)
    ]
    assert _differences(kwargs) == []
