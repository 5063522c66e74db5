"""Routes `F.scaled_dot_product_attention` calls to context-parallel attention, only while active.

The engine enters the mode around the parallelised transformer's forward alone, so text
encoders and the VAE keep plain SDPA. Any processor that calls SDPA is covered unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from accel.errors import NotAvailableError

Attend = Callable[[Tensor, Tensor, Tensor, float | None], Tensor]


class AttentionRouter(TorchFunctionMode):
    """Sends SDPA calls to `attend(q, k, v, scale)`; every other torch function runs as usual."""

    def __init__(self, attend: Attend) -> None:
        super().__init__()
        self.attend = attend

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
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
        if attn_mask is not None or is_causal or dropout_p:
            raise NotAvailableError(
                "context parallelism: this transformer calls attention with a mask, causal flag or dropout, "
                "which the parallel engine does not handle yet; run it without [parallel]"
            )
        if key.shape[-3] != query.shape[-3]:
            raise NotAvailableError("context parallelism: grouped-query attention (fewer key heads) is not handled yet")
        return self.attend(query, key, value, scale)
