"""LTX-2.5 DFR's temporal refine round, what its family record needs at run time: the canvas a
pass's latents fix, the doubled frame rate, and the scheduler the round requires."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# LTX-2's video VAE: 32x in space, 8x in time (k + 1 latent frames hold 8k + 1 frames).
_SPACE, _TIME = 32, 8


def refine_canvas(fields: Mapping[str, Any]) -> dict[str, int]:
    """The refine round's input canvas, as the pass's latents (batch, channels, frames, height, width) hold it."""
    _, _, frames, height, width = fields["frames"].shape
    return {"num_frames": (frames - 1) * _TIME + 1, "height": height * _SPACE, "width": width * _SPACE}


def doubled_rate(call: Mapping[str, Any]) -> float:
    """A refine round plays at twice its input's frame rate (the call's `frame_rate`, 24 unless given)."""
    return 2 * float(call.get("frame_rate", 24.0))


def ancestral_scheduler() -> Any:
    """The refine round's scheduler, which it refuses to run without (diffusers' example: eta 0.5)."""
    from diffusers import LTXEulerAncestralRFScheduler

    return LTXEulerAncestralRFScheduler(eta=0.5)
