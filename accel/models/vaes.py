"""How each VAE class decodes split over ranks: data for the generic engine in `accel/vae/`.

The engine handles every convolution, padding, GroupNorm and nearest upsampling of a decoder on
its own; a VAE only has to name the parts that see all positions at once (attention over the
whole latent), which every rank then runs on the gathered tensor for its own queries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

VaeMethod = Literal["patch"]


@dataclass(frozen=True)
class VaePlan:
    """One VAE class's parallel decode.

    `whole` lists decoder submodules (dotted names, `*` one segment) whose input is gathered so
    every rank holds all rows: their attention spans every position (and Hunyuan's mid-block
    builds a frame-causal mask from the full shape). Each rank still attends for its own rows
    only. `noise_rows`: the config key that says whether the decoder draws spatial noise (LTX
    0.9.1 injects it, 0.9.0 does not): when any entry is on, the noise is drawn at full height
    from a random state all ranks share and cut, so every rank adds the rows a single process
    would. Off, no random state is exchanged (an object broadcast: a host synchronisation).
    `frame_masks`: decoder submodules whose `prepare_causal_attention_mask` fills a frame-causal
    mask one row at a time; accel fills the same mask a frame at a time (accel/vae/masks.py), in
    every decode, parallel or not.
    """

    method: VaeMethod = "patch"
    whole: tuple[str, ...] = ()
    noise_rows: str | None = None
    frame_masks: tuple[str, ...] = ()


VAE_PLANS: dict[str, VaePlan] = {
    "AutoencoderKL": VaePlan(whole=("mid_block.attentions.*",)),
    "AutoencoderKLHunyuanVideo": VaePlan(whole=("mid_block",)),
    "AutoencoderKLWan": VaePlan(whole=("mid_block.attentions.*",)),
    "AutoencoderKLCogVideoX": VaePlan(),
    "AutoencoderKLMochi": VaePlan(),
    "AutoencoderKLLTXVideo": VaePlan(noise_rows="decoder_inject_noise"),
    "AutoencoderKLQwenImage": VaePlan(whole=("mid_block.attentions.*",)),  # Wan 2.1's decoder, for images
    # Qwen-Image 2.1's (Wan 2.2's residual shape, 16x, RGBA): local convolutions and channel
    # shuffles, one mid-block attention over the whole map.
    "AutoencoderKLQwenImage21": VaePlan(whole=("mid_block.attentions.*",)),
    "AutoencoderKLFlux2": VaePlan(whole=("mid_block.attentions.*",)),
    # RMS norms over channels and pixel-shuffle up-sampling are local; the mid-block attention
    # builds its frame-causal mask from the whole map.
    "AutoencoderKLHunyuanVideo15": VaePlan(whole=("mid_block.attentions.*",), frame_masks=("mid_block.attentions.*",)),
    # LTX-2's video decoder: causal 3-D convolutions, pixel-norm and pixel-shuffle upsampling, no
    # attention; 2.x checkpoints that inject noise say so in the same config key as LTX-Video 0.9.1.
    "AutoencoderKLLTX2Video": VaePlan(noise_rows="decoder_inject_noise"),
    # HunyuanImage 2.1's image decoder: GroupNorms, 3x3 convolutions, pixel-shuffle up-sampling (each
    # row becomes two) and channel-repeat shortcuts, all local to rows but the mid-block attention.
    "AutoencoderKLHunyuanImage": VaePlan(whole=("mid_block.attentions.*",)),
    # Its refiner's causal 3-D decoder (HunyuanVideo 1.5's shape): RMS norms over channels, pixel-shuffle
    # up-sampling; the mid-block attention spans every position unmasked.
    "AutoencoderKLHunyuanImageRefiner": VaePlan(whole=("mid_block.attentions.*",)),
}


def vae_plan(class_name: str) -> VaePlan | None:
    return VAE_PLANS.get(class_name)


def vae_plan_of(vae: object) -> VaePlan | None:
    """The plan of this VAE's class, or of its nearest base class that has one (None: no plan)."""
    return next((plan for cls in type(vae).__mro__ if (plan := vae_plan(cls.__name__)) is not None), None)
