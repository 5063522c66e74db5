"""Tiny Qwen2 / Qwen3 family: byte-level BPE tokenizers, Qwen2.5-VL, Qwen3-VL and Qwen3 encoders,
and the Qwen-VL processors (pictures and text) with their chat templates."""

from __future__ import annotations

import re
from typing import Any

from tokenizers import pre_tokenizers
from transformers import (
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Tokenizer,
    Qwen2VLProcessor,
    Qwen3VLProcessor,
)

from accel.models.tiny.bpe import merges_building, run_merges
from accel.models.tiny.seeding import finish, seeded

try:  # transformers 5: the PIL backend by name, so preprocessing does not hinge on torchvision
    from transformers import Qwen2VLImageProcessorPil as Qwen2VLImageProcessor
except ImportError:  # transformers 4: this is the PIL/NumPy one
    from transformers import Qwen2VLImageProcessor

# Text width of the tiny Qwen encoders; the tiny transformers take theirs from the encoder configs.
QWEN_HIDDEN = 32

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
    merges = run_merges(pieces, vocab) if runs else []
    merges += merges_building(pieces, vocab)
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
