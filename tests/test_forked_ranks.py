"""A CPU job's ranks are forks of the launcher (accel.launch.forked): each starts with what the
launcher loaded, in its own session, with a new interpreter's signal handlers, its own environment
and thread share, and its exit code reaches the supervisor as a spawned rank's does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from accel.errors import UserError
from accel.launch.environment import LaunchSpec
from accel.launch.forked import RANK_START_ENV, can_fork_now, forks_ranks

TESTS = str(Path(__file__).parent)


# The launcher as `accel` runs it: a process of its own that has loaded torch and runs no other thread
# (a pytest worker may have started some, and then spawns instead: tested below).
LAUNCHER = """
import sys
import torch
from accel.launch.environment import LaunchSpec
from accel.launch.supervisor import Supervisor
fork, args = sys.argv[1] == "fork", sys.argv[2:]
command = [sys.executable, "-m", "fork_probe", *args]
sys.exit(Supervisor(LaunchSpec(nproc=2), command, ("fork_probe", args) if fork else None).run())
"""


def _job(folder: Path, codes: tuple[int, int], fork: bool) -> tuple[subprocess.CompletedProcess[str], int]:
    """(the launcher's outcome, its pid) for a job of two fork_probe ranks exiting with `codes`."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (TESTS, os.environ.get("PYTHONPATH")))),
        "OMP_NUM_THREADS": "1",
    }
    arguments = ["fork" if fork else "spawn", str(folder), *map(str, codes)]
    process = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, *arguments], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    out, err = process.communicate(timeout=300)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err), process.pid


def _records(folder: Path) -> list[dict]:
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "spawned"])
def test_ranks_start_as_a_new_interpreter_would(tmp_path: Path, fork: bool) -> None:
    done, launcher = _job(tmp_path, (0, 0), fork)
    assert done.returncode == 0, done.stderr
    for rank, record in enumerate(_records(tmp_path)):
        assert record["rank"] == rank and record["argv"] == [str(tmp_path), "0", "0"]
        assert record["torch_loaded"] is fork  # a fork imports nothing again
        assert record["own_session"] and record["parent"] == launcher
        assert (record["sigint"], record["sigterm"]) == ("default", "default")  # not the supervisor's
        assert (record["threads"], record["omp"]) == (1, "1")


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "spawned"])
def test_a_forked_ranks_exit_code_reaches_the_supervisor(tmp_path: Path, fork: bool) -> None:
    done, _ = _job(tmp_path, (0, 5), fork)
    assert done.returncode == 1
    assert "error: rank 1 exited with code 5 without a message" in done.stderr


def test_only_a_cpu_job_forks_and_spawn_can_be_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RANK_START_ENV, raising=False)
    assert forks_ranks("cpu") and not forks_ranks("cuda")
    monkeypatch.setenv(RANK_START_ENV, "spawn")
    assert not forks_ranks("cpu")
    monkeypatch.setenv(RANK_START_ENV, "fork")
    with pytest.raises(UserError) as refused:
        forks_ranks("cpu")
    assert str(refused.value) == "ACCEL_RANK_START='fork': use auto (fork the ranks of a CPU job) or spawn"


def test_a_launcher_running_another_thread_spawns_instead() -> None:
    """A fork keeps only the calling thread: a lock another thread held would never be released (a
    launcher with one thread forks: the tests above)."""
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        assert not can_fork_now()
    finally:
        release.set()
        other.join()


@pytest.mark.parametrize(("start", "forked"), [("auto", True), ("spawn", False)])
def test_accel_run_on_cpu_ranks_forks_them_unless_asked_to_spawn(
    monkeypatch: pytest.MonkeyPatch, start: str, forked: bool
) -> None:
    from typer.testing import CliRunner

    import accel.launch.supervisor as supervisor
    from accel.cli import app

    launches: list[tuple[int, str, list[str], bool]] = []

    def launch(spec: LaunchSpec, module: str, args: list[str], fork: bool = False) -> int:
        launches.append((spec.nproc, module, args, fork))
        return 0

    monkeypatch.setattr(supervisor, "launch", launch)
    monkeypatch.setenv(RANK_START_ENV, start)
    arguments = ["run", "tiny-flux", "--gpus", "2", "--device", "cpu", "--oversubscribe"]
    result = CliRunner().invoke(app, arguments, obj={"argv": arguments}, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert launches == [(2, "accel.cli", arguments, forked)]
