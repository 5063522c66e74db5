"""Wan Animate under context parallelism: its face adapter regroups the video tokens by latent frame,
which the engine runs on each rank's own tokens a run of frames at a time (GroupedTokens). Equal to one
process on Ulysses 2, on Ring 3 at a token count 3, 4 and 8 do not divide (frames cut across ranks),
on CFG 2 x Ulysses 2 with the cache, and over two segments in replace mode."""

from __future__ import annotations

import numpy as np
import parallel_cases
import pytest
import torch
import variant_cases as cases

from accel.parallel.layout import GroupRun, SequenceLayout, group_runs

TOLERANCE = 1e-4
ANIMATE = "accel.models.wan:build_tiny_animate"


def animate_call(frames: int = 5, size: tuple[int, int] = (64, 64), **more: object) -> dict:
    """A reference picture, `frames` pose frames and as many 16x16 face crops (the tiny motion
    encoder's size); one segment of `frames` frames unless `more` says otherwise."""
    width, height = size
    return {
        **dict(
            image=cases.picture(size),
            pose_video=cases.clip(size, frames),
            face_video=cases.clip((16, 16), frames),
            prompt="a red fox",
            negative_prompt="blurry",
            height=height,
            width=width,
            segment_frame_length=frames,
            num_inference_steps=2,
            guidance_scale=5.0,
        ),
        **more,
    }


# 5 frames at 64x64: 2 latent frames and the reference picture's, of 4x4 patches: 48 tokens, 16 a
# frame; Ulysses 2 cuts frame 1 in half. 13 frames at 80x112: (4 + 1) latent frames of 5x7 = 175
# tokens, which 3, 4 and 8 do not divide; Ring 3's shards of 59 tokens cut frames 1 and 3.
ODD = dict(frames=13, size=(112, 80))
MODES = {
    "ulysses2": ({"ulysses": 2}, {}, {}),
    "ring3, odd size": ({"ring": 3}, ODD, {}),
    "cfg2 x ulysses2 + cache": ({"cfg": 2, "ulysses": 2}, dict(num_inference_steps=6), {"cache": {"threshold": 0.1}}),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_animate_split_equals_one_process(rank_pools, mode: str) -> None:
    parallel, shape, recipe = MODES[mode]
    call = animate_call(**shape)
    expected, _, _ = parallel_cases.tiny_run(ANIMATE, recipe, call)
    if recipe:  # the cache skipped some calls
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
    call = animate_call(
        frames=9,
        segment_frame_length=5,
        prev_segment_conditioning_frames=1,
        mode="replace",
        background_video=cases.clip((64, 64), 9)[::-1],
        mask_video=[cases.mask((64, 64))] * 9,
    )
    calls: list[int] = []
    pipe = parallel_cases.tiny_pipeline(ANIMATE)
    hook = pipe.transformer.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        expected, _, _ = parallel_cases.tiny_run(ANIMATE, {}, call)
    finally:
        hook.remove()
    assert len(calls) == 2 * 2 * 2  # segments x steps x CFG branches
    assert expected.shape == (1, 9, 64, 64, 3)
    # The cache's statistics cover the whole call, though the pipeline restarts its schedule per segment.
    _, decisions, _ = parallel_cases.tiny_run(ANIMATE, {"cache": {"threshold": 0.1}}, call)
    assert (
        decisions is not None
        and [(step, branch) for step, branch, _, _ in decisions] == [(0, 0), (0, 1), (1, 0), (1, 1)] * 2
    )
    for output, _, _ in rank_pools(2).run(parallel_cases.tiny_run, ANIMATE, {"parallel": {"ring": 2}}, call):
        assert np.abs(output - expected).max() <= TOLERANCE


def test_the_odd_size_cuts_latent_frames_across_ranks() -> None:
    """The ring-3 case runs 175 video tokens (3, 4 and 8 do not divide them) in 5 frames of 35."""
    pipe = parallel_cases.tiny_pipeline(ANIMATE)
    seen: list[tuple[int, int]] = []
    hook = pipe.transformer.face_adapter[0].register_forward_pre_hook(
        lambda _m, args: seen.append((args[0].shape[1], args[1].shape[1]))
    )
    try:
        parallel_cases.tiny_run(ANIMATE, {}, animate_call(**ODD, num_inference_steps=1))
    finally:
        hook.remove()
    assert set(seen) == {(175, 5)}
    assert all(175 % world for world in (3, 4, 8))
    # Shards of 59 tokens: frames 1 and 3 are cut between ranks.
    assert [group_runs(SequenceLayout(175, 3), rank, 5) for rank in range(3)] == [
        [GroupRun(0, 35, 0, 1), GroupRun(35, 24, 1, 1)],
        [GroupRun(0, 11, 1, 1), GroupRun(11, 35, 2, 1), GroupRun(46, 13, 3, 1)],
        [GroupRun(0, 22, 3, 1), GroupRun(22, 35, 4, 1)],
    ]


def padding_rank_error() -> float:
    """Max-abs difference, this rank, between Wan Animate's transformer on Ring 3 and on one process
    at 2 latent frames of one token each: the third rank holds padding alone, and still runs."""
    from accel.models.registry import FAMILIES
    from accel.parallel.mesh import Degrees, build_mesh
    from accel.parallel.engine import ContextParallel
    from accel.parallel.plan import resolve_plan

    generator = torch.Generator().manual_seed(0)
    call = dict(
        hidden_states=torch.randn(1, 36, 2, 2, 2, generator=generator),
        timestep=torch.tensor([500.0]),
        encoder_hidden_states=torch.randn(1, 512, 32, generator=generator),
        pose_hidden_states=torch.randn(1, 16, 1, 2, 2, generator=generator),
        face_pixel_values=torch.randn(1, 3, 1, 16, 16, generator=generator),
        return_dict=False,
    )
    transformer = parallel_cases.tiny_pipeline(ANIMATE).transformer
    with torch.no_grad():
        expected = transformer(**call)[0]
        engine = ContextParallel(
            transformer,
            resolve_plan(FAMILIES["wan"].plan_for(transformer), transformer),
            build_mesh(Degrees(ring=3), "cpu"),
        )
        try:
            got = transformer(**call)[0]
        finally:
            engine.remove()
    return (got - expected).abs().max().item()


def test_a_rank_of_padding_alone_runs_the_face_adapter_for_nothing(rank_pools) -> None:
    assert group_runs(SequenceLayout(2, 3), 2, 2) == []
    assert max(rank_pools(3).run(padding_rank_error)) <= TOLERANCE


def _per_group(x: torch.Tensor, by: torch.Tensor) -> torch.Tensor:
    """A module that regroups its tokens by position as the face adapter does: group g of x's tokens
    (along dim 1) meets item g of `by` (dim 1), each token on its own."""
    groups = by.shape[1]
    return (x.unflatten(1, (groups, -1)) * by[:, :, None] + by[:, :, None].cumsum(-1)).flatten(1, 2)


@pytest.mark.parametrize("world", range(1, 9))
def test_group_runs_give_the_whole_sequence_result_at_any_length(world: int) -> None:
    """Every length up to 40, every group count dividing it: each rank's runs, joined and padded,
    equal the module on the whole sequence; each rank computes its real tokens once, in at most three
    runs, each of whole groups or within one group."""
    generator = torch.Generator().manual_seed(world)
    for length in range(1, 41):
        layout = SequenceLayout(length, world)
        for groups in (g for g in range(1, length + 1) if length % g == 0):
            size = length // groups
            x = torch.randn(2, length, 3, generator=generator)
            by = torch.randn(2, groups, 3, generator=generator)
            shards = []
            for rank in range(world):
                shard, runs = layout.split(x, 1, rank), group_runs(layout, rank, groups)
                assert len(runs) <= 3 and sum(run.tokens for run in runs) == layout.real(rank)
                assert all(run.tokens == run.groups * size or run.groups == 1 for run in runs)
                pieces = [
                    _per_group(shard.narrow(1, run.start, run.tokens), by.narrow(1, run.first, run.groups))
                    for run in runs
                ]
                shards.append(torch.cat([*pieces, x.new_zeros(2, layout.shard - layout.real(rank), 3)], 1))
            torch.testing.assert_close(layout.join(shards, 1), _per_group(x, by), rtol=0, atol=0)


def test_a_group_count_that_does_not_divide_the_tokens_is_one_line() -> None:
    with pytest.raises(ValueError) as refused:
        group_runs(SequenceLayout(10, 3), 0, 3)
    assert str(refused.value) == "context parallelism: 10 tokens do not fall in 3 equal groups"
