"""Vocabularies and merges of the tiny byte-level and byte-fallback BPE tokenizers: any text encodes,
and a pipeline's prompt template spends as many tokens as with the real vocabulary."""

from __future__ import annotations

import re
import string

# Llama 3's pre-tokenizer split, in ASCII: words with an optional leading space, runs of up to
# three digits, punctuation runs with an optional leading space, whitespace runs.
_LLAMA_WORDS = re.compile(r" ?[A-Za-z]+|\d{1,3}| ?[^\sA-Za-z\d]+|\s+")


def byte_fallback_bpe(specials: tuple[str, ...], template: str) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Vocab and merges of a byte-fallback BPE: `specials` first, one token per byte and ASCII
    character, and merges that build each word of `template` (split as Llama 3 splits it) into one token."""
    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({f"<0x{byte:02X}>": len(vocab) + byte for byte in range(256)})
    for ch in "▁" + string.ascii_letters + string.digits + string.punctuation + "\n\t":
        vocab.setdefault(ch, len(vocab))
    special = re.compile("|".join(re.escape(token) for token in specials))
    # The Metaspace pre-tokenizer's space is "▁".
    words = [word.replace(" ", "▁") for segment in special.split(template) for word in _LLAMA_WORDS.findall(segment)]
    return vocab, merges_building(words, vocab)


def merges_building(pieces: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges (each result added to `vocab`) that build every piece, left to right, into one token."""
    merges: list[tuple[str, str]] = []
    for piece in pieces:
        for end in range(2, len(piece) + 1):
            if piece[:end] not in vocab:
                merges.append((piece[: end - 1], piece[end - 1]))
                vocab[piece[:end]] = len(vocab)
    return merges


def run_merges(pieces: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
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
