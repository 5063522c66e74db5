"""Frame-causal attention masks filled a frame at a time.

HunyuanVideo 1.5's VAE mid-block builds its mask (a position sees every position of its own frame
and of the frames before) with one indexed write per row: at 720p x 121 that is 111,600 writes per
decode, seconds of kernel launches on a GPU, and minutes for the memory plan, which runs every op
on fake tensors. Rows of one frame share their prefix, so one write per frame fills the same
tensor: same allocation, same values, n_frame writes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from accel.hooks import VAE, wrap
from accel.models.vaes import vae_plan_of
from accel.parallel.matching import glob_modules


def frame_causal_mask(
    n_frame: int, n_hw: int, dtype: torch.dtype, device: Any, batch_size: int | None = None
) -> torch.Tensor:
    """Row i sees columns up to the end of i's frame (0), nothing after (-inf); `batch_size` expands
    a leading batch dimension as a view."""
    seq_len = n_frame * n_hw
    mask = torch.full((seq_len, seq_len), float("-inf"), dtype=dtype, device=device)
    for frame in range(n_frame):
        mask[frame * n_hw : (frame + 1) * n_hw, : (frame + 1) * n_hw] = 0
    if batch_size is not None:
        mask = mask.unsqueeze(0).expand(batch_size, -1, -1)
    return mask


def _by_frame(
    call_next: Callable[..., Any],
    n_frame: int,
    n_hw: int,
    dtype: torch.dtype,
    device: Any,
    batch_size: int | None = None,
) -> torch.Tensor:
    return frame_causal_mask(n_frame, n_hw, dtype, device, batch_size)


def frame_masks_of(vae: Any) -> tuple[str, ...]:
    """The decoder modules whose masks accel fills by frame: its class's plan (or its nearest base's)."""
    plan = vae_plan_of(vae)
    return plan.frame_masks if plan is not None else ()


def fill_masks_by_frame(vae: Any, patterns: tuple[str, ...] | None = None) -> Callable[[], None]:
    """Give the decoder modules `patterns` names (default: the VAE plan's `frame_masks`) the
    frame-at-a-time mask builder in place of their row-by-row `prepare_causal_attention_mask`;
    returns the undo."""
    patterns = frame_masks_of(vae) if patterns is None else patterns
    decoder = getattr(vae, "decoder", None)
    if not patterns or not isinstance(decoder, torch.nn.Module):
        return lambda: None
    modules = dict(decoder.named_modules())
    undo = [
        wrap(module, "prepare_causal_attention_mask", "accel.frame_masks", VAE, _by_frame)
        for pattern in patterns
        for module in glob_modules(modules, pattern)
        if hasattr(module, "prepare_causal_attention_mask")
    ]

    def remove() -> None:
        while undo:
            undo.pop()()

    return remove
