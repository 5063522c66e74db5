"""Every rank starts from the same noise: rank 0's generator state and initial latents win.

Parallel output can only equal single-process output if all ranks denoise the same latents;
a user's script may seed ranks differently, or not at all.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from accel.instance import NOISE, wrap
from accel.parallel.comm import global_rank


def agree_on_noise(pipe: Any, group: dist.ProcessGroup | None = None) -> Callable[[], None]:
    """Wrap this pipeline's `prepare_latents` so all ranks of `group` (None: the job) share its first
    rank's randomness (the call's generators and the global random state); returns the undo."""
    signature = inspect.signature(pipe.prepare_latents)

    def prepare_latents(call_next: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind_partial(*args, **kwargs)
        generators = list(_generators(bound.arguments.get("generator")))
        states, global_state = rank0_object(([g.get_state() for g in generators], _global_rng_state()), group)
        for generator, state in zip(generators, states):
            generator.set_state(state)
        _set_global_rng_state(global_state)  # a step callback or scheduler may draw from it later
        result = call_next(*args, **kwargs)
        for tensor in _tensors(result):
            dist.broadcast(tensor, src=global_rank(group, 0), group=group)
        return result

    return wrap(pipe, "prepare_latents", "accel.agree_on_noise", NOISE, prepare_latents)


def rank0_object(value: Any, group: dist.ProcessGroup | None = None) -> Any:
    """Rank 0's `value` (any picklable object, e.g. a random state), on every rank of `group`."""
    box = [value]
    dist.broadcast_object_list(box, src=global_rank(group, 0), group=group)
    return box[0]


def _global_rng_state() -> tuple[torch.Tensor, torch.Tensor | None]:
    """The global CPU random state and, once CUDA is in use, the current device's."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_global_rng_state(state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)


def _generators(value: Any) -> Iterable[torch.Generator]:
    if isinstance(value, torch.Generator):
        return [value]
    if isinstance(value, (list, tuple)):
        return [g for g in value if isinstance(g, torch.Generator)]
    return []


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []
