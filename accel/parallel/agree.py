"""Every rank starts from the same noise: rank 0's generator state and initial latents win.

Parallel output can only equal single-process output if all ranks denoise the same latents;
a user's script may seed ranks differently, or not at all.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from accel.instance import override
from accel.parallel.comm import global_rank


def agree_on_noise(pipe: Any, group: dist.ProcessGroup | None = None) -> Callable[[], None]:
    """Wrap this pipeline's `prepare_latents` so all ranks of `group` (None: the job) share its first
    rank's randomness; returns the undo."""
    original = pipe.prepare_latents
    signature = inspect.signature(original)

    @functools.wraps(original)
    def prepare_latents(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind_partial(*args, **kwargs)
        for generator in _generators(bound.arguments.get("generator")):
            generator.set_state(rank0_object(generator.get_state(), group))
        result = original(*args, **kwargs)
        for tensor in _tensors(result):
            dist.broadcast(tensor, src=global_rank(group, 0), group=group)
        return result

    return override(pipe, "prepare_latents", prepare_latents)


def rank0_object(value: Any, group: dist.ProcessGroup | None = None) -> Any:
    """Rank 0's `value` (any picklable object, e.g. a random state), on every rank of `group`."""
    box = [value]
    dist.broadcast_object_list(box, src=global_rank(group, 0), group=group)
    return box[0]


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
