"""Tiny T5 and UMT5: a unigram tokenizer over ASCII pieces and two-layer v1.1-style encoders."""

from __future__ import annotations

import string

from transformers import T5Config, T5EncoderModel, T5TokenizerFast, UMT5Config, UMT5EncoderModel

from accel.models.tiny.seeding import finish, seeded

# Text width of the tiny T5 encoders; the tiny transformers take theirs from the encoder configs.
T5_HIDDEN = 32
# Matches the real T5 tokenizers; the pipelines pad to their own `max_sequence_length` anyway.
T5_MAX_LENGTH = 512


def t5_tokenizer(model_max_length: int = T5_MAX_LENGTH) -> T5TokenizerFast:
    """Unigram T5 tokenizer over ASCII pieces; ids 0/1/2 are <pad>/</s>/<unk> as in real T5."""
    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    # Word-initial pieces score better than "▁" + char, so words start with a "▁x" piece.
    pieces += [(f"▁{ch}", -3.0) for ch in string.ascii_letters + string.digits]
    pieces += [(ch, -4.0) for ch in string.ascii_letters + string.digits + string.punctuation]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


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
