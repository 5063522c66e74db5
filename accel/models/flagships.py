"""Each family's largest public checkpoint as configs, for `accel plan` to measure before anything loads.

Configs are the published ones (the checkpoints' config.json files, as diffusers and transformers
read them); only the widths, depths and vocabularies matter here, since the plan builds every
component on the meta device to count its weights and on fake `cuda` to measure its working
memory. `inputs` makes the transformer's call at a size (batch 1: a CFG pipeline calls it once per
half, or once per rank under CFG parallel), in the current default dtype and device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Component:
    """One model of a pipeline as its library builds it from a config: `attr` names it in the pipeline."""

    attr: str
    library: str  # "diffusers" or "transformers"
    cls: str
    config: Mapping[str, Any]
    model_type: str = ""  # transformers: AutoConfig.for_model's key


@dataclass(frozen=True)
class Size:
    width: int
    height: int
    frames: int | None = None

    def describe(self) -> str:
        return f"{self.width}x{self.height}" + (f"x{self.frames}" if self.frames else "")


@dataclass(frozen=True)
class Flagship:
    title: str
    repo: str
    components: tuple[Component, ...]
    size: Size
    # The transformer call at a size (the keyword arguments of its forward).
    inputs: Callable[[Size], dict[str, Any]]
    # The latents the VAE decodes at a size, (batch, channels, [frames,] height, width).
    latents: Callable[[Size], tuple[int, ...]]

    def of_kind(self, attr_prefix: str) -> tuple[Component, ...]:
        return tuple(c for c in self.components if c.attr.startswith(attr_prefix))


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


def _grid_ids(axes: int, *sizes: int) -> torch.Tensor:
    """FLUX-style position ids: zeros then the grid coordinates, one row per token."""
    grids = torch.meshgrid(*(torch.arange(float(n)) for n in sizes), indexing="ij")
    ids = torch.stack([torch.zeros_like(grids[0])] * (axes - len(sizes)) + list(grids), -1)
    return ids.reshape(-1, axes)


T5_XXL = dict(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24, vocab_size=32128, feed_forward_proj="gated-gelu")
CLIP_L = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, vocab_size=49408,
              max_position_embeddings=77, projection_dim=768)
UMT5_XXL = dict(T5_XXL, vocab_size=256384)
# Mistral Small 3.1 24B (FLUX.2-dev's text encoder): its Mistral text model and Pixtral vision tower.
MISTRAL_SMALL_3 = dict(
    text_config=dict(model_type="mistral", hidden_size=5120, intermediate_size=32768, num_hidden_layers=40, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=131072, max_position_embeddings=131072),
    vision_config=dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                       patch_size=14, image_size=1540),
)
FLUX_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                use_quant_conv=False, use_post_quant_conv=False, scaling_factor=0.3611, shift_factor=0.1159)
WAN_14B = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096,
               freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6)


def _flux_inputs(size: Size) -> dict[str, Any]:
    h, w = size.height // 16, size.width // 16
    return dict(hidden_states=_randn(1, h * w, 64), encoder_hidden_states=_randn(1, 512, 4096), pooled_projections=_randn(1, 768),
                timestep=torch.ones(1), guidance=torch.full((1,), 3.5), img_ids=_grid_ids(3, h, w), txt_ids=torch.zeros(512, 3),
                return_dict=False)


def _flux2_inputs(size: Size) -> dict[str, Any]:
    h, w = size.height // 16, size.width // 16
    return dict(hidden_states=_randn(1, h * w, 128), encoder_hidden_states=_randn(1, 512, 15360), timestep=torch.ones(1),
                guidance=torch.full((1,), 4.0), img_ids=_grid_ids(4, 1, h, w)[None], txt_ids=_grid_ids(4, 512)[None],
                return_dict=False)


def _wan_inputs(size: Size) -> dict[str, Any]:
    frames = (size.frames or 81) - 1
    return dict(hidden_states=_randn(1, 16, frames // 4 + 1, size.height // 8, size.width // 8),
                encoder_hidden_states=_randn(1, 512, 4096), timestep=torch.ones(1), return_dict=False)


FLAGSHIPS: dict[str, Flagship] = {
    "flux": Flagship(
        "FLUX.1-dev", "black-forest-labs/FLUX.1-dev",
        (Component("transformer", "diffusers", "FluxTransformer2DModel", dict(guidance_embeds=True)),
         Component("text_encoder", "transformers", "CLIPTextModel", CLIP_L, "clip_text_model"),
         Component("text_encoder_2", "transformers", "T5EncoderModel", T5_XXL, "t5"),
         Component("vae", "diffusers", "AutoencoderKL", FLUX_VAE)),
        Size(1024, 1024), _flux_inputs, lambda s: (1, 16, s.height // 8, s.width // 8)),
    "flux2": Flagship(
        "FLUX.2-dev", "black-forest-labs/FLUX.2-dev",
        (Component("transformer", "diffusers", "Flux2Transformer2DModel", {}),
         Component("text_encoder", "transformers", "Mistral3ForConditionalGeneration", MISTRAL_SMALL_3, "mistral3"),
         Component("vae", "diffusers", "AutoencoderKLFlux2", {})),
        Size(1024, 1024), _flux2_inputs, lambda s: (1, 32, s.height // 8, s.width // 8)),
    "wan": Flagship(
        "Wan 2.2 T2V A14B", "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
        (Component("transformer", "diffusers", "WanTransformer3DModel", WAN_14B),
         Component("transformer_2", "diffusers", "WanTransformer3DModel", WAN_14B),
         Component("text_encoder", "transformers", "UMT5EncoderModel", UMT5_XXL, "umt5"),
         Component("vae", "diffusers", "AutoencoderKLWan", {})),
        Size(1280, 720, 81), _wan_inputs,
        lambda s: (1, 16, ((s.frames or 81) - 1) // 4 + 1, s.height // 8, s.width // 8)),
}
