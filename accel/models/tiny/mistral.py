"""Tiny Mistral Small 3.1: its tokenizer class and chat format, and a narrow Mistral 3 with a Pixtral tower."""

from __future__ import annotations

from typing import Any

from transformers import LlamaTokenizerFast

from accel.models.tiny.bpe import byte_fallback_bpe
from accel.models.tiny.llama import LLAMA_MAX_LENGTH
from accel.models.tiny.seeding import finish, seeded

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
    vocab, merges = byte_fallback_bpe(MISTRAL_SPECIAL_TOKENS, template)
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
