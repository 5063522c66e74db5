"""Fault injection on real gloo ranks under `accel launch`: a rank that raises, exits, is killed or
hangs ends the job quickly and is named; Ctrl-C / SIGTERM / SIGKILL of the launcher leave no
process, no job folder and no partial output.

Timings are checked against generous bounds only; benchmarks/faults.py measures the figures.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import commands

RANK_SCRIPT = Path(__file__).with_name("fault_rank.py")
ENDS_WITHIN_S = 5.0  # the bound from the fault to the launcher's exit
START_GUARD_S = 120


def _env(tmp_path: Path) -> dict[str, str]:
    temp = tmp_path / "tmp"  # the launcher's job folder lands here, so a leftover one is visible
    temp.mkdir(exist_ok=True)
    return dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(temp))


def _start(tmp_path: Path, kind: str, failing: int = 1, gpus: int = 2, *extra: str) -> subprocess.Popen[str]:
    command = [
        sys.executable,
        "-m",
        "accel.cli",
        "launch",
        "--gpus",
        str(gpus),
        *extra,
        str(RANK_SCRIPT),
        str(tmp_path),
        kind,
        str(failing),
    ]
    return commands.popen(
        command, cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _finish(launcher: subprocess.Popen[str], timeout: float = START_GUARD_S) -> tuple[int, str, float]:
    """(exit code, stdout + stderr, the moment the launcher was seen gone)."""
    stdout, stderr = launcher.communicate(timeout=timeout)
    return launcher.returncode, stdout + stderr, time.time()


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def _wait_for(path: Path, timeout: float = START_GUARD_S) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            tree.setdefault(parent, []).append(int(entry.name))
    return tree


def _process_tree(root: int) -> set[int]:
    """Every descendant of `root` (ranks run in their own sessions, but remain its children)."""
    tree, found, todo = _children(), set(), [root]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _assert_clean(tmp_path: Path, processes: set[int]) -> None:
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in processes) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in processes if _alive(pid)], "a rank outlived the job"
    assert list((tmp_path / "tmp").iterdir()) == [], "the job folder was left behind"


@pytest.mark.parametrize(
    "kind, cause",
    [
        ("raise", "rank 1: ValueError: rank 1 cannot go on"),
        ("exit", "rank 1 exited with code 3 without a message"),
        ("kill", "rank 1 was killed by signal 9 (SIGKILL)"),
    ],
)
def test_a_failing_rank_ends_the_job_within_seconds_and_is_named_first(tmp_path: Path, kind: str, cause: str) -> None:
    launcher = _start(tmp_path, kind)
    code, stderr, ended = _finish(launcher)
    failed_at = float((tmp_path / "failed-at").read_text())
    assert code == 1, stderr
    errors = _error_lines(stderr)
    assert errors[0] == f"error: {cause}"
    # rank 0's "connection reset" follows from it: one summary line, never shown as a cause
    assert errors[1:] == [] or (len(errors) == 2 and errors[1].startswith("error: rank 0 stopped with it (")), errors
    assert "Connection reset" not in "\n".join(errors[:1])
    assert "Traceback" not in stderr or kind == "raise"  # the failing script's own traceback is useful
    assert "finished" not in stderr
    assert ended - failed_at < ENDS_WITHIN_S
    _assert_clean(tmp_path, set())


def test_the_last_of_three_ranks_failing_is_named_and_stops_the_others(tmp_path: Path) -> None:
    code, stderr, ended = _finish(_start(tmp_path, "raise", 2, 3, "--oversubscribe"))
    assert code == 1
    errors = _error_lines(stderr)
    assert errors[0] == "error: rank 2: ValueError: rank 2 cannot go on"
    assert all(line.startswith("error: ranks 0, 1 stopped with it (") for line in errors[1:]), errors
    assert ended - float((tmp_path / "failed-at").read_text()) < ENDS_WITHIN_S
    _assert_clean(tmp_path, set())


def test_a_hung_rank_is_named_with_where_it_stopped(tmp_path: Path) -> None:
    code, stderr, ended = _finish(_start(tmp_path, "hang", 1, 2, "--timeout", "3"))
    assert code == 1
    errors = _error_lines(stderr)
    assert errors[0].startswith("error: rank 1 stopped making progress: rank 0 ")
    assert "waited 3 s for it in a collective" in errors[0] or "gave up waiting for it in a collective" in errors[0]
    assert errors[0].endswith("(rank 1 was at fault_rank.py:52 in <module>)"), errors
    assert ended - float((tmp_path / "failed-at").read_text()) < 3 + ENDS_WITHIN_S
    _assert_clean(tmp_path, set())


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_and_sigterm_stop_every_rank_with_one_line(tmp_path: Path, signum: int, code: int) -> None:
    launcher = _start(tmp_path, "write")
    for rank in (0, 1):
        _wait_for(tmp_path / f"ready-{rank}")
    _wait_for(tmp_path / "writing")  # rank 0 is in the middle of writing out.bin
    processes = _process_tree(launcher.pid)
    assert len(processes) >= 2
    launcher.send_signal(signum)
    returncode, stderr, _ = _finish(launcher, timeout=10)
    assert returncode == code
    assert stderr.strip() == "interrupted"
    _assert_clean(tmp_path, processes)
    assert not (tmp_path / "out.bin").exists()
    assert not [p.name for p in tmp_path.iterdir() if "accel" in p.name], "a half-written output was left behind"


def test_ranks_of_a_killed_launcher_exit_without_writing_outputs(tmp_path: Path) -> None:
    launcher = _start(tmp_path, "late-output")
    for rank in (0, 1):
        _wait_for(tmp_path / f"ready-{rank}")
    ready = time.monotonic()
    processes = _process_tree(launcher.pid)
    launcher.kill()
    launcher.wait()
    killed = time.monotonic()
    while any(_alive(pid) for pid in processes) and time.monotonic() - killed < ENDS_WITHIN_S:
        time.sleep(0.05)
    assert not [pid for pid in processes if _alive(pid)], "ranks went on without their launcher"
    time.sleep(max(0.0, ready + 3.5 - time.monotonic()))  # past the moment rank 0 would have written its output
    assert not (tmp_path / "output.txt").exists()
    assert list((tmp_path / "tmp").iterdir()) == []


# The launcher's judgement on what the ranks left behind, without starting any.


def _beat(rank: int, waiting: bool, since: float, where: str, time_: float = 100.0) -> dict:
    return {"rank": rank, "waiting": waiting, "since": since, "where": where, "time": time_}


def test_a_rank_the_others_wait_for_is_named_once_they_waited_the_timeout() -> None:
    from accel.launch.diagnosis import stall

    beats = {
        0: _beat(0, True, 90.0, "a.py:3 in f"),
        1: _beat(1, False, 99.0, "b.py:7 in g"),
        2: _beat(2, True, 95.0, "a.py:3 in f"),
    }
    assert stall(beats, {0, 1, 2}, 20.0, 100.0) is None  # nobody waited 20 s yet
    assert stall(beats, {0, 1, 2}, 10.0, 100.0) == (
        "rank 1 stopped making progress: ranks 0, 2 waited 10 s for it in a collective (rank 1 was at b.py:7 in g)"
    )
    frozen = {0: _beat(0, True, 80.0, "a.py:3 in f"), 1: _beat(1, False, 50.0, "b.py:7 in g", time_=60.0)}
    assert stall(frozen, {0, 1}, 10.0, 100.0) == (
        "rank 1 stopped responding (no heartbeat); rank 0 waited 20 s for it in a collective"
    )
    deadlock = {0: _beat(0, True, 80.0, "a.py:3 in f"), 1: _beat(1, True, 85.0, "b.py:9 in h")}
    assert stall(deadlock, {0, 1}, 10.0, 100.0) == (
        "every rank waited 20 s in a collective the others never joined (rank 0 at a.py:3 in f; rank 1 at b.py:9 in h)"
    )


def test_the_cause_comes_first_and_follow_on_errors_are_one_line() -> None:
    from accel.launch.diagnosis import failure_report

    reset = (
        "RuntimeError: [../gloo/pair.cc:545] Read error [127.0.0.1]:25812: Connection reset by peer. This is "
        "typically caused by"
    )
    lost = [
        {"rank": 0, "message": reset, "exit_code": 1, "lost": True},
        {"rank": 2, "message": reset, "exit_code": 1, "lost": True},
    ]
    # rank 1 died without a word; ranks 0 and 2 only lost it
    assert failure_report(lost, {0: 1, 1: -9, 2: 1}, {}, None) == (
        [
            "rank 1 was killed by signal 9 (SIGKILL)",
            "ranks 0, 2 stopped with it (RuntimeError: Read error Connection reset by peer)",
        ],
        1,
    )
    same = [{"rank": r, "message": "--out x.mp4: wrong suffix", "exit_code": 2, "lost": False} for r in (0, 1)]
    assert failure_report(same, {0: 2, 1: 2}, {}, None) == (["--out x.mp4: wrong suffix"], 2)
    timed_out = [{"rank": 0, "message": "DistBackendError: timed out", "exit_code": 1, "lost": True}]
    beats = {0: _beat(0, True, 90.0, "a.py:3 in f"), 1: _beat(1, False, 99.0, "b.py:7 in g")}
    lines, code = failure_report(timed_out, {0: 1}, beats, None)
    assert (lines[0], code) == (
        "rank 1 stopped making progress: rank 0 gave up waiting for it in a collective (rank 1 was at b.py:7 in g)",
        1,
    )


def test_ctrl_c_of_a_single_process_run_is_one_line(tmp_path: Path) -> None:
    """No launcher: the lone process unwinds (its outputs' temporaries are removed on the way) to one line."""
    run = commands.popen(
        [sys.executable, "-m", "accel.cli", "run", "tiny-flux", "--steps", "200", "--out", "x.png"],
        cwd=tmp_path,
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for(tmp_path / ".x.png.accel-lock")  # claimed: the run is past its checks and loading
    run.send_signal(signal.SIGINT)
    code, output, _ = _finish(run, timeout=30)
    # Before it, only what a piped run says while it works: the load, then a line a quarter of the steps.
    *progress, last = output.strip().splitlines()
    assert (code, last) == (130, "interrupted")
    assert all(
        re.fullmatch(
            r"loading tiny-flux…|loaded tiny-flux in \d+\.\d s|generating(: warm-up 1/1)?: step \d+/200, \d+\.\d s",
            line,
        )
        for line in progress
    ), progress
    assert [p.name for p in tmp_path.iterdir() if p.name != "tmp"] == []  # no image, no temporary, no lock


LOST_IN_A_FINALIZER = """
import os, signal, sys
from pathlib import Path
from accel import interrupts
from accel.files.publish import write_file
from accel.steps import StepEvents

class Finalized:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)  # the handler runs here, inside __del__

interrupts.install()
Finalized()  # collected at once: Python prints nothing (the hook) and carries on
print("carried on", flush=True)
where = sys.argv[2]
try:
    if where == "output":
        write_file(Path(sys.argv[1]), lambda temp: temp.write_text("picture"), replace=True)
    else:
        class Scheduler:
            def set_timesteps(self, n): self.timesteps = list(range(n))
            def step(self): return "stepped"
        events = StepEvents(Scheduler())
        events.scheduler.step()
except interrupts.Interrupted as interruption:
    print("interrupted", interruption.signum)
"""


@pytest.mark.parametrize("where", ["output", "step"])
def test_an_interruption_lost_in_a_finalizer_still_stops_the_run(tmp_path: Path, where: str) -> None:
    """A Ctrl-C that lands while Python runs a __del__ is swallowed there ("Exception ignored");
    it is raised again at the next denoising step or before an output file takes its name, so the
    run ends interrupted with nothing written (seen once in CI: a run that exited 0 after Ctrl-C)."""
    out = tmp_path / "x.png"
    done = subprocess.run(
        [sys.executable, "-c", LOST_IN_A_FINALIZER, str(out), where], capture_output=True, text=True, timeout=120
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "carried on\ninterrupted 2\n", "")
    assert list(tmp_path.iterdir()) == []


def test_a_deliberate_wait_is_not_a_stall(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """accel bench parks idle ranks in a barrier for a whole variant: their heartbeat must not say
    "waiting", or the launcher would end a long one-GPU baseline as a stall."""
    import json

    from accel import watchdog

    monkeypatch.setattr(watchdog, "describe", lambda frame: (True, "bench.py:360 in barrier"))  # as inside dist.barrier
    beat = watchdog.Heartbeat(tmp_path, 0, os.getppid(), 0)
    beat.write()
    assert json.loads((tmp_path / "beat-0.json").read_text())["waiting"] is True
    with watchdog.idle():
        beat.write()
        assert json.loads((tmp_path / "beat-0.json").read_text())["waiting"] is False
    beat.write()
    assert json.loads((tmp_path / "beat-0.json").read_text())["waiting"] is True
