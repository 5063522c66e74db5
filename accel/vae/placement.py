"""The VAE on one rank ([memory] vae = "rank0"): only the layout's first rank, the one that writes
the output, decodes it. The others call the pipeline with output_type="latent", which skips the
decode (and its time and memory), and keep the VAE in host memory: `accel run` never moves it to
their GPU, `accel.apply` moves it to the CPU there and `remove()` puts it back.

The pipeline call stays checked equal on every rank (`agree_on_arguments`, which this wraps inside),
but for output_type, which may differ here: whatever a rank that does not decode was given, it asks
for latents. What those ranks return is latents, which no code path keeps (only the first rank
writes, reports or answers; `accel.generate` gives them no output).
"""

from __future__ import annotations

import inspect
from functools import partial
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from accel.hooks import VAE_PLACEMENT, wrap_call, wrappers

NAME = "accel.vae.first_rank_decodes"
ONE_RANK = "rank0"


def decodes_here(pipe: Any) -> bool:
    """False on a rank that skips the decode under [memory] vae = "rank0" (its outputs are latents)."""
    return NAME not in wrappers(pipe, "__call__")


def loads_vae_on_gpu(placement: str, layout_size: int) -> bool:
    """Whether this rank moves the VAE to its device under [memory] vae = `placement` in a layout of
    `layout_size` ranks (replicas of it side by side: each one's first rank decodes)."""
    from accel.launch.environment import rank

    return placement != ONE_RANK or layout_size == 1 or rank() % layout_size == 0


def takes_output_type(pipe: Any) -> bool:
    """Whether the pipeline's call has an `output_type` to skip its decode with."""
    try:
        return "output_type" in inspect.signature(pipe.__call__).parameters
    except (TypeError, ValueError):
        return False


class OtherRanksSkipDecode:
    """On a rank other than `group`'s first: every call asks for latents, and the VAE waits in host
    memory. On the first rank nothing changes (`leads`). `remove()` undoes it."""

    def __init__(self, pipe: Any, group: dist.ProcessGroup | None) -> None:
        source = dist.get_global_rank(group, 0) if group is not None and group != dist.group.WORLD else 0
        self.leads = dist.get_rank() == source
        self._undo: list[Callable[[], None]] = []
        if self.leads:
            return
        vae = pipe.vae
        if isinstance(vae, torch.nn.Module):
            parameter = next(vae.parameters(), None)
            if parameter is not None and parameter.device.type != "cpu":
                device = parameter.device
                vae.to("cpu")
                self._undo.append(lambda: vae.to(device))
        self._undo.append(self.also_on(pipe))

    def also_on(self, pipe: Any) -> Callable[[], None]:
        """The same for a pipeline on the same VAE (AccelHandle.attach); returns its undo."""
        if self.leads:
            return lambda: None
        return wrap_call(pipe, NAME, VAE_PLACEMENT, partial(_ask_for_latents, inspect.signature(pipe.__call__)))

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()


def _ask_for_latents(signature: inspect.Signature, call_next: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    bound = signature.bind_partial(*args, **kwargs)  # output_type given by position or keyword alike
    bound.arguments["output_type"] = "latent"
    return call_next(*bound.args, **bound.kwargs)
