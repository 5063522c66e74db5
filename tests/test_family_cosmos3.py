"""Cosmos 3 (accel/models/cosmos3.py): what its shared matrix rows do not show. `accel run` writes
the video with its sound track; a picture anchors the first latent frame (image-to-video), also on
CFG halves with the cache, where the pipeline masks each branch's predictions before the other
branch has run, and on Ring 3 (the text whole on every rank, the video and sound tokens cut); one
frame is a picture; a checkpoint that asks for the safety checker loads without it where
`cosmos_guardrail` is missing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from family_parallel import TOLERANCE
from variant_cases import picture, run_written

import parallel_cases as cases
import diffusers
from family_case import FakeCuda, FamilyCase, PROMPT, TinyCase
import block_cases
from torch import nn
from fakecuda import Grid, HEADS, Layout, randn
from accel.models import cosmos3


# Cosmos 3's transformer (its class defaults: a Qwen3-8B-shaped backbone, two of its 36 layers): 32 query and 8
# key/value
# heads of 128 in 4096, 48 latent channels (Wan 2.2's VAE) in 2x2 patches, a 151936-token vocabulary.
COSMOS3 = dict(
    hidden_size=4096,
    head_dim=128,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=12288,
    num_hidden_layers=2,
    latent_channel=48,
    latent_patch_size=2,
    patch_latent_dim=192,
    vocab_size=151936,
)


def fake_inputs(config: dict[str, Any], grid: Grid, batch: int, t: torch.Tensor) -> dict[str, Any]:
    """One sample packed without a batch dim: the prompt's token ids, then the video's 2x2 patches."""
    f, h, w, text = grid.frames, grid.rows, grid.cols, grid.text
    assert batch == 1
    video, at = grid.tokens, torch.arange(text, text + grid.tokens, device="cuda")
    return dict(
        input_ids=torch.zeros(text, dtype=torch.long, device="cuda"),
        text_indexes=torch.arange(text, device="cuda"),
        und_len=text,
        sequence_length=text + video,
        position_ids=torch.arange(text + video, device="cuda", dtype=torch.float32).expand(3, -1),
        vision_tokens=[randn(1, config["latent_channel"], f, 2 * h, 2 * w)],
        vision_token_shapes=[(f, h, w)],
        vision_sequence_indexes=at,
        vision_mse_loss_indexes=at,
        vision_timesteps=torch.full((video,), 500.0, device="cuda"),
        vision_noisy_frame_indexes=[torch.arange(f, device="cuda")],
        return_dict=False,
    )


def fake_output_shape(config: dict[str, Any], grid: Grid, batch: int, prefill: bool) -> tuple[int, ...]:
    return (
        1,
        batch,
        config["latent_channel"],
        grid.frames,
        2 * grid.rows,
        2 * grid.cols,
    )  # its list of one sample's (1, C, F, H, W) prediction, stacked


def fake_overrides(config: dict[str, Any]) -> dict[str, Any]:
    # grouped keys and values: half as many heads
    return {"num_attention_heads": HEADS, "num_key_value_heads": HEADS // 2}


# -- cosmos3: 2 decoder layers over the text (8 token ids, causal) and the generation stream (12 video
# patches of 2 latent frames at 4x6, then 3 sound latents), each layer returning both --------------
def block_transformer() -> nn.Module:
    from diffusers import Cosmos3OmniTransformer

    return block_cases.seeded(
        24,
        lambda: Cosmos3OmniTransformer(
            head_dim=block_cases.HEAD_DIM,
            hidden_size=block_cases.TEXT_DIM,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=block_cases.HEADS,
            num_key_value_heads=1,
            latent_channel=4,
            patch_latent_dim=16,
            vocab_size=64,
            rope_axes_dim=(4, 2, 2),
            sound_gen=True,
            sound_dim=4,
        ),
    )


def block_inputs(drift: float) -> block_cases.Inputs:
    """One sample packed as the pipeline packs it: token ids first, then the video's patches, then the sound."""
    text, video, sound = block_cases.TEXT_TOKENS, 12, 3
    video_at, sound_at = torch.arange(text, text + video), torch.arange(text + video, text + video + sound)
    return dict(
        input_ids=torch.arange(text) * 7 % 64,
        text_indexes=torch.arange(text),
        und_len=text,
        sequence_length=text + video + sound,
        position_ids=torch.arange(text + video + sound, dtype=torch.float32).expand(3, -1),
        vision_tokens=[block_cases.latents((1, 4, 2, 4, 6), drift)],
        vision_token_shapes=[(2, 2, 3)],
        vision_sequence_indexes=video_at,
        vision_mse_loss_indexes=video_at,
        vision_timesteps=torch.full((video,), 700.0 - 1000 * drift),
        vision_noisy_frame_indexes=[torch.arange(2)],
        sound_tokens=[block_cases.noise(torch.Generator().manual_seed(3), 4, sound)],
        sound_token_shapes=[(sound, 1, 1)],
        sound_sequence_indexes=sound_at,
        sound_mse_loss_indexes=sound_at,
        sound_timesteps=torch.full((sound,), 700.0 - 1000 * drift),
        sound_noisy_frame_indexes=[torch.arange(sound)],
        return_dict=False,
    )


CASE = FamilyCase(
    # Two calls a step (the prompt and the negative differ in length), the sound track with the video.
    dict(PROMPT, height=64, width=64, num_frames=5, num_inference_steps=4, guidance_scale=5.0, enable_sound=True),
    odd=dict(
        height=80, width=112
    ),  # 2 latent frames x 5x7 patches = 70 video tokens and 6 sound tokens: 76, cut as one stream
    threshold=0.06,
    tiny=TinyCase(
        name="cosmos3",
        build=cosmos3.build_tiny,
        pipeline_class=diffusers.Cosmos3OmniPipeline,
        call=dict(
            negative_prompt="blurry, low quality",
            height=64,
            width=64,
            num_frames=5,
            num_inference_steps=4,
            guidance_scale=5.0,
            enable_sound=True,
            output_type="np",
        ),
        output_attr="video",
        output_shape=(5, 64, 64, 3),  # one sample, no batch dim
        block_lists=("layers",),
        transformer_calls=8,  # CFG: the prompt's call, then the negative's, each step
        latent_shape=((1, 16, 2, 8, 8),),  # one sample's latents: 5 frames -> 2 latent frames of 8x8
        text_shape=(86,),  # the chat-templated prompt's token ids, with the duration and resolution sentences
        negative_text_shape=(79,),
        components=("transformer", "vae", "sound_tokenizer"),
        reload_tolerance=1e-5,
        inputs=("vision_tokens", "input_ids"),
    ),
    fake=FakeCuda(
        inputs=fake_inputs,
        output_shape=fake_output_shape,
        overrides=fake_overrides,
        shared_keys="text",
        # Cosmos 3 at 720p, 189 frames: 48 x 23 x 40 = 44160 video tokens after a 300-token prompt (whole on every
        # rank); its two calls a step on CFG halves x Ulysses 4 (8 query and 2 key/value heads a rank), with the cache.
        real_config=COSMOS3,
        real_layout=Layout(world=8, ulysses=4, cfg=2, cache=True, grid=Grid(48, 23, 40, 300)),
    ),
    block_transformer=block_transformer,
    block_inputs=block_inputs,
    refused_automatically="its transformer takes its streams without a batch dim",
)

CALL = CASE.call
PIXELS = 5 * 64 * 64 * 3  # the output's frames; the sound's samples follow them


def test_accel_run_writes_the_sound_into_the_mp4(tmp_path: Path) -> None:
    frames, sound = run_written(tmp_path / "fox.mp4", "tiny-cosmos3")
    assert frames.shape == (5, 64, 64, 3)
    assert sound is not None and sound.rate == 8000 and sound.samples.shape[0] == 2  # the tiny sound tokenizer's stereo
    expected, _, _ = cases.tiny_run(
        "tiny-cosmos3",
        {},
        dict(
            prompt="a red fox in the snow, photograph",
            height=64,
            width=64,
            num_frames=5,
            num_inference_steps=2,
            guidance_scale=5.0,
            enable_sound=True,
        ),
    )
    assert expected.size - PIXELS == 2 * 6 * 320  # 6 sound latents of 320 samples, two channels
    assert sound.samples.shape[1] == 6 * 320


def _noisy_frames(call: dict[str, Any]) -> list[list[int]]:
    """The latent frames each transformer call of a one-step run denoises."""
    seen: list[list[int]] = []
    hook = cases.tiny_pipeline("tiny-cosmos3").transformer.register_forward_pre_hook(
        lambda _module, _args, kwargs: seen.append(kwargs["vision_noisy_frame_indexes"][0].tolist()), with_kwargs=True
    )
    try:
        cases.tiny_run("tiny-cosmos3", {}, dict(call, num_inference_steps=1))
    finally:
        hook.remove()
    return seen


def test_a_picture_keeps_the_first_latent_frame_clean_and_one_frame_is_a_picture() -> None:
    assert _noisy_frames(CALL) == [[0, 1], [0, 1]]  # text-to-video: both latent frames, prompt and negative
    assert _noisy_frames(dict(CALL, image=picture())) == [[1], [1]]
    still, _, _ = cases.tiny_run("tiny-cosmos3", {}, dict(CALL, num_frames=1, num_inference_steps=1))
    assert still.size == 64 * 64 * 3 + 2 * 2 * 320  # one frame; 1/24 s of sound is 2 latents


def test_image_to_video_on_cfg_halves_with_the_cache_equals_one_process(rank_pools: Any) -> None:
    """Each half computes its branch and masks the other's predictions (the clean first frame zeroed)
    before they arrive: the masking waits for them. Calls cached alike on each half, sound included."""
    call = dict(CALL, image=picture(), num_inference_steps=8)
    cache = {"cache": {"threshold": CASE.threshold}}
    expected, records, _ = cases.tiny_run("tiny-cosmos3", cache, call)
    assert 0 < sum(cached for *_, cached in records) < len(records)
    runs = rank_pools(2).run(cases.tiny_run, "tiny-cosmos3", {**cache, "parallel": {"cfg": 2}}, call)
    for half, (output, got, bytes_sent) in enumerate(runs):
        assert bytes_sent > 0 and output.shape == expected.shape
        assert [(s, b, c) for s, b, _, c in got] == [(s, b, c) for s, b, _, c in records if b == half]
        assert np.abs(output - expected).max() <= TOLERANCE


def test_image_to_video_on_ring_3_with_the_cache_equals_one_process(rank_pools: Any) -> None:
    """The picture's clean latent frame, the noisy one and the sound tokens are the generation stream,
    cut over 3 ranks; each rank attends to the text it holds whole and to every rank's generation
    keys. Output (sound included) and cached calls as one process."""
    call = dict(CALL, image=picture(), num_inference_steps=8)
    cache = {"cache": {"threshold": CASE.threshold}}
    expected, records, _ = cases.tiny_run("tiny-cosmos3", cache, call)
    runs = rank_pools(3).run(cases.tiny_run, "tiny-cosmos3", {**cache, "parallel": {"ring": 3}}, call)
    for output, got, bytes_sent in runs:
        assert bytes_sent > 0 and output.shape == expected.shape
        assert [(s, b, c) for s, b, _, c in got] == [(s, b, c) for s, b, _, c in records]
        assert np.abs(output - expected).max() <= TOLERANCE


def test_a_checkpoint_asking_for_the_safety_checker_loads_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real checkpoints turn the safety checker on; diffusers then builds one, which raises
    ImportError without `cosmos_guardrail`. accel loads them without it, as the tiny pipeline is built."""
    import accel
    from diffusers.utils import is_cosmos_guardrail_available

    if is_cosmos_guardrail_available():
        pytest.skip("cosmos_guardrail is installed: the checkpoint's own safety checker loads")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cases.tiny_pipeline("tiny-cosmos3").save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    index["enable_safety_checker"] = True
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ImportError, match="cosmos_guardrail"):
        type(cases.tiny_pipeline("tiny-cosmos3")).from_pretrained(tmp_path)
    pipe = accel.load_pipeline(str(tmp_path), "float32")
    assert pipe.safety_checker is None and pipe.config.enable_safety_checker is False
    pipe.set_progress_bar_config(disable=True)
    loaded = cases.output_of(
        pipe(**dict(CALL, num_inference_steps=1), generator=torch.Generator().manual_seed(0), output_type="np"), pipe
    )
    expected, _, _ = cases.tiny_run("tiny-cosmos3", {}, dict(CALL, num_inference_steps=1))
    assert np.abs(loaded - expected).max() <= 1e-5


def test_accel_plan_offers_no_text_encoder_placement_where_there_is_no_text_encoder() -> None:
    """The transformer embeds the token ids: the plan's layouts keep no text encoder on the CPU or sharded."""
    from accel.memory.plan import make_plan
    from accel.models.flagships import Size

    plan = make_plan("cosmos3", 1, 80, size=Size(256, 256, 5))
    assert [(c.offload, c.text_encoder) for c in plan.candidates] == [
        ("none", "replicated"),
        ("model", "replicated"),
        ("group", "replicated"),
    ]
    assert plan.chosen is not None and plan.chosen.estimate.weights.keys() == {"transformer", "vae", "sound_tokenizer"}


def test_accel_serve_counts_the_prompt_with_its_text_tokenizer() -> None:
    """Its tokenizer is `text_tokenizer`; `sound_tokenizer` is an audio VAE."""
    from accel.serve.limits import token_counters

    pipe = cases.tiny_pipeline("tiny-cosmos3")
    counters = token_counters(pipe)
    assert [counter.name for counter in counters] == ["text_tokenizer"]
    assert (
        counters[0].count("a red fox") == len(pipe.text_tokenizer("a red fox", add_special_tokens=False).input_ids) > 3
    )
