"""Ranks of a CPU job forked from the launcher instead of started as new interpreters.

A new rank spends seconds of CPU importing torch, diffusers and transformers before its first step;
the launcher of an `accel` command has imported them already to check the job before any rank
starts. On a CPU job each rank is therefore a fork of the launcher that runs `python -m module args`
in place: same environment, own session, exit code through `waitpid`, as a spawned rank has them.
Seen from outside, a forked rank's command line and `/proc/PID/environ` are the launcher's (its
`os.environ` is its own): tools find ranks as the launcher's children. Its exit runs the `atexit`
handlers it inherited, which the modules both import register (the launcher registers none of its own).

A GPU job keeps spawning: a process that has touched CUDA cannot hand it to a fork, and each rank must
own its device from a fresh start. `ACCEL_RANK_START=spawn` spawns on a CPU job too.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NoReturn

from accel.errors import UserError

RANK_START_ENV = "ACCEL_RANK_START"
RANK_STARTS = ("auto", "spawn")


def forks_ranks(device: str) -> bool:
    """Whether a job whose ranks compute on `device` (resolved: "cpu", "cuda", …) forks them."""
    choice = os.environ.get(RANK_START_ENV, "auto") or "auto"
    if choice not in RANK_STARTS:
        raise UserError(f"{RANK_START_ENV}={choice!r}: use auto (fork the ranks of a CPU job) or spawn")
    return choice == "auto" and device == "cpu" and hasattr(os, "fork")


def can_fork_now() -> bool:
    """Forking is safe from this process now: one Python thread (a fork keeps only the caller, so a
    lock another one held would never be released) and CUDA untouched."""
    torch = sys.modules.get("torch")
    cuda_touched = torch is not None and torch.cuda.is_initialized()
    return threading.active_count() == 1 and not cuda_touched


@dataclass
class ForkedRank:
    """What the supervisor reads of a rank process (`subprocess.Popen`'s `pid`, `poll`, `wait` and
    `returncode`), for a child of this process that `os.fork` made."""

    pid: int
    returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def fork_rank(module: str, args: list[str], env: Mapping[str, str]) -> ForkedRank:
    """Start `python -m module args` with `env` as a fork of this process, in its own session."""
    for stream in (sys.stdout, sys.stderr):  # not written twice, by the launcher and by the rank
        stream.flush()
    pid = os.fork()
    if pid:
        return ForkedRank(pid)
    _run_as_rank(module, args, env)


def _run_as_rank(module: str, args: list[str], env: Mapping[str, str]) -> NoReturn:
    """The child's side: become what a new interpreter running the module would be, run it, and
    leave with `os._exit` (never back into the launcher's frames and `finally` blocks)."""
    from accel.launch.reports import exit_code
    from accel.rank_exit import exit_now

    code = 1
    try:
        os.setsid()  # Ctrl-C reaches only the launcher, which stops each rank's whole group
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a new interpreter's handlers,
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the launcher's
        sys.unraisablehook = sys.__unraisablehook__
        os.environ.clear()
        os.environ.update(env)
        torch = sys.modules.get("torch")
        threads = env.get("OMP_NUM_THREADS")
        if torch is not None and threads:  # read once when torch loaded, in the launcher: this rank's share
            torch.set_num_threads(int(threads))
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit:
        code = exit_code(exit)
    except BaseException:  # noqa: BLE001 - as an interpreter would: the traceback, exit code 1
        traceback.print_exc()
    exit_now(code)
