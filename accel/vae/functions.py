"""The functions that make a decoder's rows depend on other rows, redone for a split decode.

While a decoder runs on one rank's rows, this mode sees each torch function call:

- a convolution that pads its height borrows the neighbours' rows (the halo) instead of zeros;
  the local convolution runs while they travel, and only its first and last rows are redone;
- `F.pad` along the height (replicate or zero padding before a causal convolution, a reflecting
  convolution's padding) writes the neighbours' rows where this rank's edge is not the image's edge;
- GroupNorm normalises with statistics summed over every rank;
- nearest upsampling by a whole factor is local; a resize that blends rows is refused;
- inside a module run whole (attention over every position), the convolutions and norms run
  unchanged on the gathered map, and each rank attends for its own query rows only, the ranks
  then swapping their results.

Everything else (pointwise ops, 1×1 convolutions, channel norms) is local already.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from accel.errors import NotAvailableError
from accel.parallel.comm import TRAFFIC, all_gather
from accel.vae.exchange import Halo, pad_rows
from accel.vae.rows import RowSplit


@dataclass
class WholeRegion:
    """A module running on the gathered map: its full height and width, and each rank's rows there."""

    rows: int
    width: int
    split: RowSplit

    @property
    def spans(self) -> list[tuple[int, int]]:
        scale = self.split.scale_of_full(self.rows)
        return [self.split.span(scale, rank) for rank in range(self.split.world)]

    @property
    def own(self) -> tuple[int, int]:
        return self.spans[self.split.rank]


class SplitDecode(TorchFunctionMode):
    """Active around a decoder's forward on one rank's rows; see the module docstring."""

    def __init__(self, split: RowSplit, group: dist.ProcessGroup | None, noise_rows: bool) -> None:
        super().__init__()
        self.split = split
        self.group = group
        self.regions: list[WholeRegion] = []
        self._handlers: dict[Any, Callable[..., Any]] = {
            torch.conv2d: self._conv,
            torch.conv3d: self._conv,
            F.pad: self._pad,
            F.group_norm: self._group_norm,
            F.interpolate: self._interpolate,
            F.scaled_dot_product_attention: self._attention_outside,
            torch.conv_transpose2d: self._refuse_transposed,
            torch.conv_transpose3d: self._refuse_transposed,
        }
        if noise_rows:
            self._handlers[torch.randn] = self._randn

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.regions:
            if func is F.scaled_dot_product_attention:
                return _shared_attention(self.regions[-1], self.group, *args, **kwargs)
            return func(*args, **kwargs)
        handler = self._handlers.get(func)
        if handler is None:
            return func(*args, **kwargs)
        return handler(func, *args, **kwargs)

    # -- convolution -------------------------------------------------------------------------
    def _conv(
        self,
        func: Any,
        input: Tensor,
        weight: Tensor,
        bias: Tensor | None = None,
        stride: Any = 1,
        padding: Any = 0,
        dilation: Any = 1,
        groups: int = 1,
    ) -> Tensor:
        dims = weight.dim() - 2
        stride, dilation = _tuple(stride, dims), _tuple(dilation, dims)
        padding = _same_padding(padding, weight, dilation)
        pad, reach = padding[-2], dilation[-2] * (weight.shape[-2] - 1)
        if stride[-2] != 1:
            raise NotAvailableError(
                "parallel VAE: the decoder has a convolution with a height stride, which the row split "
                "cannot follow; set [vae] parallel = false"
            )
        if pad == 0:  # reaches only rows the input already carries (padded upstream, or 1 row tall)
            return func(input, weight, bias, stride, padding, dilation, groups)
        if 2 * pad != reach:
            raise NotAvailableError(
                "parallel VAE: the decoder has a convolution that changes the height, which the row split "
                "cannot follow; set [vae] parallel = false"
            )
        halo = Halo(input, pad, pad, self.split, self.group)
        rows = input.shape[-2]
        unpadded = (*padding[:-2], 0, padding[-1])
        if rows < 2 * pad:  # too few rows to redo only the edges: convolve the haloed map
            above, below = halo.wait()
            edged = torch.cat([_rows_or_zeros(above, input, pad), input, _rows_or_zeros(below, input, pad)], dim=-2)
            return func(edged, weight, bias, stride, unpadded, dilation, groups)
        out = func(input, weight, bias, stride, padding, dilation, groups)
        above, below = halo.wait()
        if above is not None:
            strip = torch.cat([above, input[..., : 2 * pad, :]], dim=-2)
            out[..., :pad, :] = func(strip, weight, bias, stride, unpadded, dilation, groups)
        if below is not None:
            strip = torch.cat([input[..., rows - 2 * pad :, :], below], dim=-2)
            out[..., out.shape[-2] - pad :, :] = func(strip, weight, bias, stride, unpadded, dilation, groups)
        return out

    def _refuse_transposed(self, func: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotAvailableError(
            "parallel VAE: the decoder upsamples with a transposed convolution, which the row split does not "
            "handle; set [vae] parallel = false"
        )

    # -- padding -----------------------------------------------------------------------------
    def _pad(self, func: Any, input: Tensor, pad: Any, mode: str = "constant", value: float | None = None) -> Tensor:
        pad = tuple(pad)
        if input.dim() not in (4, 5) or len(pad) < 4 or pad[2] == pad[3] == 0:
            return func(input, pad, mode, value)
        top, bottom = pad[2], pad[3]
        halo = Halo(input, top, bottom, self.split, self.group)
        sideways = (*pad[:2], 0, 0, *pad[4:])
        if input.shape[-2] <= max(top, bottom):
            # A band too short to pad alone (a reflection reaches past it: LTX-2's decoder on few
            # rows): pad the band with its neighbours' rows, the image's own edges as asked.
            above, below = halo.wait()
            edged = torch.cat([rows for rows in (above, input, below) if rows is not None], dim=-2)
            ends = (*pad[:2], 0 if above is not None else top, 0 if below is not None else bottom, *pad[4:])
            return func(edged, ends, mode, value)
        out = func(input, pad, mode, value)
        above, below = halo.wait()
        if above is not None:
            out[..., :top, :] = func(above, sideways, mode, value)
        if below is not None:
            out[..., out.shape[-2] - bottom :, :] = func(below, sideways, mode, value)
        return out

    # -- GroupNorm ---------------------------------------------------------------------------
    def _group_norm(
        self,
        func: Any,
        input: Tensor,
        num_groups: int,
        weight: Tensor | None = None,
        bias: Tensor | None = None,
        eps: float = 1e-5,
    ) -> Tensor:
        if input.dim() < 3:
            return func(input, num_groups, weight, bias, eps)
        batch, channels = input.shape[:2]
        grouped = input.reshape(batch, num_groups, -1)
        # Two small all-reduces: the mean first, then squared deviations from it (summing raw
        # squares instead would cancel badly in float32 when the mean is large).
        moments = torch.stack(
            [
                grouped.sum(-1, dtype=torch.float32).double(),
                torch.full((batch, num_groups), float(grouped.shape[-1]), dtype=torch.float64, device=input.device),
            ],
            dim=-1,
        )
        self._all_reduce(moments)
        mean = moments[..., 0] / moments[..., 1]
        spread = _squared_deviations(grouped, mean)
        self._all_reduce(spread)
        rstd = torch.rsqrt(spread / moments[..., 1] + eps)
        per_group = channels // num_groups
        scale = rstd.repeat_interleave(per_group, dim=1)
        shift = -mean.repeat_interleave(per_group, dim=1) * scale
        if weight is not None:
            scale = scale * weight.float()
            shift = shift * weight.float()
        if bias is not None:
            shift = shift + bias.float()
        view = (batch, channels) + (1,) * (input.dim() - 2)
        return torch.addcmul(shift.view(view).to(input.dtype), input, scale.view(view).to(input.dtype))

    def _all_reduce(self, tensor: Tensor) -> None:
        dist.all_reduce(tensor, group=self.group)
        TRAFFIC.add("all_reduce", tensor.numel() * tensor.element_size())

    # -- resizing and noise -------------------------------------------------------------------
    def _interpolate(
        self,
        func: Any,
        input: Tensor,
        size: Any = None,
        scale_factor: Any = None,
        mode: str = "nearest",
        *args: Any,
        **kwargs: Any,
    ) -> Tensor:
        if input.dim() >= 4:
            if mode not in ("nearest", "nearest-exact"):
                raise NotAvailableError(
                    f"parallel VAE: the decoder resizes with '{mode}' interpolation, which blends neighbouring rows; "
                    "set [vae] parallel = false"
                )
            out = func(input, size, scale_factor, mode, *args, **kwargs)
            if out.shape[-2] % input.shape[-2]:
                raise NotAvailableError(
                    "parallel VAE: the decoder resizes its height by a fraction; set [vae] parallel = false"
                )
            return out
        return func(input, size, scale_factor, mode, *args, **kwargs)

    def _randn(self, func: Any, *size: Any, **kwargs: Any) -> Tensor:
        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        own = self.split.counts[self.split.rank]
        if len(shape) < 2 or shape[-2] % own:
            return func(*size, **kwargs)
        scale = shape[-2] // own
        full = func((*shape[:-2], self.split.rows * scale, shape[-1]), **kwargs)
        start, stop = self.split.span(scale)
        return full[..., start:stop, :].contiguous()

    def _attention_outside(self, func: Any, *args: Any, **kwargs: Any) -> Tensor:
        raise NotAvailableError(
            "parallel VAE: the decoder attends over positions outside the modules its plan runs whole "
            "(accel/models/vaes.py); set [vae] parallel = false"
        )


def _shared_attention(
    region: WholeRegion,
    group: dist.ProcessGroup | None,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    **kwargs: Any,
) -> Tensor:
    """Attention over the gathered map with the work shared: each rank attends for the queries in
    its own rows, then the ranks swap results, so what follows in the module (convolutions too)
    sees the whole output.

    Tokens are the gathered map flattened with the width fastest, then the height (frames, or a
    batch of frames, outside them), as every supported decoder lays them out."""
    tokens = query.shape[-2]
    if is_causal or tokens % (region.rows * region.width):
        return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **kwargs)
    owned = [_token_indices(tokens, region, start, stop, query.device) for start, stop in region.spans]
    own = owned[region.split.rank]
    if attn_mask is not None and attn_mask.dim() >= 2 and attn_mask.shape[-2] == tokens:
        attn_mask = attn_mask.index_select(-2, own)
    attended = F.scaled_dot_product_attention(
        query.index_select(-2, own), key, value, attn_mask, dropout_p, is_causal, scale=scale, **kwargs
    )
    padded = pad_rows(attended, max(len(index) for index in owned))
    out = attended.new_empty((*attended.shape[:-2], tokens, attended.shape[-1]))
    for index, piece in zip(owned, all_gather(padded, group)):
        out.index_copy_(out.dim() - 2, index, piece[..., : len(index), :])
    return out


def _token_indices(tokens: int, region: WholeRegion, start: int, stop: int, device: torch.device) -> Tensor:
    """Indices of the tokens in rows [start, stop) of every frame: built from the shape on the
    host, so no data-dependent selection (and no host sync) is needed."""
    frame = region.rows * region.width
    frames = torch.arange(tokens // frame, device=device)[:, None] * frame
    return (frames + torch.arange(start * region.width, stop * region.width, device=device)[None, :]).flatten()


def _tuple(value: Any, dims: int) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * dims


def _same_padding(padding: Any, weight: Tensor, dilation: tuple[int, ...]) -> tuple[int, ...]:
    dims = weight.dim() - 2
    if padding == "valid":
        return (0,) * dims
    if padding == "same":
        reach = [d * (k - 1) for d, k in zip(dilation, weight.shape[2:])]
        if any(r % 2 for r in reach):
            raise NotAvailableError(
                "parallel VAE: a 'same' convolution with an even kernel pads unevenly; set [vae] parallel = false"
            )
        return tuple(r // 2 for r in reach)
    return _tuple(padding, dims)


def _rows_or_zeros(rows: Tensor | None, like: Tensor, count: int) -> Tensor:
    return rows if rows is not None else like.new_zeros((*like.shape[:-2], count, like.shape[-1]))


def _squared_deviations(grouped: Tensor, mean: Tensor, chunk_bytes: int = 64 << 20) -> Tensor:
    """Per (sample, group) sum of (x - mean)² in float32, a few groups at a time so the centred
    copy stays small."""
    per_group = grouped[0, 0].numel() * 4
    step = max(1, chunk_bytes // max(per_group, 1))
    out = torch.empty(mean.shape, dtype=torch.float64, device=grouped.device)
    centre = mean.float()
    for start in range(0, grouped.shape[1], step):
        chunk = grouped[:, start : start + step].float() - centre[:, start : start + step, None]
        out[:, start : start + step] = torch.linalg.vector_norm(chunk, ord=2, dim=-1).double().square()
    return out
