"""Tiny Llama 3 and LLaVA: a byte-fallback BPE tokenizer, a Llama decoder, and LLaVA's vision-language model."""

from __future__ import annotations

from typing import Any

from transformers import LlamaConfig, LlamaModel, LlamaTokenizerFast

from accel.models.tiny.bpe import byte_fallback_bpe
from accel.models.tiny.seeding import finish, seeded

# Text width of the tiny Llama decoders; the tiny transformers take theirs from the encoder configs.
LLAMA_HIDDEN = 32
# Room for a prompt template's prefix plus the pipelines' 256 prompt tokens.
LLAMA_MAX_LENGTH = 1024

# Llama 3's special tokens that chat-style prompt templates use; "<pad>" pads to the right.
LLAMA_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)


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
    vocab, merges = byte_fallback_bpe(("<unk>", "<pad>", *LLAMA_SPECIAL_TOKENS, *extra_specials), template)
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
