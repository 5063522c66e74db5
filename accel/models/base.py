"""What a model family contributes: data about its pipeline, never engine code."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

OutputKind = Literal["image", "video"]


@dataclass(frozen=True)
class BlockList:
    """One list of repeated transformer blocks, in the order the transformer runs them.

    `returns` names what a block's forward returns, in order (one name: a bare tensor). Every
    name is also one of the block's forward arguments, which lets the cache pass a skipped
    block's inputs straight through.
    """

    attr: str
    returns: tuple[str, ...]


@dataclass(frozen=True)
class SequenceSplit:
    """One transformer-forward argument cut along its token dim over the sequence-parallel ranks.

    Arguments of one `stream` (e.g. image latents and their rotary ids) share one layout.
    """

    arg: str
    stream: str
    dim: int = -2


@dataclass(frozen=True)
class ParallelPlan:
    """What context parallelism does to a family's transformer, as data for the generic engine.

    `attention_keys` lists the streams, in order, that make up the keys of the transformer's
    attention calls (FLUX attends over text then image tokens); the engine masks their padding.
    """

    splits: tuple[SequenceSplit, ...]
    attention_keys: tuple[str, ...]
    output_stream: str
    output_dim: int = -2


@dataclass(frozen=True)
class GenerationDefaults:
    """Settings a user should start from; `None` leaves the pipeline's own default."""

    prompt: str = "a red fox in the snow, photograph"
    negative_prompt: str | None = None
    steps: int = 28
    height: int = 1024
    width: int = 1024
    frames: int | None = None
    guidance_scale: float | None = None


@dataclass(frozen=True)
class Family:
    """A model family: how to recognise, load, drive and accelerate its pipeline."""

    name: str
    title: str
    pipeline_class: str
    transformer_class: str
    repo: str
    output: OutputKind
    dtype: str
    defaults: GenerationDefaults
    blocks: tuple[BlockList, ...]
    # Pipeline attributes that hold a transformer (Wan 2.2 adds a low-noise `transformer_2`).
    transformer_attrs: tuple[str, ...] = ("transformer",)
    # Which block stream the cache compares between steps.
    primary_stream: str = "hidden_states"
    # Keyword the pipeline takes for the frame count (video families).
    frames_arg: str | None = None
    # Whether the pipeline takes `true_cfg_scale` (FLUX runs its negative prompt only when it is > 1).
    true_cfg: bool = False
    # Frame rate the family's videos are meant to play at.
    fps: int = 24
    # Attention heads of the default repo's transformer and of the tiny variant: Ulysses degrees
    # are checked against them before any rank starts.
    heads: int | None = None
    tiny_heads: int | None = None
    # Context parallelism; None: the family runs on one process only.
    parallel: ParallelPlan | None = None
    tiny: Callable[[], DiffusionPipeline] | None = None
    tiny_defaults: GenerationDefaults | None = None

    @property
    def tiny_alias(self) -> str | None:
        return f"tiny-{self.name}" if self.tiny is not None else None
