"""How many CPU threads one `accel run` / `accel bench` process computes with, and why.

torch's default is one thread per core. On a machine other work shares (a laptop, a CI runner, a
VM beside other jobs) OpenMP threads then wait at every barrier for a core someone else holds, and
one timed run can take ten times another: a speedup measured that way is noise. accel therefore sets
half the usable cores (at least one, at most MAX_DEFAULT_THREADS) on CPU devices. The user's own
OMP_NUM_THREADS always wins (the launcher sets it for each rank as cores // ranks).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch

from accel.preflight import cpu_cores

ENV = "OMP_NUM_THREADS"
# Tiny and CPU-sized models gain little past this; more threads mostly add barrier waits.
MAX_DEFAULT_THREADS = 8


@dataclass(frozen=True)
class Threads:
    """The CPU thread count a process computed with and what chose it ("OMP_NUM_THREADS",
    "accel default": half the usable cores, or "torch": not a CPU run, torch's own)."""

    count: int
    source: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_threads(cores: int) -> int:
    """Half the usable cores, between 1 and MAX_DEFAULT_THREADS."""
    return max(1, min(MAX_DEFAULT_THREADS, cores // 2))


@contextmanager
def cpu_threads(device: torch.device) -> Iterator[Threads]:
    """Compute with the policy's thread count inside the block (restored after): on a CPU device
    without OMP_NUM_THREADS in the environment, `default_threads`; otherwise torch's as it is."""
    before = torch.get_num_threads()
    if device.type != "cpu":
        yield Threads(before, "torch")
        return
    if os.environ.get(ENV):
        yield Threads(before, ENV)
        return
    torch.set_num_threads(default_threads(cpu_cores()))
    try:
        yield Threads(torch.get_num_threads(), "accel default")
    finally:
        torch.set_num_threads(before)
