"""HunyuanVideo 1.5's frame-causal VAE mask, filled a frame at a time (accel/vae/masks.py): the same
tensor as diffusers' row-by-row loop, in every decode accel.apply sets up, and undone by remove()."""

from __future__ import annotations

import parallel_cases as cases
import torch
from diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15 import HunyuanVideo15AttnBlock

import accel
from accel.hooks import wrappers
from accel.vae.masks import frame_causal_mask


def test_the_frame_at_a_time_mask_equals_diffusers_row_by_row_mask() -> None:
    for n_frame, n_hw, batch in ((1, 5, None), (3, 4, None), (4, 6, 2)):
        ours = frame_causal_mask(n_frame, n_hw, torch.float32, "cpu", batch)
        theirs = HunyuanVideo15AttnBlock.prepare_causal_attention_mask(n_frame, n_hw, torch.float32, "cpu", batch)
        assert ours.shape == theirs.shape and torch.equal(ours, theirs)
    # Frame 1's rows see frames 0 and 1, not 2.
    mask = frame_causal_mask(3, 2, torch.float32, "cpu")
    assert mask[2].tolist() == [0, 0, 0, 0, float("-inf"), float("-inf")]


def test_apply_fills_the_vae_masks_by_frame_with_the_same_decode_and_remove_restores_diffusers() -> None:
    pipe = cases.tiny_pipeline("tiny-hunyuan15")
    vae = pipe.vae
    attention = vae.decoder.mid_block.attentions[0]
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, vae.config.latent_channels, 3, 4, 6, generator=generator)
    with torch.no_grad():
        before = vae.decode(latents, return_dict=False)[0]
    built: list[int] = []
    hook = attention.register_forward_pre_hook(lambda *_: built.append(1))
    handle = accel.apply(pipe, {"model": {"name": "tiny-hunyuan15"}})
    try:
        assert wrappers(attention, "prepare_causal_attention_mask") == ["accel.frame_masks"]
        with torch.no_grad():
            after = vae.decode(latents, return_dict=False)[0]
    finally:
        handle.remove()
        hook.remove()
    assert built and torch.equal(before, after)
    assert wrappers(attention, "prepare_causal_attention_mask") == []
    assert "prepare_causal_attention_mask" not in vars(attention)  # diffusers' own staticmethod again
