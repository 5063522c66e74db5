"""Multi-process start-up end to end: relaunch under torchrun, no relaunch inside it, failing ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import commands
from PIL import Image

from conftest import FLUX_CALL, WAN_CALL, cold_compile_env

ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
# A hang fails the test instead of stalling the suite; far above the slowest run here (the 4-rank cold
# compile: about 130 s on a quiet 2-core machine), so that a load of 4 does not fail it.
HANG_GUARD_S = 900


def _run(args: list[str], cwd: Path, env: dict[str, str] = ENV) -> subprocess.CompletedProcess[str]:
    """A fork of the preloaded fork server, or a new interpreter where `env` sets inductor otherwise
    (tests/commands.py)."""
    return commands.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)


def _accel(*args: str, cwd: Path, env: dict[str, str] = ENV) -> subprocess.CompletedProcess[str]:
    return _run([sys.executable, "-m", "accel.cli", *args], cwd, env)


def _pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)


@pytest.fixture(scope="module")
def flux_one(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-flux's picture from one process at its defaults (the warm-up changes nothing in it)."""
    folder = tmp_path_factory.mktemp("one")
    one = _accel("run", "tiny-flux", "--warmup", "0", "--out", "one.png", cwd=folder)
    assert one.returncode == 0, one.stderr
    return folder / "one.png"


def test_gpus_2_relaunches_and_writes_the_single_process_image(tmp_path: Path, flux_one: Path) -> None:
    two = _accel("run", "tiny-flux", "--gpus", "2", "--out", "two.png", "--json", "two.json", "--verbose", cwd=tmp_path)
    assert two.returncode == 0, two.stderr
    assert two.stdout.count("accel run tiny-flux") == 1  # rank 0 alone prints
    assert "ulysses 2 (chosen for 2 processes)" in two.stdout
    assert "Bytes sent by rank 0" in two.stdout and "all_to_all" in two.stdout  # --verbose
    parallel = json.loads((tmp_path / "two.json").read_text())["parallel"]
    assert (parallel["world_size"], parallel["ulysses"], parallel["ring"], parallel["chosen"]) == (2, 2, 1, True)
    assert parallel["bytes_sent_per_rank"]["all_to_all"] > 0
    assert np.abs(_pixels(flux_one) - _pixels(tmp_path / "two.png")).max() <= 1


def test_under_torchrun_the_command_uses_the_jobs_ranks(tmp_path: Path) -> None:
    result = _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "accel.cli",
            "run",
            "tiny-flux",
            "--ring",
            "2",
            "--out",
            "t.png",
            "--json",
            "t.json",
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    # A relaunch would start a second torchrun per rank: two jobs, two tables.
    assert result.stdout.count("accel run tiny-flux") == 1
    assert json.loads((tmp_path / "t.json").read_text())["parallel"]["ring"] == 2
    assert (tmp_path / "t.png").is_file()


def test_an_error_every_rank_hits_is_shown_once(tmp_path: Path) -> None:
    """A saved folder's family is known only on the ranks (an alias's --out is checked before they start)."""
    import accel

    accel.load_pipeline("tiny-flux").save_pretrained(tmp_path / "saved-flux")
    result = _accel(
        "run",
        "saved-flux",
        "--gpus",
        "2",
        "--height",
        "48",
        "--width",
        "48",
        "--steps",
        "1",
        "--out",
        "x.mp4",
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --out x.mp4: FLUX.1 makes images, so the name must end in .png"


@pytest.mark.parametrize(
    "model, call, parallel",
    [("tiny-flux", FLUX_CALL, {"ulysses": 2}), ("tiny-wan", WAN_CALL, {"cfg": 2})],
    ids=["flux-ulysses2", "wan-cfg2"],
)
def test_apply_in_a_users_script_joins_the_job(
    tmp_path: Path, request: pytest.FixtureRequest, model: str, call: dict, parallel: dict
) -> None:
    """The process group comes from the environment; every rank returns the full output."""
    reference = request.getfixturevalue("flux_reference" if model == "tiny-flux" else "wan_reference")
    script = tmp_path / "mine.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys, numpy as np, torch, torch.distributed as dist
        import accel
        pipe = accel.load_pipeline({model!r})
        pipe.set_progress_bar_config(disable=True)
        accel.apply(pipe, {{"parallel": {parallel!r}}})
        # Ranks seed differently on purpose: rank 0's noise must win.
        seed = 0 if not dist.is_initialized() or dist.get_rank() == 0 else 7
        result = pipe(**{call!r}, generator=torch.Generator().manual_seed(seed), output_type="np")
        output = result.frames if hasattr(result, "frames") else result.images
        np.save(f"{{sys.argv[1]}}/rank{{dist.get_rank()}}.npy", np.asarray(output))
    """)
    )
    result = _accel("launch", "--gpus", "2", str(script), str(tmp_path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert np.abs(np.load(tmp_path / f"rank{rank}.npy") - reference).max() <= 1e-4


def test_cfg_and_ulysses_on_four_ranks_write_the_single_process_video(tmp_path: Path) -> None:
    from accel.media import read_video

    args = ("run", "tiny-cogvideox", "--steps", "3", "--warmup", "0")
    one = _accel(*args, "--out", "one.mp4", cwd=tmp_path)
    four = _accel(
        *args,
        "--gpus",
        "4",
        "--oversubscribe",
        "--cfg-parallel",
        "--ulysses",
        "2",
        "--out",
        "four.mp4",
        "--json",
        "four.json",
        cwd=tmp_path,
    )
    assert one.returncode == 0, one.stderr
    assert four.returncode == 0, four.stderr
    parallel = json.loads((tmp_path / "four.json").read_text())["parallel"]
    assert (parallel["world_size"], parallel["ulysses"], parallel["ring"], parallel["cfg"]) == (4, 2, 1, 2)
    frames_one, frames_four = read_video(tmp_path / "one.mp4"), read_video(tmp_path / "four.mp4")
    assert frames_one.shape == frames_four.shape and frames_one.shape[0] == 9
    # The outputs agree to 1e-5 (test_parallel_families); a pixel rounding the other way can move
    # H.264's choices, so the encoded frames agree on average, where a wrong run is off by tens.
    assert np.abs(frames_one.astype(np.int16) - frames_four.astype(np.int16)).mean() < 0.5


def test_parallel_vae_from_the_cli_writes_the_single_process_image(tmp_path: Path, flux_one: Path) -> None:
    """--parallel-vae through the command line's relaunch; every family's VAE split equals its whole
    decode on 2-4 ranks in tests/test_parallel_vae.py (Wan's at a row count 3 ranks do not divide)."""
    two = _accel(
        "run",
        "tiny-flux",
        "--warmup",
        "0",
        "--gpus",
        "2",
        "--parallel-vae",
        "--out",
        "two.png",
        "--json",
        "two.json",
        cwd=tmp_path,
    )
    assert two.returncode == 0, two.stderr
    assert json.loads((tmp_path / "two.json").read_text())["parallel"]["vae_split"] is True
    assert np.abs(_pixels(flux_one) - _pixels(tmp_path / "two.png")).max() <= 1


def test_collective_timeout_ends_a_job_whose_rank_never_arrives(tmp_path: Path) -> None:
    """[parallel] timeout reaches the process group: rank 0 gives up after 3 s instead of waiting
    for rank 1's 200 s sleep (the job would otherwise finish, with exit code 0)."""
    script = tmp_path / "slow.py"
    script.write_text(
        textwrap.dedent("""
        import time, torch.distributed as dist
        from accel.parallel.mesh import init_distributed
        init_distributed("cpu", timeout_s=3)
        if dist.get_rank() == 1:
            time.sleep(200)
        dist.barrier()
        print("finished")
    """)
    )
    result = _accel("launch", "--gpus", "2", str(script), cwd=tmp_path)
    assert result.returncode == 1 and "finished" not in result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    # rank 0's time-out is the consequence; the heartbeats name the rank it waited for, and where
    assert errors[0].startswith(
        "error: rank 1 stopped making progress: rank 0 gave up waiting for it in a collective (rank 1 was at "
        "slow.py:6 in <module>)"
    )
    assert errors[1].startswith("error: rank 0 stopped with it (") and "Timed out waiting 3000ms" in errors[1]


def test_a_finished_rank_ends_as_python_would_with_its_process_groups_closed(tmp_path: Path) -> None:
    """A finished rank skips interpreter finalization (where gloo's threads can abort it with
    SIGABRT after its work succeeded), but what a script relies on at exit still happens, in
    Python's order: its other threads finish, then its exit hooks run, the groups already closed."""
    script = tmp_path / "groups.py"
    script.write_text(
        textwrap.dedent("""
        import atexit, os, threading, time, torch.distributed as dist
        from accel.parallel.mesh import init_distributed
        say = lambda text: os.write(1, f"{text}\\n".encode())  # one write: the ranks share stdout
        init_distributed("cpu", timeout_s=600)
        dist.new_group([0, 1])
        dist.barrier()
        rank = dist.get_rank()
        atexit.register(lambda: say(f"exit hook {rank}: open={dist.is_initialized()}"))
        threading.Thread(target=lambda: (time.sleep(0.5), say(f"thread {rank} done"))).start()
    """)
    )
    result = _accel("launch", "--gpus", "2", str(script), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        lines = result.stdout.splitlines()
        assert lines.index(f"thread {rank} done") < lines.index(f"exit hook {rank}: open=False"), result.stdout


def test_headline_command_runs_on_four_cpu_ranks(tmp_path: Path) -> None:
    """`accel run flux --gpus 4 --cache 0.08 --compile`, with the tiny FLUX: it compiles on every
    rank (from a cold inductor cache, as a new user's; in each rank's process: a cold compile pool's
    exit is tests/test_rank_exit.py's), and the picture equals the one-process eager run with the
    same cache."""
    one = _accel("run", "tiny-flux", "--cache", "0.08", "--out", "one.png", cwd=tmp_path)
    four = _accel(
        "run",
        "tiny-flux",
        "--gpus",
        "4",
        "--oversubscribe",
        "--cache",
        "0.08",
        "--compile",
        "--out",
        "four.png",
        "--json",
        "four.json",
        "--verbose",
        cwd=tmp_path,
        env=cold_compile_env(tmp_path, pool=False, OMP_NUM_THREADS="1"),  # a new interpreter
    )
    assert one.returncode == 0, one.stderr
    assert four.returncode == 0, four.stderr
    assert four.stdout.count("accel run tiny-flux") == 1 and "warm-up (compile)" in four.stdout
    assert "not counted with --compile" in four.stdout
    report = json.loads((tmp_path / "four.json").read_text())
    assert report["compile"]["graphs_warmup"] > 0 and report["compile"]["graphs_timed"] == 0
    assert report["compile"]["compiled_modules"] == 4  # tiny-flux: 2 double- and 2 single-stream blocks
    assert (report["parallel"]["world_size"], report["parallel"]["bytes_sent_per_rank"]) == (4, None)
    assert np.abs(_pixels(tmp_path / "one.png") - _pixels(tmp_path / "four.png")).max() <= 1
