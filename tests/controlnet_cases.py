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


def build_qwenimage() -> Any:
    """QwenImageControlNetPipeline: tiny-qwenimage plus a two-block ControlNet of its shape."""
    import diffusers

    from accel.models import _tiny_parts as parts
    from accel.models import qwenimage

    pipe = qwenimage.build_tiny()
    with parts.seeded(1010):
        controlnet = diffusers.QwenImageControlNetModel.from_transformer(
            pipe.transformer, num_layers=2, attention_head_dim=16, num_attention_heads=4, load_weights_from_transformer=False,
        )
    return diffusers.QwenImageControlNetPipeline.from_pipe(pipe, controlnet=_unzeroed(controlnet, 1011))


def build_sd3() -> Any:
    """StableDiffusion3ControlNetPipeline: tiny-sd3 plus a two-block ControlNet of its shape."""
    import diffusers

    from accel.models import _tiny_parts as parts
    from accel.models import sd3

    pipe = sd3.build_tiny()
    with parts.seeded(1020):
        controlnet = diffusers.SD3ControlNetModel.from_transformer(
            pipe.transformer, num_layers=2, num_extra_conditioning_channels=0, load_weights_from_transformer=False,
        )
    return diffusers.StableDiffusion3ControlNetPipeline.from_pipe(pipe, controlnet=_unzeroed(controlnet, 1021))


def build_zimage() -> Any:
    """ZImageControlNetPipeline: tiny-zimage plus a ControlNet that adds a residual after both main
    layers (its refiners and embedders are the transformer's own, shared by the pipeline)."""
    import diffusers

    from accel.models import _tiny_parts as parts
    from accel.models import zimage

    pipe = zimage.build_tiny()
    config = pipe.transformer.config
    with parts.seeded(1030):
        controlnet = diffusers.ZImageControlNetModel(
            control_layers_places=[0, 1], control_in_dim=config.in_channels, dim=config.dim,
            n_refiner_layers=config.n_refiner_layers, n_heads=config.n_heads, n_kv_heads=config.n_kv_heads,
        )
    # Unzeroed before the pipeline shares the transformer's modules with it.
    return diffusers.ZImageControlNetPipeline.from_pipe(pipe, controlnet=_unzeroed(controlnet, 1031))
