"""What one request may ask of `accel serve`, checked on the front before any rank sees it.

A prompt is refused by length before the tokenizer sees it (a 10 MB prompt aborts `tokenizers`),
and a request by its work (pixels × frames × steps × outputs) before it holds a replica for
hours while every other client gets 429. Sizes past the transformer's positional range are
refused too: the pipeline would fail on them only after the text encoders ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MEGA = 1_000_000


@dataclass(frozen=True)
class Limits:
    """The operator's bounds (`accel serve --max-prompt / --max-body / --max-work / --request-timeout`)."""

    max_prompt: int = 10_000  # characters of prompt and of negative_prompt, each
    max_body: int = 1 << 20  # bytes of a request body
    max_work: int = 10_000  # megapixel-steps: width × height × frames × steps × n / 1e6
    request_timeout_s: float | None = None  # seconds a request may run; then it stops at its next step (None: no limit)


def prompt_problem(field: str, text: str | None, limits: Limits) -> str | None:
    """Why `text` is too long for `field` (None: it is not)."""
    if text is None or len(text) <= limits.max_prompt:
        return None
    return (f"{field}: {len(text)} characters, more than this server's limit of {limits.max_prompt} "
            "(accel serve --max-prompt); shorten it")


def work_problem(generate: dict[str, Any], count: int, defaults: dict[str, Any], limits: Limits) -> str | None:
    """Why the request's work is past `limits.max_work` (None: it is not). Unset keys take the
    served pipeline's defaults; without a known default a key counts as 1."""

    def value(key: str) -> int:
        return int(generate.get(key) or defaults.get(key) or 1)

    width, height, frames, steps = value("width"), value("height"), value("frames"), value("steps")
    work = width * height * frames * steps * count
    if work <= limits.max_work * MEGA:
        return None
    return (f"size × frames × steps × n: {width}x{height} × {frames} × {steps} × {count} is {work / MEGA:,.0f} "
            f"megapixel-steps, more than this server's limit of {limits.max_work:,} (accel serve --max-work); "
            "ask for a smaller size, fewer frames, fewer steps or fewer outputs")


def positional_limits(pipe: Any) -> dict[str, int]:
    """The largest width, height and frames the transformer's positions cover, where its config
    bounds them (Wan's `rope_max_seq_len` over its patch and the VAE's scale factors); {} where
    positions are computed for any size."""
    transformer = getattr(pipe, "transformer", None)
    config = getattr(transformer, "config", None)
    positions = getattr(config, "rope_max_seq_len", None)
    patch = getattr(config, "patch_size", None)
    if not isinstance(positions, int) or not isinstance(patch, (tuple, list)) or len(patch) != 3:
        return {}
    spatial = int(getattr(pipe, "vae_scale_factor_spatial", 8))
    temporal = int(getattr(pipe, "vae_scale_factor_temporal", 4))
    return {"frames": (positions * patch[0] - 1) * temporal + 1,
            "height": positions * patch[1] * spatial, "width": positions * patch[2] * spatial}


def position_problem(key: str, value: int, limits: dict[str, int], model: str) -> str | None:
    """Why `value` of `key` is past the served transformer's positional range (None: it is not)."""
    largest = limits.get(key)
    if largest is None or value <= largest:
        return None
    return f"past {model}'s positional range; at most {largest}"
