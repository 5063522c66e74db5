"""Wan Animate under context parallelism: its face adapter regroups the video tokens by latent frame,
which the engine runs on the whole frames each rank's shard touches (GroupedTokens). Equal to one
process on Ulysses 2, on Ring 3 at a token count 3, 4 and 8 do not divide (frames cut across ranks),
on CFG 2 x Ulysses 2 with the cache, and over two segments in replace mode."""

from __future__ import annotations

import numpy as np
import parallel_cases
import pytest
import torch
import variant_cases as cases

from accel.parallel.layout import SequenceLayout, group_window

TOLERANCE = 1e-4
ANIMATE = "accel.models.wan:build_tiny_animate"


def animate_call(frames: int = 5, size: tuple[int, int] = (64, 64), **more: object) -> dict:
    """A reference picture, `frames` pose frames and as many 16x16 face crops (the tiny motion
    encoder's size); one segment of `frames` frames unless `more` says otherwise."""
    width, height = size
    return {**dict(image=cases.picture(size), pose_video=cases.clip(size, frames), face_video=cases.clip((16, 16), frames),
                   prompt="a red fox", negative_prompt="blurry", height=height, width=width, segment_frame_length=frames,
                   num_inference_steps=2, guidance_scale=5.0), **more}


# 5 frames at 64x64: 2 latent frames and the reference picture's, of 4x4 patches: 48 tokens, 16 a
# frame; Ulysses 2 cuts frame 1 in half. 13 frames at 80x112: (4 + 1) latent frames of 5x7 = 175
# tokens, which 3, 4 and 8 do not divide; Ring 3's shards of 59 tokens cut frames 1 and 3.
ODD = dict(frames=13, size=(112, 80))
MODES = {"ulysses2": ({"ulysses": 2}, {}, {}),
         "ring3, odd size": ({"ring": 3}, ODD, {}),
         "cfg2 x ulysses2 + cache": ({"cfg": 2, "ulysses": 2}, dict(num_inference_steps=6), {"cache": {"threshold": 0.1}})}


@pytest.mark.parametrize("mode", list(MODES))
def test_animate_split_equals_one_process(rank_pools, mode: str) -> None:
    parallel, shape, recipe = MODES[mode]
    call = animate_call(**shape)
    expected, _, _ = parallel_cases.tiny_run(ANIMATE, recipe, call)
    if recipe:  # the cache skipped some calls (its statistics cover the last segment's scheduler reset: none)
        assert np.abs(expected - parallel_cases.tiny_run(ANIMATE, {}, call)[0]).max() > 0
    world = parallel.get("ulysses", 1) * parallel.get("ring", 1) * parallel.get("cfg", 1)
    runs = rank_pools(world).run(parallel_cases.tiny_run, ANIMATE, {**recipe, "parallel": parallel}, call)
    for output, _, bytes_sent in runs:
        assert bytes_sent > 0
        assert output.shape == expected.shape
        assert np.abs(output - expected).max() <= TOLERANCE


def test_animate_two_segments_in_replace_mode_equal_one_process(rank_pools) -> None:
    """The segment loop (9 pose frames in segments of 5 that share 1 frame: two segments, the second
    conditioned on the first's last frame) and replace mode (a background video and a per-frame mask)."""
    call = animate_call(frames=9, segment_frame_length=5, prev_segment_conditioning_frames=1, mode="replace",
                        background_video=cases.clip((64, 64), 9)[::-1], mask_video=[cases.mask((64, 64))] * 9)
    calls: list[int] = []
    pipe = parallel_cases.tiny_pipeline(ANIMATE)
    hook = pipe.transformer.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        expected, _, _ = parallel_cases.tiny_run(ANIMATE, {}, call)
    finally:
        hook.remove()
    assert len(calls) == 2 * 2 * 2  # segments x steps x CFG branches
    assert expected.shape == (1, 9, 64, 64, 3)
    for output, _, _ in rank_pools(2).run(parallel_cases.tiny_run, ANIMATE, {"parallel": {"ring": 2}}, call):
        assert np.abs(output - expected).max() <= TOLERANCE


def test_the_odd_size_cuts_latent_frames_across_ranks() -> None:
    """The ring-3 case runs 175 video tokens (3, 4 and 8 do not divide them) in 5 frames of 35."""
    pipe = parallel_cases.tiny_pipeline(ANIMATE)
    seen: list[tuple[int, int]] = []
    hook = pipe.transformer.face_adapter[0].register_forward_pre_hook(lambda _m, args: seen.append((args[0].shape[1], args[1].shape[1])))
    try:
        parallel_cases.tiny_run(ANIMATE, {}, animate_call(**ODD, num_inference_steps=1))
    finally:
        hook.remove()
    assert set(seen) == {(175, 5)}
    assert all(175 % world for world in (3, 4, 8))
    windows = [group_window(SequenceLayout(175, 3), rank, 5) for rank in range(3)]
    assert [(w.first, w.groups, w.offset, w.real) for w in windows] == [(0, 2, 0, 59), (1, 3, 24, 59), (3, 2, 13, 57)]


def _per_group(x: torch.Tensor, by: torch.Tensor) -> torch.Tensor:
    """A module that regroups its tokens by position as the face adapter does: group g of x's tokens
    (along dim 1) meets item g of `by` (dim 1), each token on its own."""
    groups = by.shape[1]
    return (x.unflatten(1, (groups, -1)) * by[:, :, None] + by[:, :, None].cumsum(-1)).flatten(1, 2)


@pytest.mark.parametrize("world", range(1, 9))
def test_group_windows_give_the_whole_sequence_result_at_any_length(world: int) -> None:
    """Every length up to 40, every group count dividing it: each rank's window run, cut back and
    joined, equals the module on the whole sequence; pad slots are zero; a rank computes at most two
    partial groups beyond its own real tokens."""
    generator = torch.Generator().manual_seed(world)
    for length in range(1, 41):
        layout = SequenceLayout(length, world)
        for groups in (g for g in range(1, length + 1) if length % g == 0):
            x = torch.randn(2, length, 3, generator=generator)
            by = torch.randn(2, groups, 3, generator=generator)
            shards = []
            for rank in range(world):
                window = group_window(layout, rank, groups)
                shard = window.extract(_per_group(window.embed(layout.split(x, 1, rank), 1), by.narrow(1, window.first, window.groups)), 1)
                assert shard.shape[1] == layout.shard and not shard[:, window.real :].any()
                assert window.real == 0 or window.groups * window.size - window.real <= 2 * (window.size - 1)
                shards.append(shard)
            torch.testing.assert_close(layout.join(shards, 1), _per_group(x, by), rtol=0, atol=0)


def test_a_group_count_that_does_not_divide_the_tokens_is_one_line() -> None:
    with pytest.raises(ValueError) as refused:
        group_window(SequenceLayout(10, 3), 0, 3)
    assert str(refused.value) == "context parallelism: 10 tokens do not fall in 3 equal groups"
