"""Tiny Gemma 3: a byte-fallback tokenizer and a narrow multimodal Gemma 3 (LTX-2's text encoder)."""

from __future__ import annotations

from typing import Any

from accel.models.tiny.bpe import byte_fallback_bpe
from accel.models.tiny.llama import LLAMA_MAX_LENGTH
from accel.models.tiny.seeding import finish, seeded

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

    vocab, merges = byte_fallback_bpe(GEMMA_SPECIAL_TOKENS, "")
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
