"""A finished rank leaves within seconds, whatever threads it left running, and the launcher never
hangs on one that does not: compile pools with a cold inductor cache, idle executors, stuck threads,
blocking exit handlers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import IO

import pytest
import commands

from conftest import cold_compile_env
from accel.launch.diagnosis import lingering
from accel.launch.environment import LaunchSpec
from accel.launch.supervisor import Supervisor
from accel.rank_exit import HANDLERS_BOUND_S, THREADS_BOUND_S, threading_exit_hooks

LEAVE_WITHIN_S = 60  # the promise: a finished job is gone within a minute of its last output
# Only a hang trips it: the cold compiled 2-rank run takes about 80 s alone and took 423 s in a suite
# run with two busy loops beside it (load average 14), which a 420 s guard failed.
HANG_GUARD_S = 900


def run_until_gone(
    args: list[str], tmp_path: Path, last_line: str, cold_cache: bool = False, **env: str
) -> tuple[int, float, str, str]:
    """Run `accel ARGS`; (exit code, seconds from the first line starting with `last_line` to the
    exit, stdout, stderr). A job still running a minute after that line fails the test: it is
    interrupted (the launcher stops its ranks), not waited for. `cold_cache`: compile as a new user's
    first run does, from an empty inductor cache with the default compile threads (then the launcher
    is a new interpreter rather than a fork of the preloaded fork server: tests/commands.py)."""
    lines: list[tuple[float, str]] = []
    with (tmp_path / "stderr.txt").open("w+") as errors:
        process = commands.popen(
            [sys.executable, "-m", "accel.cli", *args],
            cwd=tmp_path,
            env=(cold_compile_env(tmp_path, **env) if cold_cache else {**os.environ, **env}) | {"OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
        )
        assert process.stdout is not None
        reader = threading.Thread(
            target=lambda: lines.extend((time.monotonic(), line) for line in process.stdout), daemon=True
        )
        reader.start()
        started = time.monotonic()
        while process.poll() is None:
            seen = [at for at, line in list(lines) if line.startswith(last_line)]
            if time.monotonic() - (seen[0] if seen else started) > (LEAVE_WITHIN_S if seen else HANG_GUARD_S):
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
                waited = (
                    f"{LEAVE_WITHIN_S} s after {last_line!r}" if seen else f"{HANG_GUARD_S} s without {last_line!r}"
                )
                pytest.fail(f"still running {waited}:\n{_text(lines)[-2000:]}\n{_read(errors)[-2000:]}")
            time.sleep(0.1)
        ended = time.monotonic()
        reader.join(timeout=10)
        seen = [at for at, line in lines if line.startswith(last_line)]
        assert seen, _text(lines) + _read(errors)
        return process.returncode, ended - seen[0], _text(lines), _read(errors)


def _text(lines: list[tuple[float, str]]) -> str:
    return "".join(line for _at, line in lines)


def _read(file: IO[str]) -> str:
    file.seek(0)
    return file.read()


def test_a_compiled_two_rank_run_with_a_cold_cache_leaves_after_its_table(tmp_path: Path) -> None:
    """Inductor compiles on a pool of threads (its default on any machine with 2+ cores) that the
    rank never shuts down: the exit must tell its idle workers to leave, as Python's own does. The
    ranks start as new interpreters, as on GPUs (a CPU job's forked ranks leave the same way: the
    4-rank compiled headline run in tests/test_launch.py)."""
    code, after, out, err = run_until_gone(
        [
            "run",
            "tiny-flux",
            "--gpus",
            "2",
            "--compile",
            "--steps",
            "2",
            "--height",
            "48",
            "--width",
            "48",
            "--out",
            "two.png",
        ],
        tmp_path,
        last_line="└",
        cold_cache=True,
        ACCEL_RANK_START="spawn",
    )
    assert code == 0, err
    assert "warm-up (compile)" in out and (tmp_path / "two.png").is_file()
    assert any((tmp_path / "inductor-cache").rglob("*.py")), "the run did not compile into the cold cache it was given"
    assert "warning" not in err, err  # nothing was left behind for the bound to end
    assert after < LEAVE_WITHIN_S


def test_a_launched_script_that_leaves_a_thread_pool_running_exits(tmp_path: Path) -> None:
    script = tmp_path / "pool.py"
    script.write_text(
        textwrap.dedent("""
        import atexit, os
        from concurrent.futures import ThreadPoolExecutor
        from accel.parallel.mesh import init_distributed
        init_distributed("cpu", timeout_s=600)
        pool = ThreadPoolExecutor(2)  # never shut down: its workers wait for more work
        assert pool.submit(sum, [1, 2]).result() == 3
        atexit.register(lambda: os.write(1, b"exit hook ran\\n"))
        print("finished", flush=True)
    """)
    )
    code, after, out, err = run_until_gone(["launch", "--gpus", "2", str(script)], tmp_path, last_line="finished")
    assert code == 0, err
    assert out.count("finished") == 2 and out.count("exit hook ran") == 2  # the exit handlers still run
    assert err == ""
    assert after < 10  # the workers were told to leave; nothing waited for a bound


def test_a_thread_that_never_ends_and_a_blocking_exit_handler_are_named_and_left(tmp_path: Path) -> None:
    """Each bounded step of the exit: rank 0 leaves a thread spinning for ever, rank 1 an exit
    handler that never returns; both ranks leave after their bound with one line each, exit 0."""
    script = tmp_path / "stuck.py"
    script.write_text(
        textwrap.dedent("""
        import atexit, os, threading, time
        from accel.parallel.mesh import init_distributed
        rank, _ = init_distributed("cpu", timeout_s=600)
        def spin():
            while True:
                time.sleep(0.05)
        def never_returns():
            while True:
                time.sleep(0.05)
        if rank == 0:
            threading.Thread(target=spin, name="spinner").start()
            atexit.register(lambda: os.write(1, b"rank 0 exit hook ran\\n"))
        else:
            atexit.register(never_returns)
        print(f"finished {rank}", flush=True)
    """)
    )
    code, after, out, err = run_until_gone(["launch", "--gpus", "2", str(script)], tmp_path, last_line="finished")
    assert code == 0, err
    assert "rank 0 exit hook ran" in out, err  # a stuck thread does not cost the exit handlers
    lines = sorted(err.splitlines())
    assert lines == [
        f"warning: rank 0 leaves 1 thread: 'spinner' at stuck.py:7 in spin still running after {THREADS_BOUND_S:.0f} "
        "s (its work is done)",
        f"warning: rank 1 left without finishing its exit: closing the process groups or an atexit handler was still "
        f"running after {HANDLERS_BOUND_S:.0f} s at stuck.py:10 in never_returns",
    ], err
    assert after < THREADS_BOUND_S + HANDLERS_BOUND_S + 5


def test_the_launcher_ends_a_rank_that_finished_but_does_not_leave(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The last line of defence, for an exit that even the rank's own bound cannot end (a C call
    holding the interpreter, a stopped process): after the grace, the rank is named with where its
    heartbeat saw it, stopped, and the job ends with its real outcome: success."""
    script = tmp_path / "linger.py"
    script.write_text(
        textwrap.dedent("""
        import atexit, os, time
        if os.environ["RANK"] == "1":
            atexit.register(lambda: time.sleep(600))
    """)
    )
    spec = LaunchSpec(nproc=2, finish_grace_s=1.0)
    started = time.monotonic()
    code = Supervisor(spec, [sys.executable, "-m", "accel.launch", str(script)]).run()
    assert code == 0
    assert time.monotonic() - started < 20
    assert capsys.readouterr().err.splitlines() == [
        "warning: rank 1 finished its work but had not exited 1 s later (waiting at linger.py:4 in <lambda>); stopped "
        "it",
    ]


def test_the_threading_exit_hooks_run_newest_first_and_none_without_cpythons_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(
        threading, "_threading_atexits", [lambda: calls.append("first"), lambda: calls.append("second")]
    )
    for hook in threading_exit_hooks():
        hook()
    assert calls == ["second", "first"]  # as threading._shutdown runs them
    monkeypatch.delattr(threading, "_threading_atexits")
    assert threading_exit_hooks() == []


def test_without_cpythons_exit_step_a_finished_process_exits_the_ordinary_way(tmp_path: Path) -> None:
    """The fallback of the one private exit step we call: the handlers then run in Python's own exit."""
    script = tmp_path / "plain.py"
    script.write_text(
        textwrap.dedent("""
        import atexit, os
        from concurrent.futures import ThreadPoolExecutor
        from accel.rank_exit import leave_finished
        del atexit._run_exitfuncs
        pool = ThreadPoolExecutor(1)
        pool.submit(print, "worked", flush=True).result()
        atexit.register(lambda: os.write(1, b"exit hook ran\\n"))
        leave_finished()
    """)
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, "worked\nexit hook ran\n", "")


@pytest.mark.parametrize(
    "beat, where",
    [
        (None, "no heartbeat"),
        ({"time": 99.0, "where": "job.py:3 in <lambda>"}, "waiting at job.py:3 in <lambda>"),
        ({"time": 90.0, "where": "job.py:3 in <lambda>"}, "last seen at job.py:3 in <lambda> 10 s ago"),
    ],
)
def test_a_lingering_rank_is_named_with_where_its_heartbeat_saw_it(beat: dict | None, where: str) -> None:
    assert lingering(1, beat, 30.0, now=100.0) == f"rank 1 finished its work but had not exited 30 s later ({where})"


@pytest.mark.parametrize("verdict", [True, False])
def test_a_ranks_verdict_is_the_jobs_exit_code_and_any_other_code_a_failure(
    verdict: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`accel batch` ends with 1 when items failed (130 after Ctrl-C): its answer, which the launcher
    passes on as the job's code, after the other ranks finish, with no failure diagnosed; the same
    code without the verdict is a rank that failed without a message."""
    script = tmp_path / "verdict.py"
    script.write_text(
        textwrap.dedent(f"""
        import os
        from accel import watchdog
        from accel.rank_exit import end_process
        on_rank = watchdog.start()
        first = os.environ["RANK"] == "0"
        end_process(3 if first else 0, on_rank, verdict=first and {verdict})
    """)
    )
    code = Supervisor(LaunchSpec(nproc=2), [sys.executable, str(script)]).run()
    err = capsys.readouterr().err
    if verdict:
        assert (code, err) == (3, "")
    else:
        assert (code, err) == (1, "error: rank 0 exited with code 3 without a message\n")
