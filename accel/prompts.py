"""How much of a prompt the pipeline's text encoders see: diffusers cuts a long prompt to each
tokenizer's limit, with at most a logged warning that a CLI run hides, so accel says it."""

from __future__ import annotations

import inspect
from typing import Any

# A tokenizer's model_max_length at or above this is transformers' "no limit" placeholder (1e30).
_NO_LIMIT = 1_000_000


def truncation_notes(pipe: Any, call: dict[str, Any], tokenizers: tuple[str, ...] | None = None) -> list[str]:
    """One line per tokenizer of `pipe` that cuts the call's prompt: tokens kept of the prompt's total.
    A tokenizer keeps at most the least of its model_max_length, the call's `max_sequence_length`
    (given, or the pipeline's default) and the pipeline's own `<tokenizer>_max_length` (HunyuanVideo 1.5's).
    `tokenizers` names those that read the whole prompt (None: every `tokenizer*` component)."""
    prompt = call.get("prompt")
    if not isinstance(prompt, str):
        return []
    parameter = inspect.signature(type(pipe).__call__).parameters.get("max_sequence_length")
    sequence = call.get("max_sequence_length", parameter.default if parameter is not None else None)
    notes = []
    from transformers import PreTrainedTokenizerBase

    for name, component in sorted(getattr(pipe, "components", {}).items()):
        if not name.startswith("tokenizer") or (tokenizers is not None and name not in tokenizers):
            continue
        # A processor (Kandinsky 5's image pipelines keep a Qwen2-VL one under "tokenizer") reads
        # the text through its own tokenizer; anything else is not counted.
        tokenizer = getattr(component, "tokenizer", component)
        if not isinstance(tokenizer, PreTrainedTokenizerBase):
            continue
        given = (getattr(tokenizer, "model_max_length", None), sequence, getattr(pipe, f"{name}_max_length", None))
        limits = [n for n in given if isinstance(n, int) and 0 < n < _NO_LIMIT]
        if not limits:
            continue
        total = len(
            tokenizer(prompt, truncation=False, verbose=False)["input_ids"]
        )  # verbose: no "longer than" warning
        if total > min(limits):
            notes.append(f"prompt: {min(limits)} of {total} tokens kept ({type(tokenizer).__name__}'s limit, {name})")
    return notes
