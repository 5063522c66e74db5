"""One family's test data, declared once in its tests/test_family_<name>.py as `CASE` and read by the shared
checks (the parallel matrix, tiny-model properties, ...) through tests/families.py."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PROMPT = dict(prompt="a red fox", negative_prompt="blurry")


@dataclass(frozen=True)
class TinyCase:
    """How to build, call and check one tiny family."""

    name: str
    build: Callable[[int], Any]
    pipeline_class: type
    call: dict[str, Any]
    output_attr: str
    output_shape: tuple[int, ...]
    # Transformer attributes holding each kind of repeated block (each needs >= 2 blocks).
    block_lists: tuple[str, ...]
    # Transformer calls per pipeline call: one per step, two with classifier-free guidance.
    transformer_calls: int
    # Shapes the transformer must see: image/video latents and text tokens.
    latent_shape: tuple[int, ...]
    text_shape: tuple[int, ...]
    components: tuple[str, ...] = field(default=())
    # Pipelines that encode each prompt at its own length (no padding): the negative call's text.
    negative_text_shape: tuple[int, ...] | None = None
    # Max-abs difference allowed after save and reload: weights are equal bit for bit, but loaded
    # tensors sit at other memory alignments, which sends some matmuls down another BLAS path.
    reload_tolerance: float = 0.0
    # The transformer's latent and text arguments; Z-Image's are lists with one tensor per sample.
    inputs: tuple[str, str] = ("hidden_states", "encoder_hidden_states")


@dataclass(frozen=True)
class FamilyCase:
    # The parallel matrix's call: classifier-free guidance on, so CFG parallelism has branches to split.
    call: dict[str, Any]
    # A size whose token counts 3 ranks do not divide (the text lengths do not divide either).
    odd: dict[str, Any]
    # A cache threshold that caches some but not all calls of an 8-step run.
    threshold: float
    tiny: TinyCase


def module_of(family: str) -> str:
    return "test_family_" + family.replace("-", "_")


def case_of(family: str) -> FamilyCase:
    """One family's case, importing only its module: for shared helpers that test_family_* modules import
    themselves, where importing the whole registry would import the caller while it is half-initialised."""
    return importlib.import_module(module_of(family)).CASE
