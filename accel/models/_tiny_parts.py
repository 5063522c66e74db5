"""Offline builders for tiny, seeded, random-weight text stacks shared by the tiny pipelines.

Tests and demos need real pipeline classes without a model hub, so tokenizers are built from
in-memory vocabularies and text encoders from small configs. Weights are random but seeded,
and the caller's global RNG state is left untouched.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from tokenizers import pre_tokenizers
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    CLIPVisionConfig,
    CLIPVisionModel,
    LlamaConfig,
    LlamaModel,
    LlamaTokenizerFast,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Tokenizer,
    Qwen2VLProcessor,
    Qwen3VLProcessor,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
    UMT5Config,
    UMT5EncoderModel,
)

try:  # transformers 5: the PIL backends by name, so preprocessing does not hinge on torchvision
    from transformers import CLIPImageProcessorPil as CLIPImageProcessor
    from transformers import Qwen2VLImageProcessorPil as Qwen2VLImageProcessor
except ImportError:  # transformers 4: these are the PIL/NumPy ones
    from transformers import CLIPImageProcessor, Qwen2VLImageProcessor

ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)

# Text widths of the tiny encoders; the tiny transformers take theirs from the encoder configs.
CLIP_HIDDEN = 32
T5_HIDDEN = 32
LLAMA_HIDDEN = 32
QWEN_HIDDEN = 32

# CLIP-L's window. The merge-free tokenizer spends one token per character, so a shorter
# window would truncate (and warn about) ordinary prompts; FLUX uses only the pooled vector.
CLIP_MAX_LENGTH = 77
# Side of the tiny CLIP vision tower's square input (CLIP ViT-H/14 takes 224): 8x8 patches give
# 16 patch tokens plus the class token.
CLIP_IMAGE_SIZE = 32
CLIP_PATCH_SIZE = 8
# Matches the real T5 tokenizers; the pipelines pad to their own `max_sequence_length` anyway.
T5_MAX_LENGTH = 512
# Room for a prompt template's prefix plus the pipelines' 256 prompt tokens.
LLAMA_MAX_LENGTH = 1024

# Qwen2's chat and vision special tokens (chat templates and Qwen2-VL processors use them).
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
_QWEN_SPECIAL = re.compile("|".join(re.escape(token) for token in QWEN_SPECIAL_TOKENS))

# Llama 3's special tokens that chat-style prompt templates use; "<pad>" pads to the right.
LLAMA_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)
# Llama 3's pre-tokenizer split, in ASCII: words with an optional leading space, runs of up to
# three digits, punctuation runs with an optional leading space, whitespace runs.
_LLAMA_WORDS = re.compile(r" ?[A-Za-z]+|\d{1,3}| ?[^\sA-Za-z\d]+|\s+")


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed torch's CPU RNG and float32 init for module builds, restoring the caller's state after.

    Initialising in float32 whatever the caller's default dtype keeps weights bit-identical per seed.
    """
    previous_dtype = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.set_default_dtype(torch.float32)
        try:
            yield
        finally:
            torch.set_default_dtype(previous_dtype)


def finish(module: ModuleT) -> ModuleT:
    """Put a freshly built module in float32 inference mode (T5 dropout would make runs differ)."""
    # `.float()` rather than `.to(dtype)`: diffusers warns on every dtype `.to()` call.
    return module.float().eval()


def flux1_vae() -> Any:
    """FLUX.1's VAE shape, narrowed: four levels (8x downsampling), 16 latent channels, no quant
    convs. FLUX.1 and Z-Image decode with it. Build it inside `seeded`."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 16, 16, 16),
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=4,
        sample_size=64,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=True,
    )


def hunyuan_video_vae() -> Any:
    """HunyuanVideo's 3D VAE shape, narrowed: 8x spatial and 4x temporal compression (4k+1 frames ->
    k+1 latents), 16 latent channels. HunyuanVideo and Kandinsky 5 decode with it. Build it inside `seeded`."""
    from diffusers import AutoencoderKLHunyuanVideo

    return AutoencoderKLHunyuanVideo(
        in_channels=3,
        out_channels=3,
        latent_channels=16,
        down_block_types=("HunyuanVideoDownBlock3D",) * 4,
        up_block_types=("HunyuanVideoUpBlock3D",) * 4,
        block_out_channels=(8, 16, 16, 16),
        layers_per_block=1,
        norm_num_groups=4,
        scaling_factor=0.476986,
        spatial_compression_ratio=8,
        temporal_compression_ratio=4,
        mid_block_add_attention=True,
    )


def clip_tokenizer(model_max_length: int = CLIP_MAX_LENGTH) -> CLIPTokenizer:
    """Byte-level CLIP BPE tokenizer with no merges: every byte is a token, so any text encodes."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    # With no merges, BPE ends each word on a "<char></w>" token, so those need ids too.
    vocab.update({f"{ch}</w>": len(alphabet) + i for i, ch in enumerate(alphabet)})
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=model_max_length)


def t5_tokenizer(model_max_length: int = T5_MAX_LENGTH) -> T5TokenizerFast:
    """Unigram T5 tokenizer over ASCII pieces; ids 0/1/2 are <pad>/</s>/<unk> as in real T5."""
    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    # Word-initial pieces score better than "▁" + char, so words start with a "▁x" piece.
    pieces += [(f"▁{ch}", -3.0) for ch in string.ascii_letters + string.digits]
    pieces += [(ch, -4.0) for ch in string.ascii_letters + string.digits + string.punctuation]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


def clip_text_model(
    tokenizer: CLIPTokenizer, seed: int, hidden: int = CLIP_HIDDEN, projection: bool = False
) -> CLIPTextModel:
    """Two-layer CLIP text tower whose pooled output (at the first EOS) feeds FLUX's pooled projection;
    with `projection`, CLIPTextModelWithProjection, SD3's two towers (their projected pooled output)."""
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        projection_dim=hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=tokenizer.model_max_length,
        # A real EOS id (not the legacy 2) makes the pooler pick the first EOS, as in CLIP-L.
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with seeded(seed):
        return finish((CLIPTextModelWithProjection if projection else CLIPTextModel)(config))


def clip_image_processor(size: int = CLIP_IMAGE_SIZE) -> CLIPImageProcessor:
    """CLIP's preprocessing (bicubic shortest-edge resize, center crop, CLIP mean/std) at `size` pixels."""
    return CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})


def clip_vision_model(seed: int, hidden: int = CLIP_HIDDEN, image_size: int = CLIP_IMAGE_SIZE) -> CLIPVisionModel:
    """Two-layer CLIP vision tower, the stand-in for Wan I2V's CLIP ViT-H/14 image encoder.

    Two layers, so that the penultimate hidden state (what Wan I2V feeds its DiT) is a layer's
    output rather than the bare patch embeddings.
    """
    config = CLIPVisionConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        projection_dim=hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=image_size,
        patch_size=CLIP_PATCH_SIZE,
        hidden_act="gelu",  # as in ViT-H/14 (CLIP-L's quick_gelu is the config default)
    )
    with seeded(seed):
        return finish(CLIPVisionModel(config))


def _t5_kwargs(tokenizer: T5TokenizerFast, hidden: int) -> dict[str, object]:
    """Shared T5 v1.1-style (gated-GELU) settings for the T5 and UMT5 encoders."""
    return dict(
        vocab_size=len(tokenizer),
        d_model=hidden,
        d_kv=hidden // 4,
        d_ff=hidden * 2,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",
        dropout_rate=0.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )


def t5_encoder(tokenizer: T5TokenizerFast, seed: int, hidden: int = T5_HIDDEN) -> T5EncoderModel:
    """Two-layer T5 v1.1-style encoder, the stand-in for FLUX's T5-XXL."""
    with seeded(seed):
        return finish(T5EncoderModel(T5Config(**_t5_kwargs(tokenizer, hidden))))


def umt5_encoder(tokenizer: T5TokenizerFast, seed: int, hidden: int = T5_HIDDEN) -> UMT5EncoderModel:
    """Two-layer UMT5 encoder (per-layer position bias), the stand-in for Wan's UMT5-XXL."""
    with seeded(seed):
        return finish(UMT5EncoderModel(UMT5Config(**_t5_kwargs(tokenizer, hidden))))


def _byte_fallback_bpe(specials: tuple[str, ...], template: str) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Vocab and merges of a byte-fallback BPE: `specials` first, one token per byte and ASCII
    character, and merges that build each word of `template` (split as Llama 3 splits it) into one token."""
    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({f"<0x{byte:02X}>": len(vocab) + byte for byte in range(256)})
    for ch in "▁" + string.ascii_letters + string.digits + string.punctuation + "\n\t":
        vocab.setdefault(ch, len(vocab))
    special = re.compile("|".join(re.escape(token) for token in specials))
    # The Metaspace pre-tokenizer's space is "▁".
    words = [word.replace(" ", "▁") for segment in special.split(template) for word in _LLAMA_WORDS.findall(segment)]
    return vocab, _merges_building(words, vocab)


def _merges_building(pieces: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges (each result added to `vocab`) that build every piece, left to right, into one token."""
    merges: list[tuple[str, str]] = []
    for piece in pieces:
        for end in range(2, len(piece) + 1):
            if piece[:end] not in vocab:
                merges.append((piece[: end - 1], piece[end - 1]))
                vocab[piece[:end]] = len(vocab)
    return merges


def _run_merges(pieces: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges (each result added to `vocab`) that build every run of one repeated character
    among `pieces` into one token: doublings first (pairs, then pairs of pairs), then the
    remainder joined from the largest part down, which BPE's merge-by-rank then follows."""
    merges: list[tuple[str, str]] = []

    def merge(left: str, right: str) -> None:
        if left + right not in vocab:
            merges.append((left, right))
            vocab[left + right] = len(vocab)

    for piece in sorted({p for p in pieces if len(p) > 1 and len(set(p)) == 1}, key=len):
        size = 1
        while 2 * size <= len(piece):
            merge(piece[0] * size, piece[0] * size)
            size *= 2
        built = size
        for part in (1 << bit for bit in reversed(range(size.bit_length()))):
            if built + part <= len(piece):
                merge(piece[0] * built, piece[0] * part)
                built += part
    return merges


def llama_tokenizer(
    template: str = "", model_max_length: int = LLAMA_MAX_LENGTH, extra_specials: tuple[str, ...] = ()
) -> LlamaTokenizerFast:
    """Llama-3-style tokenizer: byte-fallback BPE where each word of `template` is one token.

    Any other text goes one token per ASCII character (other bytes via `<0xNN>` tokens), so any
    text encodes. Merges build exactly the words, numbers and punctuation runs of `template`
    (split as Llama 3 splits them), so a prompt template's prefix spends as many tokens as with
    the real tokenizer and a pipeline's fixed `crop_start` cuts it off exactly. Pads to the right:
    pipelines crop the template from the start of the sequence. `extra_specials` are further
    single tokens (LLaVA's "<image>" placeholder).
    """
    vocab, merges = _byte_fallback_bpe(("<unk>", "<pad>", *LLAMA_SPECIAL_TOKENS, *extra_specials), template)
    return LlamaTokenizerFast(
        vocab=vocab,
        merges=merges,
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        pad_token="<pad>",
        unk_token="<unk>",
        add_bos_token=True,
        add_eos_token=False,
        extra_special_tokens=[*LLAMA_SPECIAL_TOKENS[2:], *extra_specials],
        padding_side="right",
        model_max_length=model_max_length,
        legacy=False,
    )


def llama_model(tokenizer: LlamaTokenizerFast, seed: int, hidden: int = LLAMA_HIDDEN) -> LlamaModel:
    """Three-layer Llama decoder (grouped-query attention), the stand-in for a Llama-3-8B text encoder.

    Three layers, so that the third-to-last hidden state (HunyuanVideo's choice) is a layer's
    output rather than the bare token embeddings.
    """
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=tokenizer.model_max_length,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with seeded(seed):
        return finish(LlamaModel(config))


# LLaVA-1.5's CLIP ViT-L/14 at 336 px: 24x24 = 576 patch tokens, the count image-text prompt
# templates (HunyuanVideo I2V's) reserve for the picture.
LLAVA_IMAGE_SIZE = 336
LLAVA_PATCH_SIZE = 14


def llava_model(tokenizer: LlamaTokenizerFast, seed: int, hidden: int = LLAMA_HIDDEN) -> Any:
    """LLaVA (LlavaForConditionalGeneration): a two-layer, 16-wide CLIP vision tower at LLaVA-1.5's
    336 px / 14 px patches (576 picture tokens, as the real one gives) projected into a three-layer
    Llama; the stand-in for llava-llama-3-8b. The tokenizer needs an "<image>" token."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    pad = tokenizer.pad_token_id
    config = LlavaConfig(
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=LLAVA_IMAGE_SIZE,
            patch_size=LLAVA_PATCH_SIZE,
            projection_dim=16,
        ),
        text_config=dict(
            model_type="llama",
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=hidden * 2,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=pad,
        ),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        image_seq_length=(LLAVA_IMAGE_SIZE // LLAVA_PATCH_SIZE) ** 2,
        pad_token_id=pad,  # image-text pipelines read it here to pad the expanded ids
    )
    with seeded(seed):
        return finish(LlavaForConditionalGeneration(config))


def qwen2_tokenizer(template: str = "", runs: bool = False, prefix_tokens: int | None = None) -> Qwen2Tokenizer:
    """Qwen2-style byte-level BPE whose merges build exactly the words of `template`, one token each.

    Any other text goes one token per byte, so any text encodes. The prefix of a pipeline's prompt
    template then spends as many tokens as with the real tokenizer (Qwen-Image's 34), so the
    pipeline's fixed start index crops it off exactly. Vision tokens are there for Qwen2-VL processors.
    With `runs`, a run of one repeated character (HunyuanVideo 1.5's indented system prompt) is
    built by doubling, so it too ends as one token, as with the real vocabulary; left-to-right
    merges would stop at pairs. Where the real count differs from the words', `prefix_tokens`
    names it: the words are then split as the tokenizer itself splits them (a sentence end with its
    line break is one word), and the longest words that occur once stay two tokens, as real BPE
    splits rare long words (Kandinsky 5: 128 tokens for 125 words), until the prefix (the template
    before "{}") encodes to that many.
    """
    split = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pieces = [piece for segment in _QWEN_SPECIAL.split(template) for piece, _ in split.pre_tokenize_str(segment)]
    if prefix_tokens is None:
        return _qwen2_tokenizer_of(pieces, runs)
    own = _qwen2_tokenizer_of([]).backend_tokenizer.pre_tokenizer

    def words_of(text: str) -> list[str]:
        return [piece for segment in _QWEN_SPECIAL.split(text) for piece, _ in own.pre_tokenize_str(segment)]

    words, prefix = words_of(template), template.split("{}")[0]
    tokenizer = _qwen2_tokenizer_of(words, runs)
    missing = prefix_tokens - len(tokenizer(prefix).input_ids)
    rare = sorted(
        {word for word in words_of(prefix) if words.count(word) == 1 and len(word) > 2},
        key=lambda word: (-len(word), word),
    )
    if 0 <= missing <= len(rare):
        split_in_two = set(rare[:missing])
        tokenizer = _qwen2_tokenizer_of([word[:-1] if word in split_in_two else word for word in words], runs)
        if len(tokenizer(prefix).input_ids) == prefix_tokens:
            return tokenizer
    raise RuntimeError(f"tiny Qwen2 tokenizer: no merges make the template's prefix {prefix_tokens} tokens")


def _qwen2_tokenizer_of(pieces: list[str], runs: bool = False) -> Qwen2Tokenizer:
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = _run_merges(pieces, vocab) if runs else []
    merges += _merges_building(pieces, vocab)
    for token in QWEN_SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=list(QWEN_SPECIAL_TOKENS[1:]),
    )


def qwen25_vl_model(
    tokenizer: Qwen2Tokenizer, seed: int, hidden: int = QWEN_HIDDEN, layers: int = 2
) -> Qwen2_5_VLForConditionalGeneration:
    """Qwen2.5-VL of `layers` layers with a one-block vision tower: the stand-in for Qwen-Image's 7B
    text encoder (two layers) and HunyuanImage 2.1's (three: it reads the third-to-last hidden state).

    The vision tower matters for the edit pipelines, which show the encoder the input picture."""
    from transformers import Qwen2_5_VLConfig

    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=hidden * 2,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [1, 1, 2]},
            bos_token_id=ids("<|endoftext|>"),
            eos_token_id=ids("<|im_end|>"),
            pad_token_id=ids("<|endoftext|>"),
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=hidden,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[0],
        ),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        eos_token_id=ids("<|im_end|>"),
        pad_token_id=ids("<|endoftext|>"),
    )
    with seeded(seed):
        return finish(Qwen2_5_VLForConditionalGeneration(config))


def qwen2_vl_image_processor(max_pixels: int = 56 * 56) -> Qwen2VLImageProcessor:
    """Qwen2-VL's preprocessing, capped at `max_pixels` (4 patches of 28x28 after merging by default),
    so the tiny vision tower sees the edit pipelines' input picture in a handful of tokens."""
    return Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=max_pixels)


class _NoVideoProcessor:
    """A Qwen-VL processor without a video processor, which transformers can only build where
    torchvision is installed; the image pipelines pass no video. Saving writes its picture and
    text parts alone (diffusers then names this class, which it loads only from transformers)."""

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)  # type: ignore[misc]

    @classmethod
    def get_attributes(cls) -> list[str]:  # what is saved and loaded: no video processor
        return [name for name in super().get_attributes() if name != "video_processor"]  # type: ignore[misc]


class Qwen2VLPictureProcessor(_NoVideoProcessor, Qwen2VLProcessor):
    """Qwen2-VL's processor, pictures and text only (the Qwen-Image edit pipelines')."""


class Qwen3VLPictureProcessor(_NoVideoProcessor, Qwen3VLProcessor):
    """Qwen3-VL's processor, pictures and text only (Qwen-Image 2.1's)."""


def qwen2_vl_processor(tokenizer: Qwen2Tokenizer) -> Qwen2VLPictureProcessor:
    """A Qwen2-VL processor (picture and text to tokens) without a video processor."""
    return Qwen2VLPictureProcessor(
        image_processor=qwen2_vl_image_processor(), tokenizer=tokenizer, video_processor=None
    )


def qwen3_vl_model(tokenizer: Qwen2Tokenizer, seed: int, hidden: int = QWEN_HIDDEN) -> Any:
    """Two-layer Qwen3-VL (interleaved multimodal rotary, one-block vision tower of 16 px patches with
    a deepstack tap), the stand-in for Qwen-Image 2.1's text encoder; the vision tower is there for
    the condition pictures the pipeline shows the encoder."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=hidden * 2,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=4096,
            pad_token_id=ids("<|endoftext|>"),
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=hidden,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            num_position_embeddings=16,
            deepstack_visual_indexes=[0],
        ),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    with seeded(seed):
        return finish(Qwen3VLForConditionalGeneration(config))


# Qwen-VL's chat format for turns whose content is a string or a list of text and image blocks (an
# image block is its vision placeholder), with the generation prompt.
QWEN_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ "
    "message['content'] }}"
    "{% else %}{% for block in message['content'] %}{% if block['type'] == 'text' %}{{ block['text'] }}"
    "{% else %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen3_vl_processor(tokenizer: Qwen2Tokenizer) -> Qwen3VLPictureProcessor:
    """A Qwen3-VL processor (picture and text to tokens) with Qwen3-VL's 16 px patches merged 2x2,
    capped at 64x64 px (4 picture tokens), and QWEN_VL_CHAT_TEMPLATE; no video processor."""
    image_processor = Qwen2VLImageProcessor(
        patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32, max_pixels=64 * 64
    )
    return Qwen3VLPictureProcessor(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=None, chat_template=QWEN_VL_CHAT_TEMPLATE
    )


# Qwen3's chat format for plain text turns, with its generation prompt: an empty think block when
# the caller turns thinking off (`enable_thinking=False`), as the real template writes it.
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def qwen3_tokenizer(template: str = "") -> Qwen2Tokenizer:
    """Qwen3's tokenizer (Qwen2's class) with its chat template: qwen2_tokenizer, whose merges build
    the words of `template` (a pipeline's chat framing), plus QWEN3_CHAT_TEMPLATE."""
    tokenizer = qwen2_tokenizer(template)
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


def qwen3_model(tokenizer: Qwen2Tokenizer, seed: int, layers: int, hidden: int = 8) -> Any:
    """A narrow Qwen3 decoder, the stand-in for FLUX.2 [klein]'s and Z-Image's Qwen3 text encoders.
    `layers`: the pipelines stack fixed hidden-state indices (Klein: 9, 18 and 27), so depth is real."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    ids = tokenizer.convert_tokens_to_ids
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=4096,
        bos_token_id=ids("<|endoftext|>"),
        eos_token_id=ids("<|im_end|>"),
        pad_token_id=ids("<|endoftext|>"),
    )
    with seeded(seed):
        return finish(Qwen3ForCausalLM(config))


# Mistral Small 3.1's (Tekken) control tokens that its chat format and Pixtral image inputs use.
MISTRAL_SPECIAL_TOKENS = (
    "<unk>",
    "<s>",
    "</s>",
    "<pad>",
    "[INST]",
    "[/INST]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
)
# Mistral Small 3.1's chat format: the system turn in [SYSTEM_PROMPT], user turns in [INST]; text
# blocks are written out, an image block as its [IMG] placeholder.
_MISTRAL_CHAT = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set text = namespace(value='') %}"
    "{% if message['content'] is string %}{% set text.value = message['content'] %}{% else %}"
    "{% for block in message['content'] %}{% if block['type'] == 'text' %}{% set text.value = text.value + "
    "block['text'] %}"
    "{% else %}{% set text.value = text.value + '[IMG]' %}{% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ text.value }}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{{ text.value }}[/INST]"
    "{% else %}{{ text.value }}{{ eos_token }}{% endif %}{% endfor %}"
)


def mistral_tokenizer(template: str = "", model_max_length: int = LLAMA_MAX_LENGTH) -> LlamaTokenizerFast:
    """Mistral Small 3.1's tokenizer class (LlamaTokenizerFast) and chat format, as a byte-fallback BPE
    where each word of `template` (a pipeline's system message) is one token, any other text one per
    character. It stands in for FLUX.2-dev's PixtralProcessor on the text path the pipeline uses:
    that processor's image half needs torchvision, which accel does not depend on."""
    vocab, merges = _byte_fallback_bpe(MISTRAL_SPECIAL_TOKENS, template)
    tokenizer = LlamaTokenizerFast(
        vocab=vocab,
        merges=merges,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        add_bos_token=True,
        add_eos_token=False,
        extra_special_tokens=list(MISTRAL_SPECIAL_TOKENS[4:]),
        padding_side="right",
        model_max_length=model_max_length,
        legacy=False,
    )
    tokenizer.chat_template = _MISTRAL_CHAT
    return tokenizer


def mistral3_model(tokenizer: LlamaTokenizerFast, seed: int, layers: int, hidden: int = 8) -> Any:
    """A narrow Mistral 3 (Mistral Small 3.1's class, a one-layer Pixtral vision tower beside the
    decoder), the stand-in for FLUX.2-dev's 24B text encoder. `layers`: the pipeline stacks fixed
    hidden-state indices (10, 20 and 30), so depth is real."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    config = Mistral3Config(
        text_config=dict(
            model_type="mistral",
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=hidden * 2,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=4096,
            sliding_window=None,
            bos_token_id=ids("<s>"),
            eos_token_id=ids("</s>"),
            pad_token_id=ids("<pad>"),
        ),
        vision_config=dict(
            model_type="pixtral",
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            head_dim=8,
            patch_size=14,
            image_size=56,
        ),
        image_token_index=ids("[IMG]"),
    )
    with seeded(seed):
        return finish(Mistral3ForConditionalGeneration(config))


# Gemma's fixed special tokens (ids 0-4 as in the real vocabulary), then Gemma 3's image markers.
GEMMA_SPECIAL_TOKENS = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<mask>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
)


def gemma3_tokenizer(model_max_length: int = LLAMA_MAX_LENGTH) -> Any:
    """Gemma's tokenizer class as a byte-fallback BPE with no merges (one token per character, any
    text encodes), padding on the left as the Gemma chat-style prompts of LTX-2 expect."""
    from transformers import GemmaTokenizer

    vocab, merges = _byte_fallback_bpe(GEMMA_SPECIAL_TOKENS, "")
    return GemmaTokenizer(
        vocab=vocab,
        merges=merges,
        padding_side="left",
        model_max_length=model_max_length,
        extra_special_tokens=list(GEMMA_SPECIAL_TOKENS[5:]),
    )


def gemma3_model(tokenizer: Any, seed: int, layers: int = 2, hidden: int = 16) -> Any:
    """A narrow Gemma 3 (its multimodal class, with a one-layer SigLIP tower beside the decoder), the
    stand-in for LTX-2's Gemma-3-12B; the pipeline stacks every hidden state, so `layers` + 1 of them."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    config = Gemma3Config(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=hidden * 2,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=tokenizer.model_max_length,
            sliding_window=64,
            pad_token_id=ids("<pad>"),
            eos_token_id=ids("<eos>"),
            bos_token_id=ids("<bos>"),
        ),
        vision_config=dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),
        mm_tokens_per_image=1,
        boi_token_index=ids("<start_of_image>"),
        eoi_token_index=ids("<end_of_image>"),
        image_token_index=ids("<image_soft_token>"),
    )
    with seeded(seed):
        return finish(Gemma3ForConditionalGeneration(config))
