"""Component placement ([memory]): with text_encoder = "rank0" only the layout's first rank holds
the text encoders and encodes; the others receive the embeddings and equal one process."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import parallel_cases as cases
from test_parallel_families import FAMILY_CASES, TOLERANCE, reference


@pytest.mark.parametrize("family", list(FAMILY_CASES))
def test_first_rank_encodes_for_every_rank(rank_pools, family: str) -> None:
    case = FAMILY_CASES[family]
    expected, _ = reference(family, case.call)
    (lead, lead_encoders), (other, other_encoders) = rank_pools(2).run(
        cases.first_rank_encodes_run, f"tiny-{family}", {"ulysses": 2}, case.call)
    assert lead_encoders and "text_encoder" in lead_encoders
    assert other_encoders == []  # dropped at apply: the memory is given back
    for output in (lead, other):
        assert np.abs(output - expected).max() <= TOLERANCE


def test_ranks_that_do_not_encode_never_load_the_encoders(rank_pools, tmp_path) -> None:
    import accel

    folder = tmp_path / "tiny-wan"
    cases.tiny_pipeline("accel.models.wan:build_tiny").save_pretrained(folder)
    call = FAMILY_CASES["wan"].call
    whole = accel.load_pipeline(str(folder), "float32")
    whole.set_progress_bar_config(disable=True)
    expected = cases.output_of(whole(**call, generator=torch.Generator().manual_seed(0), output_type="np"))
    runs = rank_pools(2).run(cases.first_rank_loads_run, str(folder), call)
    assert [loaded for _, loaded in runs] == [True, False]
    for output, _ in runs:
        assert np.abs(output - expected).max() <= TOLERANCE


def test_an_unknown_placement_is_one_line() -> None:
    run = subprocess.run([sys.executable, "-m", "accel.cli", "run", "tiny-flux", "--gpus", "2", "--text-encoder", "rank1"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == "error: command line: [memory] text_encoder must be replicated or rank0, got 'rank1'"
