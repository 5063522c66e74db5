"""Routes `F.scaled_dot_product_attention` calls to context-parallel attention, only while active.

The engine enters the mode around the parallelised transformer's forward alone, so text
encoders and the VAE keep plain SDPA. Any processor that calls SDPA is covered unchanged;
modules the plan marks local (cross-attention to replicated text) keep plain SDPA too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from accel.errors import NotAvailableError

# (query, key, value, key mask or None, scale) -> output
Attend = Callable[[Tensor, Tensor, Tensor, Tensor | None, float | None], Tensor]


class AttentionRouter(TorchFunctionMode):
    """Sends SDPA calls to `attend`, or to plain SDPA while `is_local()`; other functions run as usual.

    With `pairwise`, a square (B, 1, L, L) boolean mask is taken as one per-token mask ANDed with
    itself (the plan says the model builds them so) and reduced to its diagonal, the key mask."""

    def __init__(
        self,
        attend: Attend,
        is_local: Callable[[], bool] = lambda: False,
        pairwise: bool = False,
        causal_local: bool = False,
    ) -> None:
        super().__init__()
        self.attend = attend
        self.is_local = is_local
        self.pairwise = pairwise
        self.causal_local = causal_local

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if (
            func is F.scaled_dot_product_attention
            and not self.is_local()
            and not (self.causal_local and _causal(args, kwargs))
        ):
            return self._route(*args, **kwargs)
        return func(*args, **kwargs)

    def _route(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Tensor:
        if is_causal or dropout_p:
            raise NotAvailableError(
                "context parallelism: this transformer calls attention with a causal flag or dropout, "
                "which the parallel engine does not handle; run it without [parallel]"
            )
        if attn_mask is not None:
            attn_mask = without_diffusers_padding(attn_mask, key.shape[-2])
        if self.pairwise and attn_mask is not None and _is_pairwise(attn_mask, query.shape[-2]):
            attn_mask = attn_mask.diagonal(dim1=-2, dim2=-1).unsqueeze(-2)  # (B, 1, 1, L): a view, no copy
        if attn_mask is not None and not _is_key_mask(attn_mask) and not is_whole_pairwise(attn_mask, query.shape[-2]):
            raise NotAvailableError(
                "context parallelism: this transformer's attention mask is not a boolean per-key mask "
                f"(shape {tuple(attn_mask.shape)}, {attn_mask.dtype}); run it without [parallel]"
            )
        if key.shape[-3] != query.shape[-3]:
            if not enable_gqa or query.shape[-3] % key.shape[-3]:
                raise NotAvailableError(
                    f"context parallelism: {query.shape[-3]} query heads attend to {key.shape[-3]} key heads "
                    "without grouped-query attention; run it without [parallel]"
                )
            # Grouped-query attention: each key head serves a run of query heads, as SDPA's enable_gqa reads them.
            key, value = (x.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3) for x in (key, value))
        return self.attend(query, key, value, attn_mask, scale)


# diffusers attention backends whose function calls F.scaled_dot_product_attention, so the router sees it.
SDPA_BACKENDS = frozenset({"native", "_native_cudnn", "_native_efficient", "_native_flash", "_native_math"})


def bypassing_backend(transformer: torch.nn.Module) -> str | None:
    """The diffusers attention backend (flex, flash, sage, xformers, …) one of this transformer's
    processors dispatches to without calling SDPA, which the router then never sees; None: none does.

    diffusers 0.42 records `set_attention_backend` per processor as `_attention_backend`; None there
    means its global default (DIFFUSERS_ATTN_BACKEND, or the `attention_backend` context manager)."""
    try:
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry
    except ImportError:  # a diffusers without attention dispatch: processors call SDPA themselves
        return None
    default = _AttentionBackendRegistry._active_backend
    for module in transformer.modules():
        processor = getattr(module, "processor", None)
        if processor is None or not hasattr(processor, "_attention_backend"):
            continue  # a processor of the older kind calls SDPA (or computes by hand: caught at forward)
        backend = processor._attention_backend or default
        name = str(getattr(backend, "value", backend))
        if name not in SDPA_BACKENDS:
            return name
    return None


def _causal(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether an SDPA call asks for a causal mask (its sixth positional argument, or the keyword)."""
    return bool(args[5] if len(args) > 5 else kwargs.get("is_causal", False))


def _is_key_mask(mask: Tensor) -> bool:
    """A boolean mask that varies only by key, and by batch in its 4-D form (B|1, 1, 1, keys).

    SDPA broadcasts masks from the right, so only dim 0 of a 4-D mask is the batch.
    """
    if mask.dtype != torch.bool or mask.dim() > 4:
        return False
    fixed = mask.shape[1:-1] if mask.dim() == 4 else mask.shape[:-1]
    return all(size == 1 for size in fixed)


def _is_pairwise(mask: Tensor, queries: int) -> bool:
    """A boolean (B|1, 1, L, L) mask over a self-attention's `queries` tokens."""
    return (
        mask.dtype == torch.bool
        and mask.dim() == 4
        and mask.shape[1] == 1
        and mask.shape[-2] == mask.shape[-1] == queries
    )


def is_whole_pairwise(mask: Tensor, queries: int) -> bool:
    """A (B|1, H|1, N, N) mask over more tokens than this rank's `queries`: one the model built for
    the whole sequence before the plan cut it, boolean (SkyReels-V2's block-causal frames) or an
    additive float bias (LTX-2 IC-LoRA's reference tokens at reduced strength)."""
    return (
        (mask.dtype == torch.bool or mask.is_floating_point())
        and mask.dim() == 4
        and mask.shape[-2] == mask.shape[-1] > queries
    )


def without_diffusers_padding(mask: Tensor, keys: int) -> Tensor:
    """diffusers' `Attention.prepare_attention_mask` pads a mask whose last dim is not the key count
    with that many columns (zeros): on a cut sequence a whole-sequence (…, N, N) pair mask reaches
    SDPA as (…, N, N + keys). Those columns are no keys at all: the view without them. Any other
    mask is returned as it is (decided from shapes alone)."""
    if mask.dim() == 4 and mask.shape[-2] > keys and mask.shape[-1] == mask.shape[-2] + keys:
        return mask[..., : mask.shape[-2]]
    return mask


def key_mask(mask: Tensor) -> Tensor:
    """The (B|1, keys) view of a mask `_is_key_mask` accepted."""
    return mask.reshape(mask.shape[0] if mask.dim() == 4 else 1, mask.shape[-1])
