"""Kandinsky 6.0 family: text (and optionally a picture) to video with its sound, one transformer
denoising both. Each of its fused blocks runs the video stream (self-attention, cross-attention to
the Qwen2.5-VL text, feed-forward) and the audio stream (the same, on its own text branch) side by
side, then lets each attend to the other (video to audio, audio to video). Two text branches (one
per stream) refine the text before the fused blocks. HunyuanVideo's VAE decodes the video, the
MMAudio VAE the audio latents to a mel spectrogram and its BigVGAN vocoder that to a waveform.

With a picture, its latents join the video as one more latent frame at the end, marked by a token
type and given the first frame's rotary position: the video stream is one frame longer.

`build_tiny` makes a seeded, random-weight Kandinsky-6.0-shaped pipeline offline for tests;
`build_tiny_distilled` the distilled checkpoints' shape (PiflowScheduler, widened outputs).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from accel.models.base import Acceleration, AudioOutput, BlockList, Family, GenerationDefaults
from accel.models.variant_format import Variant
from accel.parallel.plan_format import DIFFUSERS_MLP, ParallelPlan, SequenceSplit, TensorPlan, split_layers

if TYPE_CHECKING:
    from diffusers import Kandinsky6TI2VAPipeline

# Seeds apart from the other families' tiny builders (seed x 8 + 0..7, and the 1000s to 3000s).
_SEEDS = 6000
_Z_DIM = 16  # HunyuanVideo's latent width
_MEL_BINS = 16
_AUDIO_Z_DIM = 8  # the audio VAE's latent channels, which the transformer reads and predicts


def _heads(config: Mapping[str, Any]) -> int:
    """The config states no head count: the video stream is model_dim wide over heads of sum(axes_dims)."""
    return int(config["model_dim"]) // sum(config["axes_dims"])


def random_modulation(transformer: Any) -> None:
    """Random weights for every adaLN modulation, as kandinsky5.random_modulation does for its
    blocks (diffusers starts them at zero, which makes each block an identity no test could tell
    from a broken one). Call it inside `seeded`."""
    for module in transformer.modules():
        if type(module).__name__ == "Kandinsky6Modulation":
            module.out_layer.reset_parameters()
            for parameter in module.out_layer.parameters():
                parameter.data.mul_(0.3)


def build_tiny(seed: int = 0) -> "Kandinsky6TI2VAPipeline":
    """A tiny Kandinsky 6.0 look-alike: real classes, the released checkpoints' switches (cross-modal
    rotary positions, cross gates, fixed modulation, two token types for the picture frame), widths
    scaled down, random seeded weights.

    Two text blocks per branch and two fused blocks; four 16-wide video heads (64 wide) and two
    16-wide audio heads (32 wide; the cross-modal rotary tables need one head width for both). 5
    frames at 64x64 give 2 latent frames of 4x4 patches, 32 video tokens; their 5/24 s of sound at
    16 kHz give 53 audio tokens (hop 64). The Qwen2 tokenizer spends the pipeline's 129 tokens on the
    prompt template's system part, which the pipeline crops off; CLIP gives the pooled vector. The
    MMAudio VAE (two levels, 16 mel bins) and a three-stage BigVGAN vocoder (32x) make the sound.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler

    # Kandinsky 5's flow shift; the distilled checkpoints ship a PiflowScheduler instead (build_tiny_distilled).
    return _build(seed, FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0), grid=1)


# Predictions per latent channel of the tiny distilled transformer (the real PiflowScheduler's default: 10).
TINY_GRID = 2


def build_tiny_distilled(seed: int = 0) -> "Kandinsky6TI2VAPipeline":
    """The tiny pipeline as a distilled checkpoint: a PiflowScheduler integrating a policy between the
    model's evaluations, from a transformer that predicts TINY_GRID values per latent channel of the
    video and of the audio (its output layers that many times wider); no guidance (scale 1)."""
    from diffusers import PiflowScheduler

    return _build(seed, PiflowScheduler(shift=5.0, n_grid=TINY_GRID), grid=TINY_GRID)


def _build(seed: int, scheduler: Any, grid: int) -> "Kandinsky6TI2VAPipeline":
    """build_tiny's pipeline with `scheduler`, its transformer predicting `grid` values per latent channel."""
    from diffusers import Kandinsky6TI2VAPipeline, Kandinsky6Transformer3DModel, MMAudioVAE, MMAudioVocoder
    from diffusers.pipelines.kandinsky6.pipeline_kandinsky6_ti2va import _PROMPT_TEMPLATE, _QWEN_CROP_START

    from accel.models.tiny.clip import clip_text_model, clip_tokenizer  # heavy (transformers): only when building
    from accel.models.tiny.qwen import qwen25_vl_model, qwen2_tokenizer
    from accel.models.tiny.seeding import finish, seeded
    from accel.models.tiny.vaes import hunyuan_video_vae

    base = _SEEDS + seed * 8
    tokenizer = qwen2_tokenizer(_PROMPT_TEMPLATE, prefix_tokens=_QWEN_CROP_START)
    text_encoder = qwen25_vl_model(tokenizer, seed=base + 1)
    tokenizer_2 = clip_tokenizer()
    text_encoder_2 = clip_text_model(tokenizer_2, seed=base + 2)
    with seeded(base + 3):
        transformer = finish(
            Kandinsky6Transformer3DModel(
                in_visual_dim=_Z_DIM,
                out_visual_dim=_Z_DIM * grid,
                in_text_dim=text_encoder.config.text_config.hidden_size,
                in_text_dim2=text_encoder_2.config.hidden_size,
                time_dim=32,
                patch_size=(1, 2, 2),
                model_dim=64,
                ff_dim=128,
                num_text_blocks=2,
                num_visual_blocks=2,
                axes_dims=(4, 6, 6),
                visual_cond=True,
                in_audio_dim=_AUDIO_Z_DIM,
                out_audio_dim=_AUDIO_Z_DIM * grid,
                model_dim_a=32,
                time_dim_a=32,
                ff_dim_a=64,
                axes_dims_a=(4, 6, 6),
                text_token_padding=True,
                ca_rope=True,
                cross_gates=True,
                fix_modulation=True,
                visual_token_type_num_embeddings=2,
            )
        )
        random_modulation(transformer)
    with seeded(base + 4):
        vae = finish(hunyuan_video_vae())
    with seeded(base + 5):
        audio_vae = finish(
            MMAudioVAE(
                mel_bins=_MEL_BINS,
                latent_channels=_AUDIO_Z_DIM,
                hidden_channels=8,
                channel_multipliers=(1, 2),
                layers_per_block=1,
                sample_rate=16000,
                n_fft=64,
                hop_length=32,
            )
        )
    with seeded(base + 6):
        # Its upsampling (4 x 4 x 2) is the audio VAE's mel hop, as on the real pair (512).
        vocoder = finish(
            MMAudioVocoder(
                num_mels=_MEL_BINS,
                upsample_initial_channel=16,
                upsample_rates=(4, 4, 2),
                upsample_kernel_sizes=(8, 8, 4),
                resblock_kernel_sizes=(3,),
                resblock_dilation_sizes=((1,),),
            )
        )
    return Kandinsky6TI2VAPipeline(
        transformer=transformer,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        scheduler=scheduler,
        audio_vae=audio_vae,
        vocoder=vocoder,
    )


def _frame_rate(call: Mapping[str, Any]) -> float:
    """The rate the video plays at: the call's `frame_rate` (24 unless given), which also sets how long
    the sound is made, so the MP4's picture and sound stay together."""
    return float(call.get("frame_rate", 24.0))


_FUSED = "visual_transformer_blocks.*"
_ATTENTION = (("to_query", "to_key", "to_value"), ("out_layer",))
TENSOR_PLAN = TensorPlan(
    layers={
        **{
            key: style
            for stream in ("video_dec_block", "audio_dec_block")
            for name in ("self_attention", "cross_attention")
            for key, style in split_layers(f"{_FUSED}.{stream}.{name}", _ATTENTION).items()
        },
        **split_layers(f"{_FUSED}.video_dec_block.feed_forward", DIFFUSERS_MLP),
        **split_layers(f"{_FUSED}.audio_dec_block.feed_forward", DIFFUSERS_MLP),
        # The cross-modal attentions: video queries to audio keys, audio queries to video keys.
        **split_layers(f"{_FUSED}.va_cross_attention", _ATTENTION),
        **split_layers(f"{_FUSED}.av_cross_attention", _ATTENTION),
    },
    per_rank=("num_heads",),
)


def predictions_like(call: Mapping[str, Any]) -> tuple[Any, ...]:
    """What a transformer call returns (`return_dict=False`): the video's prediction, shaped as the
    video latents it is given, then, where it is given audio latents, the audio's, shaped as those."""
    audio = call.get("audio_hidden_states")
    return (call["hidden_states"],) if audio is None else (call["hidden_states"], audio)


FAMILY = Family(
    name="kandinsky6",
    title="Kandinsky 6.0",
    pipeline_class="Kandinsky6TI2VAPipeline",
    transformer_class="Kandinsky6Transformer3DModel",
    vae="AutoencoderKLHunyuanVideo",
    repo="kandinskylab/Kandinsky-6.0-Pro-5s-Diffusers",
    output="video",
    dtype="bfloat16",
    # The pipeline call's own defaults: 512x768, 121 frames (5 s at 24 fps), 50 steps, guidance 5.
    # (Its docstring's example runs a distilled checkpoint: 16 steps, no guidance, PiflowScheduler.)
    defaults=GenerationDefaults(steps=50, height=512, width=768, frames=121, guidance_scale=5.0),
    # The pipeline refuses sizes off 16 px (8x VAE, 2x2 patches) and rounds frames to 4k+1.
    size_step=16,
    frame_step=4,
    acceleration=Acceleration(
        # The fused blocks only, which return (video, audio): the cache compares the video and skips
        # both streams. The text branches see no latents, so their residual says nothing about how far
        # the video moved between steps; they run every call (four blocks of each on the real models).
        blocks=(BlockList("visual_transformer_blocks", returns=("vis", "aud")),),
        primary_stream="vis",
        heads_of_config=_heads,
        tensor=TENSOR_PLAN,
        # The video tokens are cut where the fused blocks start, with the rotary table every block gets
        # (one tensor: cut once; (tokens, 1, width / 2, 2, 2)). The text stays whole on every rank, so
        # both text branches and both cross-attentions to the text run unchanged. The audio (about
        # 1/40 of the video's tokens on the real models) is replicated as LTX-2's: every rank runs the
        # audio stream whole, so its own attentions and the video's attention to it stay local; only the
        # audio's attention to the cut video spans ranks (whole queries, merged by log-sum-exp). The
        # transformer reshapes the video to its grid right after the last block: gathered there (the
        # block's first output; the audio it returns beside it is whole already).
        parallel=ParallelPlan(
            splits=(
                SequenceSplit("vis", "video", dim=1, module="visual_transformer_blocks.0"),
                SequenceSplit("vis_rope", "video", dim=0, module=_FUSED),
            ),
            attention_keys=("video",),
            output_stream="video",
            output_dim=1,
            output_module="visual_transformer_blocks.-1",
            local_attention=(
                "video_text_transformer_blocks.*",
                "audio_text_transformer_blocks.*",
                f"{_FUSED}.video_dec_block.cross_attention",
                f"{_FUSED}.audio_dec_block.self_attention",
                f"{_FUSED}.audio_dec_block.cross_attention",
                f"{_FUSED}.va_cross_attention",
            ),
            whole_queries=(f"{_FUSED}.av_cross_attention",),
        ),
        # CFG with the default negative prompt whenever guidance_scale > 1: a second transformer call per step.
        cfg="calls",
        # Given audio latents (sample_audio, on by default), a call returns (video, audio) predictions.
        cfg_output_like=predictions_like,
    ),
    frames_arg="num_frames",
    fps=24,
    heads=32,
    tiny_heads=4,
    tiny=build_tiny,
    tiny_defaults=GenerationDefaults(steps=4, height=64, width=64, frames=5, guidance_scale=5.0),
    # Text to video, or a picture to start from (`--image`, optional): its latents join the video
    # tokens as one more frame (cut with them), as the first frame's condition. `--arg frame_rate=N`
    # makes the sound for N frames a second, and the MP4 plays at N.
    variants=(Variant("Kandinsky6TI2VAPipeline", image="image", optional=("image",), fps=_frame_rate),),
    # The waveform (batch, samples), mono, at the audio VAE's rate (44.1 kHz on the real models).
    audio=AudioOutput(field="audio", sample_rate="audio_sample_rate"),
)
