"""`accel run` in the test's own process, as the console script runs it: a run in a process of its own
pays about 6.5 s of CPU importing torch, diffusers and transformers before a tiny model's second of
work. Tests about the process itself (the console script, signals, what a fresh interpreter prints or
imports, several ranks, servers) keep their subprocesses."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from typer.testing import CliRunner

from accel.cli import app


def accel_run(*args: str, threads: int | None = None) -> Any:
    """`accel run ARGS` here: click's Result (exit_code, stdout, stderr). main()'s command line goes
    with it (the report's `accel run …` line; main() hands it over the same way), and an exception the
    command does not turn into an exit code is raised in the test, where a lone process would print
    its traceback. `threads`: compute on that many CPU threads, as a process started with
    OMP_NUM_THREADS=N does, for a run whose bytes are compared with such a process's."""
    argv = ["run", *args]
    with _threads(threads):
        env = None if threads is None else {"OMP_NUM_THREADS": str(threads)}
        return CliRunner().invoke(app, argv, obj={"argv": argv}, env=env, catch_exceptions=False)


@contextmanager
def _threads(count: int | None) -> Iterator[None]:
    """torch's CPU thread count set to `count` inside the block, put back after (None: left alone)."""
    if count is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
