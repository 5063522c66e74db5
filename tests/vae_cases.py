"""Rank-side cases for the parallel VAE decode: each rank decodes the same latents alone and split.

Every rank holds the same seeded VAE and latents, so each computes its own single-process
reference; the split decode is compared with it where the pixels land.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from parallel_cases import tiny_pipeline
from torch.utils._python_dispatch import TorchDispatchMode

from accel.vae import ParallelDecode, plan_for


class LargestTensor(TorchDispatchMode):
    """The largest tensor any op produced while active, in bytes: how much one step of the decode holds."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel() * tensor.element_size())
        return out


def latents_for(vae: Any, rows: int, cols: int, frames: int | None, seed: int = 0) -> torch.Tensor:
    channels = int(vae.config.get("latent_channels") or vae.config["z_dim"])
    shape = (1, channels, rows, cols) if frames is None else (1, channels, frames, rows, cols)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def decode(vae: Any, latents: torch.Tensor, *extra: Any) -> torch.Tensor:
    with torch.no_grad():
        return vae.decode(latents, *extra, return_dict=False)[0]


_vaes: dict[str, Any] = {}


def ltx_noise_vae() -> Any:
    """tiny-ltx's VAE shape with LTX 0.9.1's decoder features: injected spatial noise and timestep
    conditioning (decode takes a timestep)."""
    from diffusers import AutoencoderKLLTXVideo

    torch.manual_seed(5)
    vae = AutoencoderKLLTXVideo(
        latent_channels=16,
        block_out_channels=(8, 16, 16, 16),
        decoder_block_out_channels=(16, 16, 16, 16),
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, True, False),
        decoder_spatio_temporal_scaling=(True, True, True, False),
        decoder_inject_noise=(True, True, True, True, False),
        upsample_residual=(False, False, False, False),
        upsample_factor=(1, 1, 1, 1),
        timestep_conditioning=True,
        patch_size=4,
        patch_size_t=1,
        resnet_norm_eps=1e-6,
        encoder_causal=True,
        decoder_causal=False,
    ).eval()
    with torch.no_grad():  # the noise scales start at zero, which would hide the noise
        for name, parameter in vae.named_parameters():
            if "per_channel_scale" in name:
                parameter.uniform_(0.5, 1.0)
    return vae


def tiny_vae(model: str) -> Any:
    """The VAE of a tiny pipeline (alias or builder), or "ltx-noise"."""
    if model not in _vaes:
        _vaes[model] = ltx_noise_vae() if model == "ltx-noise" else tiny_pipeline(model).vae
    return _vaes[model]


def vae_decode_case(
    model: str, rows: int, cols: int, frames: int | None, tiles: dict[str, Any] | None = None, all_ranks: bool = False
) -> dict[str, Any]:
    """Split decode against the single-process decode on this rank: max abs difference where the
    pixels arrive (None elsewhere), the largest tensor each way, and whether the others got zeros.
    `tiles`: decode tiled, with these VAE tile attributes."""
    vae = tiny_vae(model)
    if tiles:
        vae.enable_tiling()
        saved = {name: getattr(vae, name) for name in tiles}
        for name, value in tiles.items():
            setattr(vae, name, value)
    latents = latents_for(vae, rows, cols, frames)
    extra = (torch.tensor([0.05]),) if model == "ltx-noise" else ()
    try:
        torch.manual_seed(1)
        single_tracker = LargestTensor()
        with single_tracker:
            reference = decode(vae, latents, *extra)
        engine = ParallelDecode(vae, plan_for(vae), all_ranks=all_ranks)
        try:
            torch.manual_seed(1 + 1000 * dist.get_rank())  # ranks disagree: the engine adopts rank 0's state
            split_tracker = LargestTensor()
            with split_tracker:
                output = decode(vae, latents, *extra)
        finally:
            engine.remove()
        torch.manual_seed(1)
        undone = decode(vae, latents, *extra)
    finally:
        if tiles:
            vae.disable_tiling()
            for name, value in saved.items():
                setattr(vae, name, value)
    gets_pixels = all_ranks or dist.get_rank() == 0
    return {
        "error": float((output - reference).abs().max()) if gets_pixels else None,
        "zeros": bool((output == 0).all()) if not gets_pixels else None,
        "shape": tuple(output.shape),
        "reference_shape": tuple(reference.shape),
        "undone_equal": bool(torch.equal(undone, reference)),
        "largest_single": single_tracker.largest,
        "largest_split": split_tracker.largest,
        "calls": engine.calls,
    }


class ToyVae(torch.nn.Module):
    """A decoder of plain torch layers the engine must split without any plan: dilated and
    reflect-padded convolutions, replicate padding, GroupNorm, nearest upsampling, and `last` as
    the final layer (a refusal case swaps in one the split cannot follow)."""

    def __init__(self, last: str = "conv") -> None:
        super().__init__()
        torch.manual_seed(3)
        final: dict[str, torch.nn.Module] = {
            "conv": torch.nn.Conv2d(8, 3, 3, padding=1),
            "bilinear": torch.nn.Upsample(scale_factor=2, mode="bilinear"),
            "transposed": torch.nn.ConvTranspose2d(8, 3, 4, stride=2, padding=1),
            "wide": torch.nn.Conv2d(8, 3, 7, padding=3),
        }
        self.decoder = torch.nn.Sequential(
            torch.nn.Conv2d(4, 8, 3, padding=1),
            torch.nn.GroupNorm(2, 8),
            torch.nn.SiLU(),
            torch.nn.Conv2d(8, 8, 3, padding=2, dilation=2),
            torch.nn.Upsample(scale_factor=2, mode="nearest"),
            torch.nn.Conv2d(8, 8, 5, padding=2, padding_mode="reflect"),
            torch.nn.Conv2d(8, 8, 3, padding=1, padding_mode="replicate"),
            torch.nn.GroupNorm(4, 8),
            final[last] if last != "wide" else torch.nn.Identity(),
        )
        if last == "wide":  # a 7-row reach at latent size, before any upsampling
            self.decoder.insert(0, torch.nn.Conv2d(4, 4, 7, padding=3))
        self.eval()

    def decode(self, z: torch.Tensor, return_dict: bool = False) -> tuple[torch.Tensor]:
        return (self.decoder(z),)


def toy_decode_case(last: str, rows: int) -> str | float:
    """Max abs difference of the toy decoder split against whole on this rank, or the error's line."""
    from accel.errors import UserError
    from accel.models.vaes import VaePlan

    vae = ToyVae(last)
    latents = torch.randn((2, 4, rows, 5), generator=torch.Generator().manual_seed(0))
    reference = decode(vae, latents)
    engine = ParallelDecode(vae, VaePlan(), all_ranks=True)
    try:
        return float((decode(vae, latents) - reference).abs().max())
    except UserError as error:
        return f"{type(error).__name__}: {error}"
    finally:
        engine.remove()
