"""What one request may ask of `accel serve`, checked on the front before any rank sees it.

A prompt is refused by length before the tokenizer sees it (a 10 MB prompt aborts `tokenizers`),
and a request by its work (pixels × frames × steps × outputs) before it holds a replica for
hours while every other client gets 429. A prompt within the character limit is then counted in
the served pipeline's own tokens (`TokenCounter`), which bounds text that expands past one token
a character (emoji and other bytes a byte-level tokenizer spells out one by one). Sizes past the transformer's
positional range are
refused too: the pipeline would fail on them only after the text encoders ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MEGA = 1_000_000
# Default --max-prompt-tokens: the 20,000 characters every accel run takes (accel.recipe.limits
# prompt_chars). ASCII text has at most one token a character in a subword tokenizer (BPE, unigram,
# WordPiece: each token spells at least one character; SentencePiece may add one for its leading
# space; special tokens are not counted) and in the tiny models' character-level ones, and
# ordinary English about one in four. So no English prompt under the default --max-prompt
# (10,000) is refused, nor an ordinary one up to that cap, while text that expands past one token
# a character (a byte-level BPE spells an emoji in up to 4) is.
MAX_PROMPT_TOKENS = 20_000


@dataclass(frozen=True)
class Limits:
    """The operator's bounds (`accel serve --max-prompt / --max-body / --max-work / --request-timeout`)."""

    max_prompt: int = 10_000  # characters of prompt and of negative_prompt, each
    max_body: int = 1 << 20  # bytes of a request body
    max_work: int = 10_000  # megapixel-steps: width × height × frames × steps × n / 1e6
    max_prompt_tokens: int = MAX_PROMPT_TOKENS  # tokens of prompt and of negative_prompt, each, in every fast tokenizer
    request_timeout_s: float | None = None  # seconds a request may run; then it stops at its next step (None: no limit)


class TokenCounter:
    """Counts a text's tokens in one of the served pipeline's fast tokenizers (`name`: its component).

    It holds its own copy of the Rust tokenizer, without truncation or padding: the pipeline's
    tokenizer sets those on every call from its rank's thread, and a Rust tokenizer changed while
    another thread encodes with it fails ("Already borrowed"). Encoding takes no lock, so requests
    may be counted on several threads at once. Special tokens are not counted.
    """

    def __init__(self, name: str, backend: Any) -> None:
        from tokenizers import Tokenizer

        self.name = name
        self._tokenizer = Tokenizer.from_str(backend.to_str())
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()

    def count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)


def token_counters(pipe: Any) -> tuple[TokenCounter, ...]:
    """A counter for every `tokenizer*` (or `*_tokenizer`: Cosmos 3's `text_tokenizer`) component of
    `pipe` that is a fast (Rust) tokenizer, in name order. A slow (Python) one is skipped: counting with
    it costs as much as the tokenization the limit protects, so only the character limit bounds what it
    sees. A model named so (Cosmos 3's `sound_tokenizer`, an audio VAE) is no tokenizer and is skipped too."""
    components = getattr(pipe, "components", None) or {}
    return tuple(
        TokenCounter(name, component.backend_tokenizer)
        for name, component in sorted(components.items())
        if (name.startswith("tokenizer") or name.endswith("_tokenizer"))
        and getattr(component, "is_fast", False)
        and getattr(component, "backend_tokenizer", None) is not None
    )


def prompt_problem(field: str, text: str | None, limits: Limits) -> str | None:
    """Why `text` is too long for `field` (None: it is not)."""
    if text is None or len(text) <= limits.max_prompt:
        return None
    return (
        f"{field}: {len(text)} characters, more than this server's limit of {limits.max_prompt} "
        "(accel serve --max-prompt); shorten it"
    )


def token_problem(field: str, text: str | None, counters: tuple[TokenCounter, ...], limits: Limits) -> str | None:
    """Why `text` has too many tokens for `field` (None: it has not): its count in the tokenizer
    that makes the most of it. Call it after `prompt_problem`, so a tokenizer never sees a text past
    the character limit."""
    if text is None or not counters:
        return None
    count = max(counter.count(text) for counter in counters)  # a lone surrogate never gets here: pydantic refuses it
    if count <= limits.max_prompt_tokens:
        return None
    return (
        f"{field}: {count} tokens, more than this server's limit of {limits.max_prompt_tokens} "
        "(accel serve --max-prompt-tokens); shorten it"
    )


def work_problem(generate: dict[str, Any], count: int, defaults: dict[str, Any], limits: Limits) -> str | None:
    """Why the request's work is past `limits.max_work` (None: it is not). Unset keys take the
    served pipeline's defaults; without a known default a key counts as 1."""

    def value(key: str) -> int:
        return int(generate.get(key) or defaults.get(key) or 1)

    width, height, frames, steps = value("width"), value("height"), value("frames"), value("steps")
    work = width * height * frames * steps * count
    if work <= limits.max_work * MEGA:
        return None
    return (
        f"size × frames × steps × n: {width}x{height} × {frames} × {steps} × {count} is {work / MEGA:,.0f} "
        f"megapixel-steps, more than this server's limit of {limits.max_work:,} (accel serve --max-work); "
        "ask for a smaller size, fewer frames, fewer steps or fewer outputs"
    )


def positional_limits(pipe: Any) -> dict[str, int]:
    """The largest width, height and frames the transformer's positions cover, where its config
    bounds them (Wan's `rope_max_seq_len` over its patch and the VAE's scale factors); {} where
    positions are computed for any size."""
    transformer = getattr(pipe, "transformer", None)
    config = getattr(transformer, "config", None)
    positions = getattr(config, "rope_max_seq_len", None)
    patch = getattr(config, "patch_size", None)
    if not isinstance(positions, int) or not isinstance(patch, (tuple, list)) or len(patch) != 3:
        return {}
    spatial = int(getattr(pipe, "vae_scale_factor_spatial", 8))
    temporal = int(getattr(pipe, "vae_scale_factor_temporal", 4))
    return {
        "frames": (positions * patch[0] - 1) * temporal + 1,
        "height": positions * patch[1] * spatial,
        "width": positions * patch[2] * spatial,
    }


def position_problem(key: str, value: int, limits: dict[str, int], model: str) -> str | None:
    """Why `value` of `key` is past the served transformer's positional range (None: it is not)."""
    largest = limits.get(key)
    if largest is None or value <= largest:
        return None
    return f"past {model}'s positional range; at most {largest}"
