"""Seeded, float32, inference-mode module builds that leave the caller's RNG state untouched."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed torch's CPU RNG and float32 init for module builds, restoring the caller's state after.

    Initialising in float32 whatever the caller's default dtype keeps weights bit-identical per seed.
    """
    previous_dtype = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.set_default_dtype(torch.float32)
        try:
            yield
        finally:
            torch.set_default_dtype(previous_dtype)


def finish(module: ModuleT) -> ModuleT:
    """Put a freshly built module in float32 inference mode (T5 dropout would make runs differ)."""
    # `.float()` rather than `.to(dtype)`: diffusers warns on every dtype `.to()` call.
    return module.float().eval()
