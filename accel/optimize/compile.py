"""torch.compile of a transformer: its repeated blocks (regional, the default) or its whole forward.

Regional compilation compiles each block *class* once: every instance of a class runs the same
compiled code (parameters are graph inputs), so a 57-block FLUX compiles two graphs, not 57.
The compiled function replaces `forward` on each instance only. Steps that come later in
`apply` (First Block Cache) wrap that compiled forward from outside, so the cache's Python
branch never enters a graph and never forces a recompile.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from accel.instance import override
from accel.models.base import BlockList


class CompiledRegions:
    """The compiled forwards installed on one transformer; `remove()` puts the eager ones back."""

    def __init__(self, transformer: nn.Module, blocks: Sequence[BlockList], scope: str, mode: str) -> None:
        if scope == "blocks":
            self.modules = [block for spec in blocks for block in getattr(transformer, spec.attr)]
        else:
            self.modules = [transformer]
        self._undo: list[Callable[[], None]] = []
        _quiet_notices()
        options: dict[str, Any] = {} if mode == "default" else {"mode": mode}
        for module in self.modules:
            self._undo.append(override(module, "forward", torch.compile(module.forward, **options)))

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()


def _quiet_notices() -> None:
    """Two notices every rank would print, neither about anything the user can act on: inductor's
    look for a CUDA toolchain on a CPU-only machine, and AOT autograd noting that torchao's
    tensors opt out of its cache key (they compile and run fine)."""
    if not torch.cuda.is_available():
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=r".*does not implement _stable_hash_for_caching")


def compiled_graphs() -> int | None:
    """Graphs torch.compile has built in this process so far (None: this torch does not say).

    A count that grows during a timed run means something recompiled. The counter is private
    to dynamo, so it is read here only, with a fallback."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return None
    value = counters.get("stats", {}).get("unique_graphs")
    return int(value) if value is not None else 0
