"""The sample tensor of a transformer's output, in each shape diffusers returns it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor


def sample_of(output: Any) -> Tensor:
    """The sample of a bare tensor, a `(sample, ...)` tuple or an output dataclass."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, tuple):
        return output[0]
    return output.sample


def map_sample(output: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """The same kind of output with `fn` applied to its sample, everything else untouched."""
    if isinstance(output, Tensor):
        return fn(output)
    if isinstance(output, tuple):
        return (fn(output[0]), *output[1:])
    return type(output)(**{**output, "sample": fn(output.sample)})


def map_samples(output: Any, fn: Callable[[Any], Any]) -> Any:
    """`map_sample`, and `fn` on every other tensor the output holds too: each tensor item of a
    tuple, each tensor field of an output dataclass (LTX-2 predicts its audio beside its video)."""
    if isinstance(output, Tensor):
        return fn(output)
    if isinstance(output, tuple):
        return (fn(output[0]), *(fn(item) if isinstance(item, Tensor) else item for item in output[1:]))
    fields = {key: fn(value) if isinstance(value, Tensor) else value for key, value in output.items() if key != "sample"}
    return type(output)(**{**output, **fields, "sample": fn(output.sample)})


def predictions_of(output: Any) -> list[Tensor]:
    """The sample, then every other tensor the output holds, in order (`map_samples`'s tensors)."""
    found: list[Tensor] = []
    map_samples(output, lambda tensor: found.append(tensor) or tensor)
    return found


def as_output(sample: Tensor, return_dict: bool, others: tuple[Tensor, ...] = ()) -> Any:
    """What a transformer called with `return_dict` returns for this sample, and for the `others`
    it predicts beside it (as a tuple only: their output fields have no names here)."""
    if not return_dict:
        return (sample, *others)
    if others:
        from accel.errors import NotAvailableError

        raise NotAvailableError("[parallel] cfg = 2: the transformer was called with return_dict=True and returns more than its sample, "
                                "whose output fields accel cannot name for the other branch; set cfg = 1")
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    return Transformer2DModelOutput(sample=sample)
