"""LTX-2 family: one block list that runs two streams, video and audio, side by side. Each block
attends video to video, audio to audio, each to the text (cross-attention), then audio to video and
video to audio; the pipeline decodes the video with AutoencoderKLLTX2Video and the audio with
AutoencoderKLLTX2Audio (a mel spectrogram) and a vocoder (the waveform).

accel/models/ltx2_tiny.py builds its seeded, random-weight pipelines offline for tests.
"""

from __future__ import annotations

from accel.models.base import Acceleration, AudioOutput, BlockList, Family, GenerationDefaults
from accel.models.ltx2_refine import ancestral_scheduler, doubled_rate, refine_canvas
from accel.models.ltx2_tiny import build_tiny, build_tiny_dfr, build_tiny_dfr_refine
from accel.models.variant_format import Component, Conditions, NamedInput, Variant
from accel.parallel.plan_format import (
    DIFFUSERS_MLP,
    SELF_ATTENTION,
    FromDiffusers,
    Rotary,
    SequenceSplit,
    TensorPlan,
    split_layers,
)

# The blocks' per-module attention: the audio attends itself and the text whole on every rank, the
# video attends the text (left whole) and the audio locally; the audio's queries to the video are
# whole on every rank, the video keys cut.
_BLOCK = "transformer_blocks.*."

# Keyframes at latent frames: one at 0 replaces that frame's latents, one later joins the video tokens.
_KEYFRAMES = Conditions(
    "diffusers.pipelines.ltx2.pipeline_ltx2_condition.LTX2VideoCondition",
    units="latent frames, 8 video frames each after the first; -1 is the last",
    tiny=(("crf", 0),),
)

# DFR's transformer: LTX-2.5's learned marker of single-pixel-frame tokens.
_KEYFRAME_MARKER = (("use_keyframes_abs_pos_embedding", True),)
# What a DFR pass (or refine round) hands on with --out NAME.pt, and the refine round's keywords for it.
_DFR_PASS = ("frames", "audio", "keyframes", "keyframe_positions")
_REFINE_TAKES = ("latents", "audio_latents", "keyframes_latents", "keyframe_positions")


_ATTENTIONS = ("attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")
TENSOR_PLAN = TensorPlan(
    layers={
        **{
            key: style
            for name in _ATTENTIONS
            for key, style in split_layers(f"transformer_blocks.*.{name}", SELF_ATTENTION).items()
        },
        # LTX-2.3's per-head output gates: one column per head.
        **{f"transformer_blocks.*.{name}.to_gate_logits": "colwise" for name in _ATTENTIONS},
        **split_layers("transformer_blocks.*.ff", DIFFUSERS_MLP),
        **split_layers("transformer_blocks.*.audio_ff", DIFFUSERS_MLP),
    },
    # Every attention's query and key norms span all its heads.
    norms=tuple(f"transformer_blocks.*.{name}.{norm}" for name in _ATTENTIONS for norm in ("norm_q", "norm_k")),
    per_rank=("heads",),
    # Per head ("split" rope, (batch, heads, tokens, r)) or over the whole width ("interleaved").
    rotary=(
        Rotary(
            "transformer_blocks.*",
            ("video_rotary_emb", "audio_rotary_emb", "ca_video_rotary_emb", "ca_audio_rotary_emb"),
            {3: -1, 4: 1},
        ),
    ),
)


FAMILY = Family(
    name="ltx2",
    title="LTX-2",
    pipeline_class="LTX2Pipeline",
    transformer_class="LTX2VideoTransformer3DModel",
    vae="AutoencoderKLLTX2Video",
    repo="Lightricks/LTX-2",
    output="video",
    dtype="bfloat16",
    # The pipeline docstring's example: 121 frames at 768x512, 24 fps, guidance 3.
    defaults=GenerationDefaults(steps=30, height=512, width=768, frames=121, guidance_scale=3.0),
    size_step=32,
    frame_step=8,
    acceleration=Acceleration(
        # Each block returns (video, audio): the cache compares the video and skips both streams.
        blocks=(BlockList("transformer_blocks", returns=("hidden_states", "audio_hidden_states")),),
        # diffusers' _cp_plan cuts the video tokens and their rotary tables, and the text with its mask.
        # The video stream follows it. The text stays whole (keep_whole): its mask is an additive bias,
        # not the boolean key mask the engine splits keys by, and whole text makes the cross-attention
        # local (no exchange). The audio (about 25 tokens a second against the video's thousands) is
        # replicated, as in diffusers' plan: every rank runs the audio stream whole, so its own
        # attention, its text attention and the video's attention to it stay local; only the audio's
        # attention to the cut video spans ranks (whole queries, merged by log-sum-exp). Splitting the
        # audio would add four exchanges per block to save a few percent of compute.
        tensor=TENSOR_PLAN,
        parallel=FromDiffusers(
            streams=(("hidden_states", "video"), ("rope[0]", "video"), ("rope[1]", "video")),
            keep_whole=("encoder_hidden_states", "encoder_attention_mask"),
            attention_keys=("video",),
            output_stream="video",
            local_attention=(
                _BLOCK + "attn2",
                _BLOCK + "audio_attn1",
                _BLOCK + "audio_attn2",
                _BLOCK + "audio_to_video_attn",
            ),
            whole_queries=(_BLOCK + "video_to_audio_attn",),
            extra_splits=(
                # diffusers' plan cuts the rotary tables of the "interleaved" kind (B, tokens, dim) only;
                # LTX-2's "split" kind is (B, heads, tokens, dim / 2). The audio-video cross-attention's
                # video table (cross_attn_rope) is not in diffusers' plan at all.
                SequenceSplit("output", "video", dim=2, module="rope", ndim=4),
                SequenceSplit("output", "video", dim=1, module="cross_attn_rope", ndim=3),
                SequenceSplit("output", "video", dim=2, module="cross_attn_rope", ndim=4),
                SequenceSplit("timestep", "video", dim=1, ndim=2),  # image-to-video: one timestep per video token
                # LTX-2.5 DFR: (batch, tokens, 1), 1 on the tokens of single-pixel-frame latents (first frame, slots).
                SequenceSplit("video_keyframes_mask", "video", dim=1),
            ),
            batch_args=(
                "hidden_states",
                "audio_hidden_states",
                "encoder_hidden_states",
                "audio_encoder_hidden_states",
                "timestep",
                "audio_timestep",
                "sigma",
                "audio_sigma",
                "encoder_attention_mask",
                "audio_encoder_attention_mask",
                "video_coords",
                "audio_coords",
                "video_self_attention_mask",
            ),
        ),
        cfg="batch",
    ),
    frames_arg="num_frames",
    fps=24,
    heads=32,
    tiny_heads=4,
    tiny=build_tiny,
    tiny_defaults=GenerationDefaults(steps=4, height=64, width=96, frames=9, guidance_scale=4.0),
    # The picture is encoded as the first latent frame, whose tokens then get timestep 0. On real
    # weights the pipeline first re-compresses it with H.264 as in training (PyAV: pip install av);
    # the tiny variant, trained on nothing, skips that.
    variants=(
        Variant(
            "LTX2ImageToVideoPipeline", image="image", tiny_fixed=(("image_crf", 0),), same_weights_as="LTX2Pipeline"
        ),
        # Keyframes: a condition at latent frame 0 replaces that frame's latents (timestep 0 on its
        # tokens, as image-to-video); one elsewhere joins the video tokens as extra tokens with its
        # own positions, cut with them.
        Variant("LTX2ConditionPipeline", conditions=_KEYFRAMES),
        # IC-LoRA (with `--lora`): reference videos (depth, pose, …) join the tokens after the video's
        # and the keyframes', with their own positions: cut with them. `--arg
        # conditioning_attention_strength` below 1 makes an (L, L) mask over the video tokens (an
        # additive bias in the transformer, repeated per head by diffusers' attention): the engine
        # slices it per rank and key block as any whole-sequence pair mask; CFG halves split its batch.
        Variant(
            "LTX2InContextPipeline",
            conditions=_KEYFRAMES,
            references=Conditions(
                "diffusers.pipelines.ltx2.pipeline_ltx2_ic_lora.LTX2ReferenceCondition",
                units="",
                keyword="reference_conditions",
                index=None,
            ),
        ),
        # HDR IC-LoRA (with `--lora`): the SDR clip to convert (`--reference`, required; its length is
        # the video's unless `--frames` says otherwise; the pipeline cuts a longer one) joins the tokens
        # after the video's, as IC-LoRA's references, cut with them. It makes linear light in [0, inf)
        # (the VAE's LogC3 output inverted), no audio: `--out X.npy` keeps the float32 frames, `--out
        # X.mp4` is an SDR preview. `--arg reference_downscale_factor=N` for a LoRA trained on smaller
        # references. Guidance runs batched above guidance_scale 1 (the distilled model's 1: none).
        # Precomputed `connector_video_embeds` / `connector_audio_embeds` (tensors: a script's, with
        # accel.apply) replace the prompt's text, kept whole on every rank as it is.
        Variant(
            "LTX2HDRPipeline",
            output="hdr-video",
            references=Conditions(
                "diffusers.pipelines.ltx2.pipeline_ltx2_hdr_lora.LTX2HDRReferenceCondition",
                units="",
                keyword="reference_conditions",
                index=None,
                required=True,
                sets_frames=True,
            ),
        ),
        # LTX-2.5 DFR, one pass: the video canvas padded to whole keyframe segments, then appended
        # keyframes (--condition) and one latent frame of generated keyframe-slot tokens per segment,
        # all one video stream cut over the ranks (their per-token timesteps and keyframe marker with
        # them). A distilled schedule without guidance: `sigmas` (--arg) sets the steps, not --steps.
        Variant(
            "LTX2DFRPipeline",
            conditions=_KEYFRAMES,
            tiny=build_tiny_dfr,
            transformer_config=_KEYFRAME_MARKER,
            defaults=GenerationDefaults(steps=8, height=704, width=1216, frames=121),
            latent_output=_DFR_PASS,
        ),
        # A temporal refine round of a DFR pass's latents (--input latents=pass.pt): the canvas doubled
        # in time by the temporal latent upsampler, cut into tiles on the keyframe seams, each tile
        # (its video, its seam keyframe and a new slot, one stream) denoised under the plan with
        # the stage-1 audio frozen; twice the frames at twice the frame rate.
        Variant(
            "LTX2DFRTemporalRefinePipeline",
            tiny=build_tiny_dfr_refine,
            transformer_config=_KEYFRAME_MARKER,
            inputs=(
                NamedInput(
                    "latents",
                    "latents",
                    fields=tuple(zip(_DFR_PASS, _REFINE_TAKES, strict=True)),
                    made_by=("LTX2DFRPipeline", "LTX2DFRTemporalRefinePipeline"),
                    settings=refine_canvas,
                ),
            ),
            components=(
                Component("temporal_latent_upsampler", "diffusers.pipelines.ltx2.LTX2LatentUpsamplerModel"),
                Component("scheduler", "diffusers.LTXEulerAncestralRFScheduler", build=ancestral_scheduler),
            ),
            defaults=GenerationDefaults(steps=4, height=704, width=1216, frames=121),
            latent_output=_DFR_PASS,
            fps=doubled_rate,
        ),
    ),
    audio=AudioOutput(field="audio", sample_rate="vocoder.config.output_sampling_rate"),
)
