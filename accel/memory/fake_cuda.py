"""Fake `cuda`: a model's forward and a VAE's decode run at real widths on a machine without a GPU,
using no memory, so the tracker (accel/memory/tracker.py) can measure what they would allocate.
Attention runs through accel's own kernels (flash-style: no L x L matrix), as on a real GPU; small
tensors made from known values keep real twins, so value-dependent ops still answer; and a `fake`
process group lets this one process act as rank 0 of any layout.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

from accel.errors import UserError


_SDPA_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class _FusedAttention(TorchFunctionMode):
    """torch's SDPA on fake `cuda` tensors, on a machine without a GPU, falls back to the math kernel
    and its full score matrix (Wan 14B's cross-attention at 720p: 10 GiB that no GPU allocates); a GPU
    runs a fused kernel. Under this mode SDPA calls go to accel's kernel choice, as on the GPU."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        call = dict(zip(_SDPA_ARGUMENTS, args)) | kwargs
        query, key, value, mask = call["query"], call["key"], call["value"], call.get("attn_mask")
        if call.get("is_causal") or call.get("enable_gqa") or query.dim() != 4 or key.shape[-3] != query.shape[-3]:
            return func(*args, **kwargs)
        from accel.parallel.kernels import attention_with_lse

        if mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(~mask, float("-inf"))
        return attention_with_lse(query, key, value, mask, call.get("scale"))[0]


# Tensors up to this many elements carry their values under the fake mode (masks, flags, zero inputs).
KNOWN_NUMEL = 1 << 20
_INDEXING = ("aten::index.Tensor", "aten::index_put", "aten::index_put_")


def _tensors_in(values: tuple[Any, ...] | list[Any]) -> list[torch.Tensor]:
    """The tensors among an op's arguments or results, in lists at any depth (`cat`, `index`, c10d's)."""
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (tuple, list)):
            found += _tensors_in(value)
    return found


class KnownValues(TorchDispatchMode):
    """Fake tensors have shapes, not values, so an op whose output shape or Python result depends on
    values cannot run on them: HunyuanVideo 1.5's forward gathers its text tokens with boolean masks
    (`text[mask]`) and branches on `torch.all(image_embeds == 0)`. A shape environment would make the
    gathers' lengths symbols, but cannot take the branch, and leaves the tracker sums of unknowns.
    Instead every small tensor made from known values (factories like `ones`, and ops on known
    tensors) keeps a real CPU twin, and an op the fake mode cannot answer runs on the twins: its
    result is the one a GPU gets from the same inputs. Large or random tensors stay unknown; a value
    written from unknown data is forgotten, so a later data-dependent op fails rather than guesses."""

    def __init__(self) -> None:
        super().__init__()
        self.values: Any = WeakTensorKeyDictionary()
        self.storages: set[int] = set()  # of tensors with values (or once had): who may need forgetting

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        tensors = _tensors_in((*args, *kwargs.values()))
        # Real tensors are `torch.tensor`'s data; only torch's own ops run on twins (not collectives).
        known = func.namespace == "aten" and all(t in self.values or not isinstance(t, FakeTensor) for t in tensors)
        try:
            out = func(*args, **kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException):
            if tensors and known:  # `nonzero`, `item`, `x[mask]` on known tensors: from the twins
                return tree_map(lambda value: self._fake_of(value, tensors[0].device), self._real(func, args, kwargs))
            if func.name() in _INDEXING and any(self._known_mask(index) for index in args[1]):
                # `x[mask]` with a known mask: gather at the mask's positions
                positions = [p for index in args[1] for p in self._positions(index)]
                return self.__torch_dispatch__(func, types, (args[0], positions, *args[2:]), kwargs)
            raise
        results = _tensors_in(out if isinstance(out, (tuple, list)) else (out,))
        if (
            known
            and torch.Tag.nondeterministic_seeded not in func.tags
            and not func.name().startswith("aten::empty")
            and all(t.numel() <= KNOWN_NUMEL for t in tensors + results)
        ):
            for fake, value in zip(tree_flatten(out)[0], tree_flatten(self._real(func, args, kwargs))[0]):
                if isinstance(fake, torch.Tensor) and isinstance(value, torch.Tensor):
                    self._remember(fake, value)
        elif func._schema.is_mutable:
            named = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
            for argument in func._schema.arguments:
                written = named.get(argument.name)
                if (
                    argument.alias_info is not None
                    and argument.alias_info.is_write
                    and isinstance(written, torch.Tensor)
                ):
                    self._forget(written)
        return out

    def _real(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """`func` on the CPU twins of its tensors (devices mapped to the CPU), outside the fake mode."""

        def twin(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return self.values[x] if isinstance(x, FakeTensor) else x
            return torch.device("cpu") if isinstance(x, torch.device) else x

        real_args, real_kwargs = tree_map(twin, (args, kwargs))
        with unset_fake_temporarily():
            return func(*real_args, **real_kwargs)

    def _fake_of(self, value: Any, device: torch.device) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        fake = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)
        self._remember(fake, value)
        return fake

    def _remember(self, fake: torch.Tensor, value: torch.Tensor) -> None:
        self.values[fake] = value
        self.storages.add(fake.untyped_storage()._cdata)

    def _known_mask(self, index: Any) -> bool:
        return isinstance(index, FakeTensor) and index.dtype in (torch.bool, torch.uint8) and index in self.values

    def _positions(self, index: Any) -> list[Any]:
        """A known boolean index as the integer positions it selects (one tensor per dimension it covers)."""
        if not self._known_mask(index):
            return [index]
        with unset_fake_temporarily():
            positions = [p.contiguous() for p in self.values[index].nonzero().unbind(1)]
        return [self._fake_of(p, index.device) for p in positions]

    def _forget(self, written: torch.Tensor) -> None:
        """Drop the twins of `written` and of every view that shares its storage."""
        storage = written.untyped_storage()._cdata
        if storage not in self.storages:
            return
        for tensor in [t for t in self.values.keys() if t.untyped_storage()._cdata == storage]:
            del self.values[tensor]


@contextmanager
def fake_or_real(device: str, fake: bool = True) -> Iterator[None]:
    """Fake tensors for "cuda" (no GPU needed, no memory used); real ones for "cpu", or for "cuda"
    with `fake` off (the checks against a real run). Small known tensors keep their values (KnownValues)."""
    if device != "cuda" or not fake:
        yield
        return
    if not torch.backends.cuda.is_built():  # a CPU-only build cannot index a tensor on `cuda`, fake or not
        raise UserError(
            f"accel's memory plan measures on fake CUDA, which needs torch's CUDA build (PyPI's default "
            f"wheel; no GPU needed): torch {torch.__version__} is CPU-only"
        )
    with FakeTensorMode(allow_non_fake_inputs=False), KnownValues(), _FusedAttention():
        yield


@contextmanager
def fake_world(ranks: int) -> Iterator[None]:
    """A `fake` process group of `ranks` for this process as rank 0, unless one is already there."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    was_initialized = dist.is_initialized()
    excepthook = sys.excepthook  # init_process_group prefixes it with "[rank0]:" for good, once per group made
    if not was_initialized:
        dist.init_process_group("fake", rank=0, world_size=ranks, store=FakeStore())
    try:
        yield
    finally:
        if not was_initialized:
            dist.destroy_process_group()
            sys.excepthook = excepthook
