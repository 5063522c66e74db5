"""tests/commands.py: a `python -m` command forked from the preloaded fork server is what a new
interpreter running it is, as far as a test can read (streams, folder, environment, exit codes,
signals, exit handlers)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import commands

TESTS = str(Path(__file__).parent)
ENV = {**os.environ, "PYTHONPATH": TESTS, "PROBE_VALUE": "seen"}


def _both(args: list[str], tmp_path: Path, **options: object) -> tuple[object, object]:
    argv = [sys.executable, "-m", "command_probe", *args]
    forked = commands.run(argv, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120, **options)
    fresh = subprocess.run(argv, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120, **options)
    return forked, fresh


@contextmanager
def _sigint(ignored: bool) -> Iterator[None]:
    """This process's SIGINT ignored or Python's own handler inside the block (a pytest-xdist worker
    ignores it; a serial run does not), put back after."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN if ignored else signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize(
    "args, new_session, sigint_ignored",
    [
        (["report", "0", "x y"], False, False),
        (["report", "3"], True, True),
        (["exit"], False, False),
        (["raise"], False, False),
    ],
)
def test_a_forked_command_prints_and_exits_as_a_new_interpreter(
    tmp_path: Path, args: list[str], new_session: bool, sigint_ignored: bool
) -> None:
    with _sigint(sigint_ignored):
        forked, fresh = _both(args, tmp_path, input="from stdin\n", start_new_session=new_session)
    assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout)
    assert forked.stderr.splitlines()[-1:] == fresh.stderr.splitlines()[-1:]
    if args[0] == "report":
        assert forked.stdout.startswith(f"cwd {tmp_path}\nenv seen True\n")
        assert f"stdin from stdin\nsession {new_session}\nsigint {not sigint_ignored}\n" in forked.stdout
        assert forked.stderr == "to stderr\n"
    if args[0] == "exit":
        assert (forked.returncode, forked.stdout, forked.stderr) == (
            1,
            "thread done\natexit\n",
            "a message as the exit code\n",
        )
    if args[0] == "raise":
        assert forked.returncode == 1 and forked.stderr.splitlines()[-1] == "ValueError: probe failed"


def test_a_forked_command_is_not_a_new_interpreter() -> None:
    """The fork is what saves the imports: the command runs in a process that has torch already."""
    probe = commands.popen([sys.executable, "-m", "command_probe", "wait"], env=ENV, stdout=subprocess.PIPE, text=True)
    assert probe.stdout.readline() == "waiting\n"
    assert b"forkserver" in Path(f"/proc/{probe.pid}/cmdline").read_bytes()
    probe.kill()
    assert probe.wait(timeout=30) == -signal.SIGKILL


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_a_forked_command_as_it_ends_a_new_interpreter(sig: int) -> None:
    """SIGTERM by its default action; SIGINT through KeyboardInterrupt, its traceback, then the signal."""
    ends = []
    for start in (commands.popen, subprocess.Popen):
        with _sigint(ignored=False):
            probe = start(
                [sys.executable, "-m", "command_probe", "wait"], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
        assert probe.stdout.readline() == b"waiting\n"
        probe.send_signal(sig)
        _, err = probe.communicate(timeout=60)
        ends.append((probe.returncode, err.splitlines()[-1:]))
    assert ends[0] == ends[1] and ends[0][0] == -sig


def test_a_file_of_the_tests_takes_both_streams_and_stays_open(tmp_path: Path) -> None:
    with (tmp_path / "out.txt").open("w+") as out:
        done = commands.run(
            [sys.executable, "-m", "command_probe", "report", "0"], env=ENV, stdout=out, stderr=subprocess.STDOUT
        )
        out.write("after\n")
        out.seek(0)
        text = out.read()
    assert done.returncode == 0 and (done.stdout, done.stderr) == (None, None)
    assert "to stderr\n" in text and "argv ['report', '0']\n" in text and text.endswith("after\n")


LEAVES_ONE_RUNNING = """
import subprocess, sys
import commands
probe = commands.popen([sys.executable, "-m", "command_probe", "wait"], stdout=subprocess.PIPE)
print(probe.stdout.readline().decode().strip(), probe.pid, flush=True)
"""


def test_a_process_that_leaves_a_forked_command_running_still_exits_and_ends_it() -> None:
    """multiprocessing waits at exit for every child it started: a test that failed before ending its
    server would hang its pytest worker for good, where a subprocess would only be orphaned."""
    done = subprocess.run(
        [sys.executable, "-c", LEAVES_ONE_RUNNING], env=ENV, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    word, pid = done.stdout.split()
    assert word == "waiting" and not Path(f"/proc/{pid}").exists()


def test_a_command_that_sets_inductor_otherwise_starts_a_new_interpreter(tmp_path: Path) -> None:
    """torch reads TORCHINDUCTOR_* once, when imported: a fork would compile with the fork server's settings."""
    argv = [sys.executable, "-m", "command_probe", "inductor"]
    same = commands.run(argv, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    threads, parent = map(int, same.stdout.split())
    assert parent != os.getpid()  # forked, by the fork server
    other = {**ENV, "TORCHINDUCTOR_COMPILE_THREADS": str(threads + 1)}
    changed = commands.run(argv, cwd=tmp_path, env=other, capture_output=True, text=True, timeout=120)
    assert changed.stdout.split() == [str(threads + 1), str(os.getpid())], changed.stderr
