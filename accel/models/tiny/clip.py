"""Tiny CLIP: a merge-free byte-level tokenizer, text towers, a vision tower and its preprocessing."""

from __future__ import annotations

from tokenizers import pre_tokenizers
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    CLIPVisionConfig,
    CLIPVisionModel,
)

from accel.models.tiny.seeding import finish, seeded

try:  # transformers 5: the PIL backend by name, so preprocessing does not hinge on torchvision
    from transformers import CLIPImageProcessorPil as CLIPImageProcessor
except ImportError:  # transformers 4: this is the PIL/NumPy one
    from transformers import CLIPImageProcessor

# Text width of the tiny CLIP towers; the tiny transformers take theirs from the encoder configs.
CLIP_HIDDEN = 32

# CLIP-L's window. The merge-free tokenizer spends one token per character, so a shorter
# window would truncate (and warn about) ordinary prompts; FLUX uses only the pooled vector.
CLIP_MAX_LENGTH = 77
# Side of the tiny CLIP vision tower's square input (CLIP ViT-H/14 takes 224): 8x8 patches give
# 16 patch tokens plus the class token.
CLIP_IMAGE_SIZE = 32
CLIP_PATCH_SIZE = 8


def clip_tokenizer(model_max_length: int = CLIP_MAX_LENGTH) -> CLIPTokenizer:
    """Byte-level CLIP BPE tokenizer with no merges: every byte is a token, so any text encodes."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    # With no merges, BPE ends each word on a "<char></w>" token, so those need ids too.
    vocab.update({f"{ch}</w>": len(alphabet) + i for i, ch in enumerate(alphabet)})
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=model_max_length)


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
