"""Tiny ControlNet pipelines: a family's tiny pipeline with a seeded two-block ControlNet whose
zero-initialised output layers are given random weights, so its residuals are not zero."""

from __future__ import annotations

from typing import Any

import torch


def _unzeroed(controlnet: Any, seed: int) -> Any:
    """ControlNets start with zeroed output projections (a trained one has learned them): fill them."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in controlnet.parameters():
            if not parameter.any():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return controlnet.eval()


def build_flux() -> Any:
    """FluxControlNetPipeline: tiny-flux plus a ControlNet of two double and two single blocks."""
    import diffusers

    from accel.models import _tiny_parts as parts
    from accel.models import flux

    pipe = flux.build_tiny()
    with parts.seeded(1000):
        controlnet = diffusers.FluxControlNetModel.from_transformer(
            pipe.transformer, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=4,
            load_weights_from_transformer=False,
        )
    return diffusers.FluxControlNetPipeline.from_pipe(pipe, controlnet=_unzeroed(controlnet, 1001))
