"""One family's test data, declared once in its tests/test_family_<name>.py as `CASE` and read by the shared
checks (the parallel matrix, tiny-model properties, ...) through tests/families.py."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fakecuda import Grid, Layout

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
class FakeCuda:
    """What the fake-CUDA tier (tests/test_fake_cuda.py) needs of a family beyond its plan."""

    # The arguments its pipeline passes its transformer, on fake cuda: (config, grid, batch, timestep).
    inputs: Callable[[dict[str, Any], Grid, int, Any], dict[str, Any]]
    # The transformer's output shape: (config, grid, batch, prefill).
    output_shape: Callable[[dict[str, Any], Grid, int, bool], tuple[int, ...]]
    # The tiny config's overrides instead of the shared HEADS heads of the tiny head size: config -> overrides.
    overrides: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    # Overrides besides the shared ones, for widths tied to the head count: (config, width) -> overrides.
    more_overrides: Callable[[dict[str, Any], int], dict[str, Any]] | None = None
    # Host syncs its own diffusers code makes per forward: (config, batch, cached) -> count.
    model_syncs: Callable[[dict[str, Any], int, bool], int] | None = None
    # One context-parallel attention call per block and sample (Mochi), not per block.
    attention_per_sample: bool = False
    # K/V caches its pipeline makes, one per CFG branch: (config, calls) -> caches.
    kv_caches: Callable[[dict[str, Any], int], list[Any]] | None = None
    # Tokens in front of the video stream's keys (Helios's history): grid -> count.
    history_tokens: Callable[[Grid], int] | None = None
    # A stream whose keys every rank holds whole besides its own cut ones (attended once per call).
    shared_keys: str | None = None
    # Its forward always hands its attention a mask (a joint text mask), whatever the call.
    masking: bool = False
    # Its forward reads its inputs' values on the host (Qwen-Image 2.1 lays out its tokens from the encoder's slot
    # mask: repeats, masked writes, positions). Fake tensors have no values, so these run inside accel plan's
    # KnownValues, which keeps the values of small tensors made from known data (the mask here); the probe counts
    # each read as the sync it is on a GPU and answers it with the real value.
    host_values: bool = False
    # Its transformer at the real model's width, and the layout it runs as there.
    real_config: dict[str, Any] | None = None
    real_layout: Layout | None = None


@dataclass(frozen=True)
class FamilyCase:
    # The parallel matrix's call: classifier-free guidance on, so CFG parallelism has branches to split.
    call: dict[str, Any]
    # A size whose token counts 3 ranks do not divide (the text lengths do not divide either).
    odd: dict[str, Any]
    # A cache threshold that caches some but not all calls of an 8-step run.
    threshold: float
    tiny: TinyCase
    fake: FakeCuda
    # The block checks' (tests/test_family_blocks.py): its real transformer class from a small seeded config, and the
    # arguments its pipeline passes it, latents moved by `drift` (as between denoising steps).
    block_transformer: Callable[[], Any]
    block_inputs: Callable[[float], dict[str, Any]]
    # The pipeline contract's (tests/test_pipeline_contract.py) size and steps, where the defaults (32x32, 2 steps)
    # do not serve; why it asks for one output per prompt (diffusers itself fails on two), and why a saved folder
    # cannot load back here.
    contract_size: dict[str, int] = field(default_factory=lambda: dict(height=32, width=32))
    contract_steps: int = 2
    one_per_prompt: str | None = None
    no_reload: str | None = None
    # Arguments the newer-family compile check (tests/test_compile.py) adds to the call.
    compile_call: dict[str, Any] = field(default_factory=dict)
    # Why the automatic plan cannot write this family's hand plan, and refuses it (tests/test_automatic_plan.py).
    refused_automatically: str | None = None


def module_of(family: str) -> str:
    return "test_family_" + family.replace("-", "_")


def case_of(family: str) -> FamilyCase:
    """One family's case, importing only its module: for shared helpers that test_family_* modules import
    themselves, where importing the whole registry would import the caller while it is half-initialised."""
    return importlib.import_module(module_of(family)).CASE
