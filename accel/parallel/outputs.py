"""The sample tensor of a transformer's output, in each shape diffusers returns it, and the walks
over every tensor such an output (or a call's arguments) holds."""

from __future__ import annotations

from collections.abc import Callable, Iterator
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
    fields = {
        key: fn(value) if isinstance(value, Tensor) else value for key, value in output.items() if key != "sample"
    }
    return type(output)(**{**output, **fields, "sample": fn(output.sample)})


def as_output(sample: Tensor, return_dict: bool) -> Any:
    """What a transformer called with `return_dict` returns for this sample."""
    if not return_dict:
        return (sample,)
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    return Transformer2DModelOutput(sample=sample)


def map_tensors(value: Any, fn: Callable[[Tensor], Any]) -> Any:
    """`value` (a tensor, or tuples, lists and dicts of them, nested) with `fn` applied to each tensor."""
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, tuple):
        return tuple(map_tensors(item, fn) for item in value)
    if isinstance(value, list):
        return [map_tensors(item, fn) for item in value]
    if isinstance(value, dict):
        return {key: map_tensors(item, fn) for key, item in value.items()}
    return value


def tensors_of(value: Any) -> Iterator[Tensor]:
    """Every tensor a value holds, in order (a model output: a tensor, a tuple, or diffusers' output dataclass)."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_of(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_of(item)
