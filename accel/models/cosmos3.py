"""Cosmos 3 family: NVIDIA's omnimodal world model (Cosmos3OmniPipeline), a Mixture-of-Transformers
over one packed sequence with no batch dim: the chat-templated prompt's token ids first (the
"understanding" stream, embedded by the transformer itself: there is no separate text encoder), then
the video's latent patches and, with `enable_sound`, the sound latents (the "generation" stream).
Every decoder layer has two sets of weights: the text runs causal self-attention through one, the
video and sound run through the other and attend to the text's keys and values and their own.

The call makes text-to-video, text-to-image (`num_frames=1`: a one-frame video) and image-to-video
(`image=`, the first latent frame kept clean), and, where the checkpoint ships a `sound_tokenizer`
and the transformer was trained with `sound_gen`, a sound track with the video (`enable_sound=True`,
`--arg enable_sound=true`; the tiny model's calls turn it on), which accel muxes into the MP4. Its
result holds one sample (`video` as (frames, H, W, 3), `sound` as (channels, samples)), whatever the
prompt list. Classifier-free guidance is two transformer calls per step whose prompts differ in
length; the outputs are the same size (the vision and sound predictions).

Context parallelism has a hand plan (diffusers keeps Cosmos 3's outside the model, behind its
`_cp_shard_fn` seam): the transformer takes 2-D (tokens, width) tensors with no batch dim and runs two
attention calls per layer, causal over the text, then from the generation stream (video and sound) to
the text's keys and its own. The generation stream is cut along its tokens where the layers start,
with its rotary pair; the text stays whole on every rank, so its causal call runs locally and the
generation stream's call attends to the text's keys locally and to its own cut keys across the ranks,
merged by log-sum-exp (grouped key/value heads are repeated for the exchange). CFG parallelism (one
branch per rank), the cache, quantization, compile and tensor parallelism (a hand plan: diffusers has
no `_tp_plan` for it) apply as well.

The safety checker needs `cosmos_guardrail`; accel loads the pipeline without it where that package
is missing (`load_kwargs`). `build_tiny` makes a seeded, random-weight Cosmos3-shaped pipeline
offline for tests, with a decoder-only sound tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from accel.models.base import Acceleration, AudioOutput, BlockList, Family, GenerationDefaults, ResultField
from accel.models.variant_format import Variant
from accel.parallel.plan_format import ParallelPlan, SequenceSplit, TensorPlan, split_layers

if TYPE_CHECKING:
    from diffusers import Cosmos3OmniPipeline

_CLASS = "Cosmos3OmniTransformer"
# Seeds apart from every other tiny family's (builder seed x 8 + 0..7; Wan variants 1000+, SkyReels-V2 2000+, ChronoEdit
# and Helios 3000+).
_SEEDS = 5000
# The pipeline's video system prompt and the templates it appends to the prompt, so the tiny tokenizer
# spends one token per word of them (the prompt's own words go one per byte).
_TEMPLATE = (
    "<|im_start|>system\nYou are a helpful assistant who will generate videos images from a give prompt.<|im_end|>\n"
    "<|im_start|>user\n{} The video is not seconds long and is of FPS. This video image is not of "
    "resolution.<|im_end|>\n"
    "<|im_start|>assistant\n"
)
# The generation stream (video and sound tokens) is cut where the layers start, with its rotary
# (cos, sin) pair; the text stays whole on every rank, where its causal self-attention runs locally.
# The generation stream attends to the text's keys (every rank holds them whole: attended locally,
# merged by log-sum-exp) and to its own, cut. Gathered before the final norm of the generation stream.
PARALLEL_PLAN = ParallelPlan(
    splits=(
        SequenceSplit("gen_seq", "generation", dim=0, module="layers.0"),
        SequenceSplit("rotary_emb", "generation", dim=0, module="layers.*", element=2),
        SequenceSplit("rotary_emb", "generation", dim=0, module="layers.*", element=3),
    ),
    attention_keys=("text", "generation"),
    output_stream="generation",
    output_dim=0,
    output_module="norm_moe_gen",
    output_before=True,
    causal_local=True,
)
_Z_DIM = 16  # Wan 2.1's tiny VAE (the real model uses Wan 2.2's 48-channel one)


def build_tiny(seed: int = 0) -> "Cosmos3OmniPipeline":
    """A tiny Cosmos 3 look-alike: real classes, configs scaled down, random seeded weights.

    Two decoder layers 32 wide with four 16-wide query heads over two key/value heads (grouped, as
    the real 32 over 8); Wan's tiny VAE (8x, 16 channels) and UniPC scheduler; a decoder-only sound
    tokenizer at 8 kHz making 320 samples per latent (25 latents a second, as the real 48 kHz one).
    64x64 and 5 frames give 2 latent frames of 4x4 patches, 32 video tokens, and 6 sound tokens,
    after some 65 prompt tokens.
    """
    from diffusers import Cosmos3OmniPipeline, Cosmos3OmniTransformer
    from diffusers.models.autoencoders.autoencoder_cosmos3_audio import Cosmos3AVAEAudioTokenizer

    from accel.models import wan
    from accel.models.tiny.qwen import qwen3_tokenizer
    from accel.models.tiny.seeding import finish, seeded

    base = _SEEDS + seed * 8
    tokenizer = qwen3_tokenizer(_TEMPLATE)
    with seeded(base):
        transformer = finish(
            Cosmos3OmniTransformer(
                head_dim=16,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                latent_channel=_Z_DIM,
                latent_patch_size=2,
                patch_latent_dim=2 * 2 * _Z_DIM,
                vocab_size=len(tokenizer),
                rope_axes_dim=(4, 2, 2),  # sums to head_dim / 2, as (24, 20, 20) to 64
                sound_gen=True,
                sound_dim=8,
            )
        )
    with seeded(base + 1):
        sound_tokenizer = finish(
            Cosmos3AVAEAudioTokenizer(
                sampling_rate=8000,
                vocoder_input_dim=8,
                dec_dim=4,
                dec_c_mults=(1, 2, 2),
                dec_strides=(4, 8, 10),
                dec_out_channels=2,
                encoder_enabled=False,
            )
        )
    return Cosmos3OmniPipeline(
        transformer=transformer,
        text_tokenizer=tokenizer,
        vae=wan.tiny_vae(base + 2),
        scheduler=wan.tiny_scheduler(),
        sound_tokenizer=sound_tokenizer,
        safety_checker=None,
        enable_safety_checker=False,
    )


def load_kwargs() -> dict[str, Any]:
    """What a Cosmos 3 checkpoint loads with: without `cosmos_guardrail` installed, no safety checker
    (the pipeline would otherwise build one, which raises ImportError); with it, the checkpoint's own."""
    from diffusers.utils import is_cosmos_guardrail_available

    return {} if is_cosmos_guardrail_available() else {"safety_checker": None, "enable_safety_checker": False}


def predictions_like(call: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    """What a transformer call returns (`return_dict=False`), each prediction as the tokens it predicts:
    (vision, sound, action), each a list of one sample's tensors shaped as its tokens, or None where
    the call carries none of that modality."""
    return tuple(call.get(f"{modality}_tokens") for modality in ("vision", "sound", "action"))


# Both streams' attention and MLP, each with its own weights: Q, K, V and the MLP's gate and up
# projections column-wise, the output projections row-wise. The processor reshapes by the module's
# head counts (key/value heads fewer than query heads, grouped).
TENSOR_PLAN = TensorPlan(
    layers={
        **split_layers(
            "layers.*.self_attn",
            (("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"), ("to_out", "to_add_out")),
        ),
        **split_layers("layers.*.mlp", (("gate_proj", "up_proj"), ("down_proj",))),
        **split_layers("layers.*.mlp_moe_gen", (("gate_proj", "up_proj"), ("down_proj",))),
    },
    per_rank=("num_attention_heads", "num_key_value_heads"),
)


FAMILY = Family(
    name="cosmos3",
    title="Cosmos 3",
    pipeline_class="Cosmos3OmniPipeline",
    transformer_class=_CLASS,
    vae="AutoencoderKLWan",
    repo="nvidia/Cosmos3-Nano",
    output="video",
    dtype="bfloat16",
    # The call's defaults: 35 steps, guidance 6, 720x1280, 189 frames (7.9 s at 24 fps).
    defaults=GenerationDefaults(
        steps=35,
        height=720,
        width=1280,
        frames=189,
        guidance_scale=6.0,
        prompt="a red fox trotting through the snow, photograph",
    ),
    # Wan 2.2's 16x VAE (the pipeline refuses other sizes; the transformer pads latents to whole 2x2 patches)
    size_step=16,
    frame_step=4,
    acceleration=Acceleration(
        # One list of decoder layers, each taking and returning both streams.
        blocks=(BlockList("layers", returns=("und_seq", "gen_seq")),),
        primary_stream="gen_seq",
        tensor=TENSOR_PLAN,
        parallel=PARALLEL_PLAN,
        cfg="calls",  # a conditional and an unconditional transformer call per step
        # Each call returns its vision, sound and action predictions; the two calls' sequences differ
        # in length (their prompts'), their predictions do not.
        cfg_output_like=predictions_like,
    ),
    frames_arg="num_frames",
    fps=24,
    heads=32,
    tiny_heads=4,
    tiny=build_tiny,
    tiny_defaults=GenerationDefaults(steps=4, height=64, width=64, frames=5, guidance_scale=5.0),
    # The call holds one sample: `video` (frames, H, W, 3) and `sound` (channels, samples).
    result=ResultField("video", batched=False),
    load_kwargs=load_kwargs,
    audio=AudioOutput(field="sound", sample_rate="sound_tokenizer.config.sampling_rate", batched=False),
    # Image-to-video: the picture anchors the first latent frame (optional: text-to-video without).
    variants=(
        Variant("Cosmos3OmniPipeline", image="image", optional=("image",), tiny_fixed=(("enable_sound", True),)),
    ),
)
