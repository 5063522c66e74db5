"""Qwen-Image: its case for the shared matrices (tests/families.py)."""

from __future__ import annotations

import diffusers
from family_case import FakeCuda, FamilyCase, PROMPT, TinyCase
import block_cases
from torch import nn
from typing import Any
import torch
from fakecuda import Grid, out_channels, randn
from accel.models import qwenimage


def fake_inputs(config: dict[str, Any], grid: Grid, batch: int, t: torch.Tensor) -> dict[str, Any]:
    """The pipeline drops an all-true prompt mask, so no mask here."""
    h, w, text = grid.rows, grid.cols, grid.text
    return dict(
        hidden_states=randn(batch, h * w, config["in_channels"]),
        encoder_hidden_states=randn(batch, text, config["joint_attention_dim"]),
        timestep=t / 1000,
        img_shapes=[[(1, h, w)]] * batch,
        return_dict=False,
    )


def fake_output_shape(config: dict[str, Any], grid: Grid, batch: int, prefill: bool) -> tuple[int, ...]:
    return (batch, grid.rows * grid.cols, 4 * out_channels(config))  # 2x2 patches


# -- qwenimage: 2 double-stream blocks, 4x4 packed image tokens next to block_cases.TEXT_TOKENS -----------------
def block_transformer() -> nn.Module:
    from diffusers import QwenImageTransformer2DModel

    return block_cases.seeded(
        16,
        lambda: QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=16,
            out_channels=4,
            num_layers=2,
            attention_head_dim=block_cases.HEAD_DIM,
            num_attention_heads=block_cases.HEADS,
            joint_attention_dim=block_cases.TEXT_DIM,
            axes_dims_rope=(4, 6, 6),
        ),
    )


def block_inputs(drift: float) -> block_cases.Inputs:
    return dict(
        hidden_states=block_cases.latents((1, 16, 16), drift),
        encoder_hidden_states=block_cases.text(),
        encoder_hidden_states_mask=block_cases.text_mask(),
        timestep=torch.tensor([0.7 - drift]),
        img_shapes=[[(1, 4, 4)]],
        return_dict=False,
    )


CASE = FamilyCase(
    dict(PROMPT, true_cfg_scale=4.0, height=64, width=64, num_inference_steps=4),
    odd=dict(height=48, width=80),  # 3x5 = 15 image tokens; 4 and 2 prompt tokens, unpadded
    threshold=0.5,
    tiny=TinyCase(
        name="qwenimage",
        build=qwenimage.build_tiny,
        pipeline_class=diffusers.QwenImagePipeline,
        call=dict(
            negative_prompt="blurry, low quality",
            height=64,
            width=64,
            num_inference_steps=4,
            true_cfg_scale=4.0,
            output_type="np",
        ),
        output_attr="images",
        output_shape=(1, 64, 64, 3),
        block_lists=("transformer_blocks",),
        transformer_calls=8,  # true CFG: a second call per step for the negative prompt
        latent_shape=(1, 16, 64),  # 64x64 -> 8x8 latents -> 4x4 packed tokens of 16*4 channels
        text_shape=(1, 29, 32),  # the prompt's tokens after the 34-token template prefix, unpadded
        negative_text_shape=(1, 21, 32),
        reload_tolerance=1e-5,  # seen: 4e-7 (a batch-1 timestep Linear on an unaligned weight)
        components=("text_encoder", "transformer", "vae"),
    ),
    fake=FakeCuda(
        inputs=fake_inputs,
        output_shape=fake_output_shape,
    ),
    block_transformer=block_transformer,
    block_inputs=block_inputs,
)


def test_edit_plus_combines_the_picture_and_its_references(tmp_path: Any) -> None:
    """Qwen-Image-Edit-Plus takes several pictures: --image and --reference reach its call as one list
    (the recipe's order), and the second picture changes the output."""
    import numpy as np
    from PIL import Image

    import variant_cases
    from accel.models.call import generation_kwargs
    from accel.models.input_files import open_inputs
    from accel.models.registry import FAMILIES
    from accel.recipe import Recipe

    paths = []
    for seed in (1, 2):
        paths.append(tmp_path / f"{seed}.png")
        Image.fromarray(np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(paths[-1])
    pipeline = "QwenImageEditPlusPipeline"
    recipe = Recipe().with_overrides(
        {
            "model": {"name": "tiny-qwenimage", "pipeline": pipeline},
            "generate": {"image": str(paths[0]), "references": (str(paths[1]),), "steps": 2},
        },
        source="test",
    )
    pipe = variant_cases.variant_pipeline("qwenimage", pipeline)
    call = open_inputs(generation_kwargs(FAMILIES["qwenimage"], True, recipe, pipe))
    assert [np.asarray(picture).tolist() for picture in call["image"]] == [
        np.asarray(Image.open(path).convert("RGB")).tolist() for path in paths
    ]
    outputs = []
    with variant_cases.small_reference(pipeline):
        for pictures in (call["image"], call["image"][:1]):
            result = pipe(**dict(call, image=pictures), generator=torch.Generator().manual_seed(0), output_type="np")
            outputs.append(result.images[0])
    assert outputs[0].shape == (64, 64, 3)
    assert np.abs(outputs[0] - outputs[1]).max() > 1e-3
