"""Offline builders for tiny, seeded, random-weight text stacks shared by the tiny pipelines.

Tests and demos need real pipeline classes without a model hub, so tokenizers are built from
in-memory vocabularies and text encoders from small configs. Weights are random but seeded,
and the caller's global RNG state is left untouched.
"""

from __future__ import annotations

import string
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch
from tokenizers import pre_tokenizers
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
    UMT5Config,
    UMT5EncoderModel,
)

ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)

# Text widths of the tiny encoders; the tiny transformers take theirs from the encoder configs.
CLIP_HIDDEN = 32
T5_HIDDEN = 32

# CLIP-L's window. The merge-free tokenizer spends one token per character, so a shorter
# window would truncate (and warn about) ordinary prompts; FLUX uses only the pooled vector.
CLIP_MAX_LENGTH = 77
# Matches the real T5 tokenizers; the pipelines pad to their own `max_sequence_length` anyway.
T5_MAX_LENGTH = 512


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


def clip_text_model(tokenizer: CLIPTokenizer, seed: int, hidden: int = CLIP_HIDDEN) -> CLIPTextModel:
    """Two-layer CLIP text tower whose pooled output (at the first EOS) feeds FLUX's pooled projection."""
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
        return finish(CLIPTextModel(config))


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
