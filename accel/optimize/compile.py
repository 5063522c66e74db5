"""torch.compile of a transformer: its repeated blocks (regional, the default) or its whole forward.

Regional compilation compiles each block *class* once: every instance of a class runs the same
compiled code (parameters are graph inputs), so a 57-block FLUX compiles two graphs, not 57.
The compiled function runs at the COMPILE layer of each instance's `forward` (accel.hooks):
it compiles what lies inside (the eager forward, or the context-parallel and CFG layers around a
whole transformer). Layers above it (First Block Cache) wrap it from outside, so the cache's
Python branch never enters a graph and never forces a recompile.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from accel.hooks import COMPILE, inner_of, wrap
from accel.models.base import BlockList
from accel.models.parts import blocks_of


_NAME = "accel.compile"


class CompiledRegions:
    """The compiled forwards installed on one transformer; `remove()` puts the eager ones back."""

    def __init__(
        self, transformer: nn.Module, blocks: Sequence[BlockList], scope: str, mode: str, backend: str = "inductor"
    ) -> None:
        if scope == "blocks":
            self.modules = blocks_of(transformer, blocks)
        else:
            self.modules = [transformer]
        self._undo: list[Callable[[], None]] = []
        self._options: dict[str, Any] = {} if mode == "default" else {"mode": mode}
        if backend != "inductor":
            self._options["backend"] = backend
        # One compiled function per distinct inner callable, made once: a stable callable per call
        # means dynamo's guards hold and nothing recompiles between calls.
        self._compiled: dict[Callable[..., Any], Callable[..., Any]] = {}
        _quiet_notices()
        for module in self.modules:
            self._undo.append(wrap(module, "forward", _NAME, COMPILE, self._run))
            self._compiled_for(inner_of(module, "forward", _NAME))  # compiled now, traced on first call

    @property
    def functions(self) -> list[Callable[..., Any]]:
        """The torch.compile'd functions in use (one per module, unless what they wrap changed)."""
        return list(self._compiled.values())

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()
        self._compiled.clear()

    def _run(self, call_next: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self._compiled_for(call_next)(*args, **kwargs)

    def _compiled_for(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        compiled = self._compiled.get(inner)
        if compiled is None:
            compiled = self._compiled[inner] = torch.compile(inner, **self._options)
        return compiled


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
