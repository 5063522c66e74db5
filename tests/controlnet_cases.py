"""Tiny ControlNet pipelines: a family's tiny pipeline with a seeded two-block ControlNet whose
zero-initialised output layers are given random weights, so its residuals are not zero."""

from __future__ import annotations

from typing import Any

import torch


def run(
    builder: str, recipe: dict[str, Any], call: dict[str, Any], global_seed: int | None = 0
) -> tuple[Any, Any, int]:
    """parallel_cases.tiny_run with the global random state seeded first (None: this rank's index):
    SD 3.5's ControlNet pipelines draw the control picture's latents from it, not from the generator."""
    import torch.distributed as dist

    import parallel_cases

    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(rank if global_seed is None else global_seed)
    return parallel_cases.tiny_run(builder, recipe, call)


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

    from accel.models.tiny.seeding import seeded
    from accel.models import flux

    pipe = flux.build_tiny()
    with seeded(1000):
        controlnet = diffusers.FluxControlNetModel.from_transformer(
            pipe.transformer,
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=4,
            load_weights_from_transformer=False,
        )
    return diffusers.FluxControlNetPipeline.from_pipe(pipe, controlnet=_unzeroed(controlnet, 1001))


def build_qwenimage(pipeline: str = "QwenImageControlNetPipeline", extra_channels: int = 0) -> Any:
    """QwenImageControlNetPipeline: tiny-qwenimage plus a two-block ControlNet of its shape."""
    import diffusers

    from accel.models.tiny.seeding import seeded
    from accel.models import qwenimage

    pipe = qwenimage.build_tiny()
    with seeded(1010):
        controlnet = diffusers.QwenImageControlNetModel.from_transformer(
            pipe.transformer,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=4,
            load_weights_from_transformer=False,
            extra_condition_channels=extra_channels,
        )
    return getattr(diffusers, pipeline).from_pipe(pipe, controlnet=_unzeroed(controlnet, 1011))


def build_qwenimage_inpaint() -> Any:
    """QwenImageControlNetInpaintPipeline: the ControlNet also reads the mask (one channel, packed 2x2)."""
    return build_qwenimage("QwenImageControlNetInpaintPipeline", extra_channels=4)


def build_sd3(pipeline: str = "StableDiffusion3ControlNetPipeline", extra_channels: int = 0) -> Any:
    """StableDiffusion3ControlNetPipeline: tiny-sd3 plus a two-block ControlNet of its shape."""
    import diffusers

    from accel.models.tiny.seeding import seeded
    from accel.models import sd3

    pipe = sd3.build_tiny()
    with seeded(1020):
        controlnet = diffusers.SD3ControlNetModel.from_transformer(
            pipe.transformer,
            num_layers=2,
            num_extra_conditioning_channels=extra_channels,
            load_weights_from_transformer=False,
        )
    return getattr(diffusers, pipeline).from_pipe(pipe, controlnet=_unzeroed(controlnet, 1021))


def build_sd3_inpaint() -> Any:
    """StableDiffusion3ControlNetInpaintingPipeline: the ControlNet also reads the mask."""
    return build_sd3("StableDiffusion3ControlNetInpaintingPipeline", extra_channels=1)


def build_zimage(pipeline: str = "ZImageControlNetPipeline", inputs: int = 1) -> Any:
    """ZImageControlNetPipeline: tiny-zimage plus a ControlNet that adds a residual after both main
    layers (its refiners and embedders are the transformer's own, shared by the pipeline)."""
    import diffusers

    from accel.models.tiny.seeding import seeded
    from accel.models import zimage

    pipe = zimage.build_tiny()
    config = pipe.transformer.config
    with seeded(1030):
        controlnet = diffusers.ZImageControlNetModel(
            control_layers_places=[0, 1],
            control_in_dim=inputs * config.in_channels + (inputs > 1),
            dim=config.dim,
            n_refiner_layers=config.n_refiner_layers,
            n_heads=config.n_heads,
            n_kv_heads=config.n_kv_heads,
        )
    # Unzeroed before the pipeline shares the transformer's modules with it.
    return getattr(diffusers, pipeline).from_pipe(pipe, controlnet=_unzeroed(controlnet, 1031))


def build_zimage_inpaint() -> Any:
    """ZImageControlNetInpaintPipeline: the ControlNet reads the control latents, the mask and the
    masked picture's latents (the Union 2.0 layout: 16 + 1 + 16 channels)."""
    return build_zimage("ZImageControlNetInpaintPipeline", inputs=2)
