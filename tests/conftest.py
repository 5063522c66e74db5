"""Shared fixtures: tiny pipelines built once per session, and a standard small generation."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the suite may reach a model hub
# pytest-xdist's workers start with COLUMNS=80 and LINES=24 set: rich would fix every console's width
# at 80 from them (and so would the commands the tests start), where a serial run lets a test's own
# COLUMNS choose. Each worker runs as a serial run does.
if "PYTEST_XDIST_WORKER" in os.environ:
    for name in ("COLUMNS", "LINES"):
        os.environ.pop(name, None)
# Verdicts of automatic parallel plans go to a folder of this session's, not the user's cache (rank
# pools, pytest's workers and spawned commands inherit it), removed when the process that made it ends
# (not by a fork of it: those leave through the same exit handlers).
if "ACCEL_CACHE_DIR" not in os.environ:
    os.environ["ACCEL_CACHE_DIR"] = tempfile.mkdtemp(prefix="accel-test-cache-")
    atexit.register(
        lambda folder=os.environ["ACCEL_CACHE_DIR"], maker=os.getpid(): (
            os.getpid() == maker and shutil.rmtree(folder, ignore_errors=True)
        )
    )

FLUX_CALL = dict(prompt="a red fox", height=64, width=64, num_inference_steps=4, guidance_scale=3.5)
WAN_CALL = dict(
    prompt="a red fox",
    negative_prompt="blurry",
    height=64,
    width=64,
    num_frames=5,
    num_inference_steps=4,
    guidance_scale=5.0,
)


def cold_compile_env(folder: Path, pool: bool = True, **extra: str) -> dict[str, str]:
    """The environment of a process that compiles as a new user's does: an empty inductor cache of its
    own (a warm one skips the compile pool, and with it the exits that hang on it) and inductor's
    default compile threads. Without `pool`, each rank compiles in its own process: on two cores a
    pool of compile workers per rank (each importing torch) costs more than it saves (a cold 4-rank
    compiled run alone: 100 s with the pools, 76 s without); the pool's exit is test_rank_exit's."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_COMPILE_THREADS"}
    if not pool:
        env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    return {**env, "HF_HUB_OFFLINE": "1", "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor-cache"), **extra}


def generate(pipe: Any, call: dict[str, Any], seed: int = 0) -> np.ndarray:
    from accel.generate import output_array

    result = pipe(**call, generator=torch.Generator().manual_seed(seed), output_type="np")
    return np.asarray(output_array(result, pipe))  # frames, images, or the field the family names (Cosmos 3's video)


@pytest.fixture(scope="session")
def tiny_flux() -> Any:
    import accel

    pipe = accel.load_pipeline("tiny-flux")
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="session")
def tiny_wan() -> Any:
    import accel

    pipe = accel.load_pipeline("tiny-wan")
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="session")
def flux_reference(tiny_flux: Any) -> np.ndarray:
    return generate(tiny_flux, FLUX_CALL)


@pytest.fixture(scope="session")
def wan_reference(tiny_wan: Any) -> np.ndarray:
    return generate(tiny_wan, WAN_CALL)


@pytest.fixture(scope="session")
def rank_pools() -> Any:
    """The session's persistent gloo ranks, started on first use: `rank_pools(2).run(fn, ...)` runs on
    the first two, joined in a group of two (tests/rankpool.py)."""
    from rankpool import RankPool

    pool = RankPool()
    yield pool.sized
    pool.close()


@pytest.fixture(autouse=True)
def _registry_unchanged() -> Any:
    """Every test leaves the family registry as it found it, order included: the registry is shared
    by the whole run, and a test that changes it (deleting a family and putting it back reorders
    it) makes a later test fail far from the cause."""
    from accel.models import registry

    before = list(registry.FAMILIES.items())
    yield
    assert list(registry.FAMILIES.items()) == before, "this test left the family registry changed"
