"""[memory] vae = "rank0": only the layout's first rank (the one that writes the output) decodes; the
others call the pipeline with output_type="latent", never run the VAE, and keep it in host memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import parallel_cases as cases
from families import FAMILY_CASES
from family_parallel import TOLERANCE, reference

RANK0 = {"memory": {"vae": "rank0"}}
REFUSAL = (
    '[memory] vae = "rank0" and [vae] parallel = true do not compose: the split decode needs every rank to decode; '
    'set vae = "replicated" to split the decode, or parallel = false to decode on the first rank alone'
)
TAIL = "; call the pipeline with the same arguments on every rank"


@pytest.mark.parametrize("parallel", [{"ulysses": 2}, {"cfg": 2}])
def test_only_the_first_rank_decodes_and_equals_one_process(rank_pools, parallel: dict[str, int]) -> None:
    case = FAMILY_CASES["flux"]
    expected, _ = reference("flux", case.call)
    call = dict(case.call, output_type="np")
    lead, other = rank_pools(2).run(
        cases.first_rank_decodes_run, "tiny-flux", {"parallel": parallel, **RANK0}, [call, call]
    )
    assert lead["outcome"][0] == "ok" and np.abs(lead["outcome"][1] - expected).max() <= TOLERANCE
    assert lead["decodes"] >= 1
    assert other["outcome"] == ("ok", None) and other["decodes"] == 0  # latents back, the decoder never ran
    assert lead["unwrapped"] and other["unwrapped"]


def test_output_type_may_differ_only_under_rank0_and_nothing_else_may(rank_pools) -> None:
    """The ranks that do not decode ask for latents whatever they are given, so output_type is left out of
    the argument check there; any other difference still stops every rank. Replicated, output_type is
    checked as before (with [vae] parallel a rank asking for latents would leave the others waiting)."""
    call = dict(FAMILY_CASES["flux"].call, num_inference_steps=2)
    pool = rank_pools(2)
    ulysses = {"parallel": {"ulysses": 2}}
    lead, other = pool.run(
        cases.first_rank_decodes_run,
        "tiny-flux",
        {**ulysses, **RANK0},
        [dict(call, output_type="np"), dict(call, output_type="pil")],
    )
    assert lead["outcome"][0] == "ok" and lead["outcome"][1].shape[-1] == 3 and other["outcome"] == ("ok", None)
    runs = pool.run(
        cases.first_rank_decodes_run,
        "tiny-flux",
        {**ulysses, **RANK0},
        [dict(call, output_type="np"), dict(call, output_type="np", num_inference_steps=1)],
    )
    message = f"UserError: ranks were called with different num_inference_steps (rank 0: 2, rank 1: 1){TAIL}"
    assert [run["outcome"] for run in runs] == [("error", message)] * 2
    runs = pool.run(
        cases.first_rank_decodes_run,
        "tiny-flux",
        ulysses,
        [dict(call, output_type="np"), dict(call, output_type="pil")],
    )
    message = f"UserError: ranks were called with different output_type (rank 0: 'np', rank 1: 'pil'){TAIL}"
    assert [run["outcome"] for run in runs] == [("error", message)] * 2
    assert all(run["decodes"] == 0 and run["unwrapped"] for run in runs)


def test_the_other_ranks_move_their_vae_to_host_memory_and_back(rank_pools) -> None:
    """A VAE on another device ("meta" stands in for the GPU) goes to the CPU on the ranks that do not
    decode and comes back on remove(); output_type is replaced however the call spells it."""
    lead, other = rank_pools(2).run(cases.vae_moves_run)
    assert lead == {"asked": ["np", "pt", "pil"], "applied": [], "after": []}
    assert other == {"asked": ["latent", "latent", "pil"], "applied": ["cpu"], "after": ["meta"]}


def test_one_process_changes_nothing(tiny_flux) -> None:
    import accel
    from accel.hooks import wrappers

    handle = accel.apply(tiny_flux, RANK0)
    try:
        assert wrappers(tiny_flux, "__call__") == [] and next(tiny_flux.vae.parameters()).device.type == "cpu"
    finally:
        handle.remove()


def test_a_rank_that_does_not_decode_loads_the_vae_into_host_memory(monkeypatch) -> None:
    """accel run / serve: load_pipeline(..., vae_on_cpu=True) moves everything else to the device ("meta"
    stands in for the GPU): its last step, on a loaded pipeline; and which ranks load so."""
    import accel
    from accel.models.loading import _place
    from accel.vae.placement import loads_vae_on_gpu

    pipe = accel.load_pipeline("tiny-flux", "float32", device="cpu")
    _place(pipe, torch.device("meta"), text_encoders_on_cpu=False, vae_on_cpu=True)
    assert next(pipe.vae.parameters()).device.type == "cpu"
    for name in ("transformer", "text_encoder", "text_encoder_2"):
        assert next(getattr(pipe, name).parameters()).device.type == "meta"
    placed = []
    for rank in range(4):
        monkeypatch.setenv("RANK", str(rank))
        placed.append([loads_vae_on_gpu(placement, 2) for placement in ("replicated", "rank0")])
    assert placed == [[True, True], [True, False], [True, True], [True, False]]  # each replica's first rank decodes
    assert loads_vae_on_gpu("rank0", 1)


def test_rank0_with_the_parallel_decode_is_refused_at_apply(tiny_flux) -> None:
    import accel
    from accel.errors import UserError
    from accel.hooks import wrappers

    with pytest.raises(UserError) as refused:
        accel.apply(tiny_flux, {"memory": {"vae": "rank0"}, "vae": {"parallel": True}})
    assert str(refused.value) == REFUSAL
    assert wrappers(tiny_flux, "__call__") == []


@pytest.mark.parametrize(
    "argv, line",
    [
        (["run", "tiny-flux", "--gpus", "2", "--vae-placement", "rank0", "--parallel-vae"], REFUSAL),
        (["serve", "tiny-flux", "--gpus", "2", "--vae-placement", "rank0", "--parallel-vae"], REFUSAL),
        (
            ["run", "tiny-flux", "--gpus", "2", "--vae-placement", "rank1"],
            "command line: [memory] vae must be replicated or rank0, got 'rank1'",
        ),
    ],
)
def test_refusals_are_one_line_before_any_rank_starts(argv: list[str], line: str) -> None:
    from typer.testing import CliRunner

    from accel.cli import app

    result = CliRunner().invoke(app, argv, catch_exceptions=False)
    assert result.exit_code == 2
    assert " ".join(result.stderr.split()) == f"error: {line}"


def test_a_recipe_with_an_unknown_vae_placement_is_one_line() -> None:
    from accel.errors import UserError
    from accel.recipe import Recipe

    with pytest.raises(UserError) as refused:
        Recipe.from_dict({"memory": {"vae": "gpu"}}, source="r.toml")
    assert str(refused.value) == "r.toml: [memory] vae must be replicated or rank0, got 'gpu'"
