"""What the per-family block checks (tests/test_family_blocks.py) build from: small sizes and seeded inputs
that each tests/test_family_<name>.py's `block_transformer` and `block_inputs` use."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

HEADS = 2
HEAD_DIM = 16
TEXT_TOKENS = 8  # differs from every family's video/image token count, so swapped streams mis-shape
TEXT_DIM = 32

Inputs = dict[str, Any]


def seeded(seed: int, build: Callable[[], nn.Module]) -> nn.Module:
    """Build a module with seeded float32 weights, leaving the caller's RNG state alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build().float().eval()


def noise(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator)


def latents(shape: tuple[int, ...], drift: float) -> torch.Tensor:
    """Fixed latents plus `drift` times a fixed direction, as latents move between denoising steps."""
    generator = torch.Generator().manual_seed(0)
    base = noise(generator, *shape)
    direction = noise(generator, *shape)
    return base + drift * direction


def text(seed: int = 1) -> torch.Tensor:
    return noise(torch.Generator().manual_seed(seed), 1, TEXT_TOKENS, TEXT_DIM)


def text_mask() -> torch.Tensor:
    mask = torch.ones(1, TEXT_TOKENS, dtype=torch.long)
    mask[:, -2:] = 0  # padded prompt tokens, as the pipelines pass them
    return mask


def wan_shaped(cls: str, seed: int, **extra: Any) -> nn.Module:
    """A transformer class of Wan 2.1's shape (SkyReels-V2's, ChronoEdit's) at the sizes of test_family_wan's
    block_transformer; `extra` adds settings."""
    import diffusers

    return seeded(
        seed,
        lambda: getattr(diffusers, cls)(
            patch_size=(1, 2, 2),
            num_attention_heads=HEADS,
            attention_head_dim=HEAD_DIM,
            in_channels=4,
            out_channels=4,
            text_dim=TEXT_DIM,
            freq_dim=32,
            ffn_dim=64,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            eps=1e-6,
            rope_max_seq_len=64,
            **extra,
        ),
    )
