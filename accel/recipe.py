"""The recipe: every knob of a run, read from TOML, validated up front.

A recipe is a set of frozen dataclasses, one per TOML section. Validation is generic: each field's
type annotation (plus an optional `min` in its metadata) says what it accepts, so adding a key is
one line and its error message comes for free. Errors are one line naming the source, section and
key, because the user's only recourse is to edit that line.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import os
import stat
import tomllib
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from os import PathLike
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from accel.cache.config import cache_refusal
from accel.errors import RecipeError

__all__ = [
    "SECTIONS",
    "BenchSection",
    "CacheSection",
    "CompileSection",
    "GenerateSection",
    "ModelSection",
    "ParallelSection",
    "QuantSection",
    "Recipe",
    "VaeSection",
    "BenchVariant",
    "Flag",
    "load_recipe",
]


@dataclass(frozen=True)
class Flag:
    """How a recipe key reads as a command-line option, where that differs from the key: accel's CLI
    builds the option from this and the key's type, default and help (so commands share one spelling)."""

    name: str = ""  # "--guidance"; empty: the key's name with dashes
    alias: str = ""  # a short alias, "-p"
    metavar: str = ""  # the value's placeholder in --help; empty: its type's
    help: str = ""  # a line for --help where the key's own is a paragraph; empty: the key's
    shown: str = ""  # the default --help shows, where not "recipe, else <default>" ({recipe} stands for that)
    switch: Any = None  # the option takes no value and sets the key to this (a bool key: True)
    example: str = ""  # a table key's KEYWORD=VALUE example, for the line refusing a malformed one
    parse: bool = False  # a table key's values read as TOML values (17, true), else as strings


def _table(help: str, flag: Flag | None = None) -> Any:
    """A recipe key holding a table (keyword = value); empty by default, read-only once validated."""
    meta: dict[str, Any] = {"help": help}
    if flag is not None:
        meta["flag"] = flag
    return field(default_factory=lambda: types.MappingProxyType({}), hash=False, metadata=meta)


def _key(
    default: Any,
    help: str,
    min: int | None = None,
    max: int | None = None,
    prompt: bool = False,
    flag: Flag | None = None,
) -> Any:
    """A recipe key: its default, the help line the README reference is built from, bounds (`max`:
    where a larger number overflows something downstream), `prompt`: a text held to the prompt limit,
    `flag`: how its command-line option differs from the key."""
    meta: dict[str, Any] = {"help": help}
    if flag is not None:
        meta["flag"] = flag
    if min is not None:
        meta["min"] = min
    if max is not None:
        meta["max"] = max
    if prompt:
        meta["prompt"] = True
    return field(default=default, metadata=meta)


# Bounds past which a number overflows torch or numpy (a traceback deep in a pipeline before these).
MAX_PIXELS_SIDE = 65536  # height / width: no model makes more; beyond, latent sizes overflow
MAX_STEPS = 10_000  # schedulers build arrays of this length; 1000 is already far past any model's use
MAX_FRAMES = 100_000
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits
FLOAT32_MAX = 3.4028234663852886e38  # pipelines put scales into float32 tensors

# The recipe file: a recipe is a few kilobytes (a run's --json report, which reruns it, some more).
MAX_RECIPE_BYTES = 8 * 1024 * 1024
# The most characters of a prompt or negative prompt. Text encoders read at most a few thousand
# tokens (T5: 512, Gemma / Qwen: about 1024, some 4 characters each) and cut the rest, but their
# tokenizers see all of it first: megabytes cost seconds to minutes and can abort the process.
PROMPT_CHARS = 20_000
PROMPT_CHARS_ENV = "ACCEL_MAX_PROMPT_CHARS"


def prompt_chars() -> int:
    """The prompt limit: PROMPT_CHARS, or ACCEL_MAX_PROMPT_CHARS where set (a positive integer)."""
    raw = os.environ.get(PROMPT_CHARS_ENV, "").strip()
    if not raw:
        return PROMPT_CHARS
    if not raw.isdigit() or int(raw) < 1 or len(raw) > 12:
        raise RecipeError(
            f"{PROMPT_CHARS_ENV}={raw[:40]}: must be a positive integer (characters), e.g. {PROMPT_CHARS}"
        )
    return int(raw)


@dataclass(frozen=True)
class ModelSection:
    """Which pipeline to load and where."""

    name: str = _key("", "Model family alias or Hugging Face repo id; empty means given on the command line.")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = _key(
        "auto", "Weight dtype; auto uses the family's default.", flag=Flag(help="auto, float32, float16 or bfloat16.")
    )
    device: Literal["auto", "cpu", "cuda"] = _key(
        "auto", "Where to run; auto picks cuda when available.", flag=Flag(help="auto, cpu or cuda.")
    )
    pipeline: str = _key(
        "",
        "Pipeline class to run the model as (FluxKontextPipeline, QwenImageEditPipeline, …); empty: the model's own.",
        flag=Flag(metavar="CLASS", help="Pipeline class to run the model as, e.g. FluxKontextPipeline."),
    )
    lora: tuple[str, ...] | None = _key(
        None,
        'LoRA weights fused into the model before it is accelerated: "PATH@SCALE", a .safetensors file, a folder or a '
        "hub "
        "repo id, SCALE 1 when left out; several are fused together.",
        flag=Flag(
            metavar="PATH@SCALE",
            help="LoRA weights fused into the model (a .safetensors file, folder or hub repo id; scale 1 when left "
            "out); repeatable.",
        ),
    )
    components: Mapping[str, str] = _table(
        "Components the pipeline variant needs beyond the model's, by name: the folder each was saved to, e.g. "
        'temporal_latent_upsampler = "ltx-2.5-temporal-upsampler" (LTX2DFRTemporalRefinePipeline); the variant says '
        "which.",
        flag=Flag(
            name="--component",
            metavar="NAME=FOLDER",
            help="A component the pipeline needs beyond the model's, e.g. temporal_latent_upsampler=FOLDER "
            "(LTX2DFRTemporalRefinePipeline); repeatable.",
            example="temporal_latent_upsampler=upsampler",
        ),
    )


@dataclass(frozen=True)
class GenerateSection:
    """What to generate; an unset key takes the model family's default."""

    prompt: str | None = _key(None, "Text prompt.", prompt=True, flag=Flag(alias="-p"))
    negative_prompt: str | None = _key(None, "Negative prompt, for pipelines that take one.", prompt=True)
    steps: int | None = _key(None, "Number of denoising steps.", min=1, max=MAX_STEPS)
    height: int | None = _key(None, "Output height in pixels.", min=16, max=MAX_PIXELS_SIDE)
    width: int | None = _key(None, "Output width in pixels.", min=16, max=MAX_PIXELS_SIDE)
    frames: int | None = _key(None, "Number of frames (video families).", min=1, max=MAX_FRAMES)
    guidance_scale: float | None = _key(
        None, "Classifier-free (or distilled) guidance scale.", min=0, flag=Flag(name="--guidance")
    )
    true_cfg_scale: float | None = _key(
        None,
        "FLUX true CFG scale; above 1 runs the negative prompt too.",
        min=1,
        flag=Flag(
            name="--true-cfg", help="True CFG scale (FLUX, HunyuanVideo): above 1 also runs the negative prompt."
        ),
    )
    image: str | None = _key(
        None,
        "Input image file, for pipelines that edit or start from one (img2img, inpaint, Kontext, edit).",
        flag=Flag(metavar="PATH", shown="none"),
    )
    mask: str | None = _key(
        None,
        "Mask image file (white: repaint), for inpaint and fill pipelines; a picture or a video of per-frame masks "
        "for VACE.",
        flag=Flag(metavar="PATH", shown="none"),
    )
    video: str | None = _key(
        None,
        "Input video file (MP4, WebM, …), for video-to-video, editing and VACE pipelines.",
        flag=Flag(metavar="PATH", shown="none"),
    )
    seed: int = _key(0, "Random seed, so runs and variants are comparable.", min=0, max=MAX_SEED)
    conditions: tuple[str, ...] | None = _key(
        None,
        "Pictures or clips pinned to positions, for pipelines that take conditions (LTX-2, LTX-Video): "
        '"PATH@INDEX:STRENGTH", INDEX and STRENGTH optional (0 and 1); the pipeline says what INDEX counts.',
        flag=Flag(
            name="--condition",
            metavar="PATH@INDEX:STRENGTH",
            help="A picture or clip pinned to a position (LTX-2, LTX-Video condition pipelines); repeatable.",
        ),
    )
    references: tuple[str, ...] | None = _key(
        None,
        'Reference pictures or clips without a position, for in-context pipelines (LTX-2 IC-LoRA): "PATH@STRENGTH", '
        "STRENGTH optional (1).",
        flag=Flag(
            name="--reference",
            metavar="PATH@STRENGTH",
            help="A reference picture or clip without a position (LTX-2 IC-LoRA); repeatable.",
        ),
    )
    inputs: Mapping[str, str] = _table(
        'Other input files, by the pipeline\'s keyword: pose_video = "pose.mp4" (Wan Animate), control_video '
        "(CogVideoX Fun); "
        "the pipeline variant says which it takes.",
        flag=Flag(
            name="--input",
            metavar="KEYWORD=PATH",
            help="Another input file under the pipeline's keyword, e.g. pose_video=pose.mp4 (Wan Animate); repeatable.",
            example="pose_video=pose.mp4",
        ),
    )
    arguments: Mapping[str, Any] = _table(
        'Other arguments of the pipeline call, by keyword: mode = "replace", overlap_history = 17; '
        "numbers, strings, booleans or lists of them.",
        flag=Flag(
            name="--arg",
            metavar="KEYWORD=VALUE",
            help="Another pipeline call argument, e.g. mode=replace or overlap_history=17 (a TOML value, else a "
            "string); repeatable.",
            example="overlap_history=17",
            parse=True,
        ),
    )


@dataclass(frozen=True)
class CacheSection:
    """Step caching: skip the middle blocks of a transformer call when the first blocks' output barely changed,
    extrapolate attention and feed-forward outputs between computed steps, or skip whole calls along a calibrated
    curve."""

    @property
    def enabled(self) -> bool:
        """taylorseer runs when named; the other methods from a threshold above 0."""
        return self.method == "taylorseer" or self.threshold > 0

    threshold: float = _key(
        0.0,
        "Skip the cached blocks while the first blocks' residual changes less than this (relative mean absolute "
        "difference); 0 is off.",
        min=0,
        flag=Flag(name="--cache", metavar="THRESHOLD", help="Cache threshold (0 = off)."),
    )
    method: Literal["fbcache", "dbcache", "taylorseer", "magcache"] = _key(
        "fbcache",
        "fbcache: block 0 decides, every later block is cached; dbcache: the first first_blocks decide and "
        "always run, the last last_blocks always run, the blocks between are cached; taylorseer: inside every block, "
        "attention and feed-forward outputs are computed every interval steps and extrapolated between (no threshold); "
        "magcache: whole calls are skipped while the calibrated residual-magnitude curve's accumulated error stays "
        "under the threshold.",
        flag=Flag(name="--cache-method", metavar="METHOD", help="fbcache, dbcache, taylorseer or magcache."),
    )
    first_blocks: int = _key(
        1,
        "dbcache: blocks always computed at the start, whose residual drives the decision.",
        min=1,
        flag=Flag(metavar="N", help="dbcache: blocks always computed first; they decide."),
    )
    last_blocks: int = _key(
        0,
        "dbcache: blocks always computed at the end, on the cached middle's output.",
        min=0,
        flag=Flag(metavar="N", help="dbcache: blocks always computed last."),
    )
    calibrator: Literal["none", "taylorseer"] = _key(
        "none",
        "fbcache / dbcache: what a cached call adds for the skipped blocks: none reuses their last computed "
        "residual, taylorseer extrapolates it from the last computed ones (finite differences over the steps).",
        flag=Flag(metavar="NAME", help="none (reuse the skipped blocks' residual) or taylorseer (extrapolate it)."),
    )
    taylor_order: Literal[1, 2] = _key(
        1,
        "taylorseer (method or calibrator): order of the extrapolation (1 linear, 2 quadratic).",
        flag=Flag(metavar="N", help="taylorseer: 1 or 2."),
    )
    interval: int = _key(
        3,
        "taylorseer: compute every interval-th step, extrapolate the steps between.",
        min=2,
        flag=Flag(metavar="N", help="taylorseer: compute every N-th step, extrapolate between."),
    )
    disable_before: int = _key(0, "taylorseer: steps before this one are always computed.", min=0)
    disable_after: int = _key(0, "taylorseer: steps from this one on are always computed; 0 means none.", min=0)
    interval_offset: int = _key(
        0,
        "taylorseer: the first interval-th step comes this many steps after disable_before, the steps between "
        "extrapolated (diffusers' TaylorSeer schedule is 1, with extrapolate_early); below interval.",
        min=0,
    )
    extrapolate_early: bool = _key(
        False,
        "taylorseer: extrapolate once a module has one computed output, at the order its outputs so far allow "
        "(the first extrapolated step reuses it, as diffusers' TaylorSeer does); false computes the first "
        "taylor_order + 1 steps.",
    )
    mag_ratios: tuple[tuple[float, ...], ...] = _key(
        (),
        "magcache: the pipeline's residual-magnitude ratio per step, one list per CFG branch; accel tune RECIPE "
        "--calibrate measures them and writes them here.",
    )
    warmup_steps: int = _key(0, "Steps always computed in full before caching may start.", min=0)
    max_consecutive_cached: int = _key(0, "Most cached steps in a row before one full step; 0 means no limit.", min=0)
    max_cached_steps: int = _key(
        0,
        "Most cached calls per generation (per CFG branch); 0 means no limit.",
        min=0,
        flag=Flag(metavar="N", help="Most cached calls per generation (0 = no limit)."),
    )


@dataclass(frozen=True)
class ParallelSection:
    """Context and tensor parallelism: one process per GPU (gloo ranks on a CPU-only machine)."""

    gpus: int = _key(
        0,
        "Processes (GPUs); 0 means ulysses × ring × cfg × tp. With gpus set and no ulysses or ring, those two are "
        "chosen to fill gpus / (cfg × tp): Ulysses over all of them when it divides the head count or pads it by at "
        "most 25 %, else the largest degree dividing both and the rest Ring.",
        min=0,
    )
    ulysses: int = _key(
        1,
        "Ulysses (all-to-all head) parallel degree; at most the head count, which it need not "
        "divide (heads are padded).",
        min=1,
        flag=Flag(help="Ulysses degree.", shown="{recipe}, or chosen for --gpus"),
    )
    ring: int = _key(
        1,
        "Ring attention parallel degree.",
        min=1,
        flag=Flag(help="Ring degree.", shown="{recipe}, or chosen for --gpus"),
    )
    cfg: Literal[1, 2] = _key(
        1,
        "2 runs the conditional and unconditional CFG branches on separate GPUs.",
        flag=Flag(name="--cfg-parallel", help="Run CFG halves on separate ranks.", shown="recipe, else off", switch=2),
    )
    tp: int = _key(
        1,
        "Tensor-parallel degree: each block's attention heads and MLP width are split over tp GPUs, "
        "which hold 1/tp of those weights each; it must divide the heads and every split width.",
        min=1,
        flag=Flag(help="Tensor-parallel degree: each block's heads and MLP width split over tp ranks."),
    )
    timeout: float = _key(
        600.0,
        "Seconds a collective may wait for the other ranks before the job fails, naming the rank it waited for.",
        min=1,
    )
    plan: Literal["family", "automatic"] = _key(
        "family",
        "Where the context-parallel plan comes from: the family's tested one, or the automatic one accel learns "
        "from the model and verifies on simulated ranks before use (what a pipeline no family describes always gets).",
        flag=Flag(
            name="--cp-plan",
            metavar="FROM",
            help="family: the family's tested context-parallel plan; automatic: learned from the model and verified "
            "on simulated ranks before use.",
        ),
    )

    @property
    def world_size(self) -> int:
        """Number of processes (GPUs) the parallel layout needs."""
        return self.gpus or self.ulysses * self.ring * self.cfg * self.tp

    @property
    def chooses_degrees(self) -> bool:
        """The process count is given without Ulysses or Ring: they are picked to fill it."""
        return bool(self.gpus) and self.ulysses == 1 and self.ring == 1

    @property
    def sequence_ranks(self) -> int:
        """Ranks that share one sequence (Ulysses × Ring): what is left of the processes after CFG and TP."""
        return max(1, self.world_size // (self.cfg * self.tp))


@dataclass(frozen=True)
class VaeSection:
    """VAE decode options, which dominate memory at high resolutions."""

    parallel: bool = _key(
        False,
        "Split the VAE decode across every GPU of the job (exact: equals the one-GPU decode).",
        flag=Flag(name="--parallel-vae", help="Split the VAE decode over the ranks."),
    )
    tiling: bool = _key(
        False,
        "Decode in tiles to bound memory (with parallel, each tile is split).",
        flag=Flag(name="--vae-tiling", help="Decode in tiles (the VAE's own tiling) to bound the decode's memory."),
    )
    all_ranks: bool = _key(False, "With parallel: every rank gets the decoded pixels, not only rank 0.")


@dataclass(frozen=True)
class QuantSection:
    """Weight (and optionally activation) quantization of the transformer via torchao."""

    type: Literal["none", "int8wo", "int8dq", "fp8dq", "fp8wo", "int4wo"] = _key(
        "none",
        "Quantization scheme; none keeps the model dtype.",
        flag=Flag(name="--quant", help="none, int8wo, int8dq, fp8dq, fp8wo or int4wo."),
    )
    scope: Literal["blocks", "transformer"] = _key(
        "blocks",
        "Quantize the repeated blocks' Linear layers (embedders and output layers keep the model dtype) or every "
        "Linear layer.",
    )
    exclude: tuple[str, ...] = _key(
        (), 'Module-name patterns left unquantized (fnmatch, * also spans dots: "*.norm1.linear").'
    )


@dataclass(frozen=True)
class CompileSection:
    """torch.compile options."""

    enabled: bool = _key(
        False,
        "Compile the transformer with torch.compile (the first run compiles; it is timed as warm-up).",
        flag=Flag(name="--compile", help="torch.compile the transformer blocks."),
    )
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = _key(
        "default", "torch.compile mode."
    )
    scope: Literal["blocks", "transformer"] = _key(
        "blocks", "Compile the repeated blocks (one graph per block class, fast to compile) or the whole transformer."
    )


@dataclass(frozen=True)
class MemorySection:
    """Where the large components live, so that a model fits the GPUs there are."""

    text_encoder: Literal["replicated", "rank0", "cpu", "sharded"] = _key(
        "replicated",
        "replicated: every rank holds the text encoders and encodes; rank0: only the first rank of the layout "
        "holds them and encodes each prompt once, sending the embeddings to the other ranks, which never load them; "
        "cpu: as rank0, and that rank keeps them in host memory and encodes there (no GPU memory for them); "
        "sharded: transformers' own tensor-parallel plan splits each text encoder that has one (Llama, Mistral, "
        "Qwen2.5-VL, Qwen3, Gemma 3; not T5, UMT5 or CLIP, which stay whole) over the layout's ranks, which encode "
        "together and each get the whole embeddings (one process: nothing to split).",
        flag=Flag(
            metavar="PLACE",
            help="replicated; rank0: only the first rank holds the text encoders and sends the embeddings; cpu: as "
            "rank0, in host memory; sharded: split over the ranks by transformers' TP plan.",
        ),
    )
    vae: Literal["replicated", "rank0"] = _key(
        "replicated",
        "replicated: every rank decodes the whole output (or its share of it with [vae] parallel); rank0: only "
        "the layout's first rank, the one that writes the output, decodes: the others stop at the latents and keep the "
        "VAE in host memory (no GPU memory, no decode time for them; one process: nothing changes).",
        flag=Flag(
            name="--vae-placement",
            metavar="PLACE",
            help="replicated; rank0: only the first rank, which writes the output, decodes; the others keep the VAE "
            "in host memory.",
        ),
    )
    offload: Literal["none", "model", "group"] = _key(
        "none",
        "none: every component stays on the GPU; model: diffusers' model offload, each whole component moved to the "
        "GPU while it runs (the transformer must fit); group: diffusers' group offload, the transformer's blocks "
        "streamed "
        "one at a time with prefetch on a side stream (slowest; the least GPU memory). One process only, without "
        "compile.",
        flag=Flag(
            metavar="MODE",
            help="none; model: each component moved to the GPU while it runs; group: the transformer's blocks "
            "streamed (diffusers' offloading).",
        ),
    )


def vae_placement_refusal(recipe: "Recipe") -> str | None:
    """Why [memory] vae = "rank0" cannot run with the rest of `recipe` (None: it can): the split decode
    of [vae] parallel needs every rank of the layout to decode."""
    if recipe.memory.vae == "rank0" and recipe.vae.parallel:
        return (
            '[memory] vae = "rank0" and [vae] parallel = true do not compose: the split decode needs every rank to '
            "decode; "
            'set vae = "replicated" to split the decode, or parallel = false to decode on the first rank alone'
        )
    return None


def memory_refusal(recipe: "Recipe", replicas: int = 1) -> str | None:
    """The first of [memory]'s refusals of `recipe` (None: it runs): the VAE placement's, then offload's."""
    return vae_placement_refusal(recipe) or offload_refusal(recipe, replicas)


def offload_refusal(recipe: "Recipe", replicas: int = 1) -> str | None:
    """Why [memory] offload cannot run with the rest of `recipe` (None: it can): one process, no compile,
    and model offload moves the encoders itself. `replicas`: `accel serve`'s copies of the recipe's
    layout, each of which would hold its own copy in host memory."""
    mode = recipe.memory.offload
    if mode == "none":
        return None
    if recipe.world_size > 1:
        return (
            f'[memory] offload = "{mode}" runs one process: each rank would stream its own whole copy; '
            f'set offload = "none" with a parallel layout, or run one process'
        )
    if replicas > 1:
        return (
            f'[memory] offload = "{mode}" serves one replica: each of the {replicas} replicas would stream its own '
            "whole "
            f'copy from host memory; set offload = "none" with --replicas, or serve one replica'
        )
    if recipe.compile.enabled:
        return (
            f'[memory] offload = "{mode}" and [compile] do not compose: compiled graphs would capture weights that '
            "offloading moves; turn one of them off"
        )
    if mode == "model" and recipe.memory.text_encoder == "cpu":
        return (
            '[memory] offload = "model" already keeps the text encoders in host memory between prompts and encodes on '
            "the GPU; "
            'set text_encoder = "replicated" with it, or offload = "group" to encode on the CPU'
        )
    return None


@dataclass(frozen=True)
class BenchVariant:
    """One benchmark variant: a name plus a validated partial override of the other sections."""

    name: str
    # Read-only so a frozen recipe stays immutable; excluded from hashing since mappings cannot hash.
    overrides: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: types.MappingProxyType({}), hash=False)


@dataclass(frozen=True)
class BenchSection:
    """Benchmark: variants of the recipe, measured the same way and compared with the first."""

    variants: tuple[BenchVariant, ...] = _key(
        (), 'Variants to compare, each {name = "...", <section> = {<key> = ...}}; the first is the baseline.'
    )
    repeats: int = _key(3, "Timed runs per variant.", min=1)
    warmup: int = _key(1, "Untimed runs per variant before timing (compilation, caches).", min=0)


SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "generate": GenerateSection,
    "cache": CacheSection,
    "parallel": ParallelSection,
    "vae": VaeSection,
    "quant": QuantSection,
    "compile": CompileSection,
    "memory": MemorySection,
    "bench": BenchSection,
}


# The sections that change how a run is accelerated (not what it generates).
ACCELERATORS = ("cache", "parallel", "vae", "quant", "compile", "memory")


@dataclass(frozen=True)
class Recipe:
    """A whole, validated run configuration. Build it with `from_dict` or `load_recipe`, which validate."""

    model: ModelSection = field(default_factory=ModelSection)
    generate: GenerateSection = field(default_factory=GenerateSection)
    cache: CacheSection = field(default_factory=CacheSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    vae: VaeSection = field(default_factory=VaeSection)
    quant: QuantSection = field(default_factory=QuantSection)
    compile: CompileSection = field(default_factory=CompileSection)
    memory: MemorySection = field(default_factory=MemorySection)
    bench: BenchSection = field(default_factory=BenchSection)
    # Where the recipe came from, for later messages; not part of its identity.
    source: str = field(default="<dict>", compare=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "<dict>") -> Recipe:
        """Validate a parsed recipe; missing sections and keys take their defaults."""
        values = _check_sections(source, data, SECTIONS)
        bench = values.pop("bench", {})
        raw_variants = bench.pop("variants", ())
        sections = {name: SECTIONS[name](**values.get(name, {})) for name in SECTIONS if name != "bench"}
        _check_cache(source, sections["cache"])
        variants = _check_variants(source, raw_variants)
        return cls(**sections, bench=BenchSection(variants=variants, **bench), source=source)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain, TOML-friendly dict (lists, no None) that `from_dict` turns back into this recipe."""
        return {name: _plain(getattr(self, name)) for name in SECTIONS}

    def with_overrides(self, overrides: Mapping[str, Any], source: str = "command line") -> Recipe:
        """Deep-merge a partial recipe over this one and re-validate; errors name `source`."""
        if not isinstance(overrides, Mapping):
            raise RecipeError(f"{source}: overrides must be a table of sections, got {_show(overrides)}")
        merged = Recipe.from_dict(_merge(self.to_dict(), overrides), source)
        return dataclasses.replace(merged, source=self.source)

    def unaccelerated(self) -> Recipe:
        """This recipe with every accelerator off: the baseline `run --compare` measures against."""
        plain = {name: SECTIONS[name]() for name in ACCELERATORS}
        return dataclasses.replace(self, **plain, bench=BenchSection())

    @property
    def variants(self) -> tuple[BenchVariant, ...]:
        """The validated bench variants, in recipe order."""
        return self.bench.variants

    def variant(self, name: str) -> Recipe:
        """The concrete recipe one bench variant runs: this one with its overrides, without variants."""
        for v in self.variants:
            if v.name == name:
                base = dataclasses.replace(self, bench=dataclasses.replace(self.bench, variants=()))
                return base.with_overrides(v.overrides, f"{self.source}: [bench] variant {name!r}")
        names = [v.name for v in self.variants]
        hint = _suggest(name, names, repr, "variants") if names else " (the recipe defines none)"
        raise RecipeError(f"{self.source}: [bench] has no variant {name!r}{hint}")

    @property
    def world_size(self) -> int:
        """Number of processes (GPUs) the recipe's parallel layout needs."""
        return self.parallel.world_size


def load_recipe(path: str | PathLike[str]) -> Recipe:
    """Read and validate a TOML recipe, or a JSON one: the same tables as a JSON object, or the
    document `accel run --json` wrote, whose `recipe` is the run's effective recipe (so a run is
    rebuilt from its report). Every failure is a one-line RecipeError naming the file."""
    source = str(path)
    is_json = str(path).lower().endswith(".json")
    language = "JSON" if is_json else "TOML"
    try:
        raw = _read_capped(path, source)
        data = json.loads(raw) if is_json else tomllib.loads(raw.decode("utf-8"))
    except RecipeError:
        raise
    except FileNotFoundError:
        raise RecipeError(f"{source}: no such file") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise RecipeError(f"{source}: not valid {language}: {e}") from None
    except UnicodeDecodeError:
        raise RecipeError(f"{source}: not valid {language}: not UTF-8 text") from None
    except OSError as e:
        raise RecipeError(f"{source}: cannot read: {e.strerror}") from None
    except (ValueError, RecursionError) as e:  # a number of more than 4300 digits, tables nested thousands deep
        raise RecipeError(
            f"{source}: not valid {language}: {str(e).splitlines()[0][:120] or type(e).__name__}"
        ) from None
    if is_json and isinstance(data, Mapping) and isinstance(data.get("recipe"), Mapping):
        data = data["recipe"]  # an `accel run --json` report (no recipe has a [recipe] section): its effective recipe
    return Recipe.from_dict(data, source)


def _read_capped(path: str | PathLike[str], source: str) -> bytes:
    """The recipe's bytes, at most MAX_RECIPE_BYTES of them. A device is refused unread (a pipe is read)."""
    if stat.S_ISCHR(mode := os.stat(path).st_mode) or stat.S_ISBLK(mode):
        raise RecipeError(f"{source}: a device, not a recipe file; pass a .toml recipe or an accel run --json report")
    return read_capped(path, source, "a recipe is a few kilobytes, pass a .toml recipe or an accel run --json report")


def read_capped(path: str | PathLike[str], source: str, advice: str) -> bytes:
    """The file's bytes, at most MAX_RECIPE_BYTES of them: /dev/zero or a huge file is refused after
    reading one byte past the cap, never read whole (RecipeError: "`source`: larger than …; `advice`")."""
    with open(path, "rb") as file:
        data = file.read(MAX_RECIPE_BYTES + 1)
    if len(data) > MAX_RECIPE_BYTES:
        raise RecipeError(f"{source}: larger than {MAX_RECIPE_BYTES // 2**20} MiB; {advice}")
    return data


# --- validation -----------------------------------------------------------------------------


def _check_cache(source: str, cache: CacheSection) -> None:
    """[cache] as its method reads it: the method configs' fields say which keys each method reads."""
    refusal = cache_refusal(cache)
    if refusal is not None:
        raise RecipeError(f"{source}: {refusal}")


def _check_sections(
    source: str, data: Any, allowed: Mapping[str, type], nullable: bool = True
) -> dict[str, dict[str, Any]]:
    """Validate every section present in `data`; returns the normalized values given, per section.

    `nullable` lets optional keys be None ("the family's default"); variants forbid it, being TOML data.
    """
    if not isinstance(data, Mapping):
        raise RecipeError(f"{source}: a recipe must be a table of sections, got {_show(data)}")
    out: dict[str, dict[str, Any]] = {}
    for name, raw in data.items():
        if name not in allowed:
            raise RecipeError(f"{source}: {_unknown_section(name, raw, allowed)}")
        out[name] = _check_section(source, name, SECTIONS[name], raw, nullable)
    return out


def _unknown_section(name: Any, raw: Any, allowed: Mapping[str, type]) -> str:
    """Explain an unknown top-level name; a stray key (`steps = 4` above any header) gets its section."""
    if not isinstance(raw, Mapping):
        homes = [s for s, cls in allowed.items() if name in _hints(cls)]
        if homes:
            where = " or ".join(f"[{s}] {name}" for s in homes)
            return f"key {name!r} is not in a section (did you mean {where}?)"
    return f"unknown section [{_name(name)}]{_suggest(name, allowed, lambda s: f'[{s}]', 'sections')}"


def _check_section(source: str, name: str, cls: type, raw: Any, nullable: bool) -> dict[str, Any]:
    """Validate one section's keys against the dataclass' annotations; returns normalized values."""
    if not isinstance(raw, Mapping):
        raise RecipeError(f"{source}: [{name}] must be a table, got {_show(raw)}")
    hints = _hints(cls)
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in hints:
            raise RecipeError(f"{source}: unknown key [{name}] {_name(key)}{_suggest(key, hints, repr, 'keys')}")
        hint, meta = hints[key]
        if hint == tuple[BenchVariant, ...]:  # needs the whole recipe's section list: Recipe.from_dict does it
            out[key] = value
            continue
        ok, out[key] = _coerce(hint, meta, value)
        if not ok or (value is None and not nullable):
            raise RecipeError(f"{source}: [{name}] {key} must be {_refusal(hint, meta, value)}")
    return out


def _check_variants(source: str, raw: Any) -> tuple[BenchVariant, ...]:
    """Validate [bench] variants: uniquely named tables overriding any section but [bench]."""
    if not isinstance(raw, list | tuple):
        raise RecipeError(f"{source}: [bench] variants must be a list of tables, got {_show(raw)}")
    others = {name: cls for name, cls in SECTIONS.items() if name != "bench"}
    variants: list[BenchVariant] = []
    for i, item in enumerate(raw, 1):
        if not isinstance(item, Mapping):
            raise RecipeError(f"{source}: [bench] variant #{i} must be a table, got {_show(item)}")
        if "name" not in item:
            raise RecipeError(f'{source}: [bench] variant #{i} has no name (add name = "...")')
        name = item["name"]
        if not isinstance(name, str) or not name:
            raise RecipeError(f"{source}: [bench] variant #{i} name must be a non-empty string, got {_show(name)}")
        if any(v.name == name for v in variants):
            raise RecipeError(f"{source}: [bench] variant name {name!r} is used twice (names must be unique)")
        where = f"{source}: [bench] variant {name!r}"
        body = {k: v for k, v in item.items() if k != "name"}
        if "bench" in body:
            raise RecipeError(f"{where}: cannot contain [bench] (variants share the recipe's repeats and warmup)")
        values = _check_sections(where, body, others, nullable=False)
        frozen = types.MappingProxyType({s: types.MappingProxyType(v) for s, v in values.items()})
        variants.append(BenchVariant(name, frozen))
    return tuple(variants)


@functools.cache
def _hints(cls: type) -> dict[str, tuple[Any, Mapping[str, Any]]]:
    """Field name -> (resolved annotation, metadata), in declaration order."""
    types_ = get_type_hints(cls)
    return {f.name: (types_[f.name], f.metadata) for f in dataclasses.fields(cls)}


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    """`X | None` -> (X, True); anything else -> (hint, False)."""
    if get_origin(hint) in (Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        return args[0], len(args) < len(get_args(hint))
    return hint, False


def _coerce(hint: Any, meta: Mapping[str, Any], value: Any) -> tuple[bool, Any]:
    """Whether `value` fits the annotation, and its normalized form (int -> float, list -> tuple).

    Strict on purpose: TOML `true` is not 1, and 1 is not `true`, so a typo cannot flip a switch.
    """
    hint, optional = _unwrap_optional(hint)
    low = meta.get("min")
    if value is None:
        return optional, None
    if hint is bool:
        return type(value) is bool, value
    high = meta.get("max")
    if hint is int:
        return type(value) is int and (low is None or value >= low) and (high is None or value <= high), value
    if hint is float:
        number = (
            type(value) in (int, float)
            and math.isfinite(value)
            and abs(value) <= FLOAT32_MAX
            and (low is None or value >= low)
        )
        return number, float(value) if number else value
    if hint is str:
        return isinstance(value, str) and (not meta.get("prompt") or len(value) <= prompt_chars()), value
    if get_origin(hint) is Literal:
        return any(type(value) is type(c) and value == c for c in get_args(hint)), value
    if hint == tuple[tuple[float, ...], ...]:
        ok = isinstance(value, list | tuple) and all(
            isinstance(row, list | tuple) and all(type(v) in (int, float) and math.isfinite(v) and v > 0 for v in row)
            for row in value
        )
        return ok, tuple(tuple(float(v) for v in row) for row in value) if ok else value
    if hint == tuple[str, ...]:
        ok = isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)
        return ok, tuple(value) if ok else value
    if hint == Mapping[str, str]:
        ok = isinstance(value, Mapping) and all(
            isinstance(k, str) and k.isidentifier() and isinstance(v, str) for k, v in value.items()
        )
        return ok, types.MappingProxyType(dict(value)) if ok else value
    if hint == Mapping[str, Any]:
        ok = isinstance(value, Mapping) and all(
            isinstance(k, str) and k.isidentifier() and _argument_value(v) for k, v in value.items()
        )
        frozen = {k: tuple(v) if isinstance(v, list | tuple) else v for k, v in value.items()} if ok else value
        return ok, types.MappingProxyType(frozen) if ok else value
    raise TypeError(f"no validator for annotation {hint!r}")  # a programming error, not a user one


def _refusal(hint: Any, meta: Mapping[str, Any], value: Any) -> str:
    """'<requirement>, got <value>': the bound a value passed where it passed one of those that keep
    numbers from overflowing and prompts from swamping the tokenizer."""
    if meta.get("prompt") and isinstance(value, str):
        return (
            f"a string of at most {prompt_chars():,} characters ({PROMPT_CHARS_ENV} raises the limit), got "
            f"{len(value):,} characters"
        )
    if type(value) is int and "max" in meta and value > meta["max"]:
        return f"an integer from {meta.get('min', 0)} to {meta['max']}, got {_show(value)}"
    shown = _show(value)
    if type(value) is float and math.isfinite(value) and abs(value) > FLOAT32_MAX:
        shown += f" (past float32's range, {FLOAT32_MAX:.1e}, which pipelines compute in)"
    return f"{_requirement(hint, meta)}, got {shown}"


def _argument_value(value: Any) -> bool:
    """A call argument a recipe can state: a finite number, a string, a boolean, or a list of them."""
    if isinstance(value, list | tuple):
        return all(_argument_value(v) and not isinstance(v, list | tuple) for v in value)
    return isinstance(value, bool | int | str) or (isinstance(value, float) and math.isfinite(value))


def _requirement(hint: Any, meta: Mapping[str, Any]) -> str:
    """What a key accepts, in words, for 'must be ...' messages."""
    hint, _ = _unwrap_optional(hint)
    bound = f" >= {meta['min']}" if "min" in meta else ""
    if hint is bool:
        return "true or false"
    if hint is int:
        return f"an integer{bound}"
    if hint is float:
        return f"a number{bound}"
    if hint is str:
        return "a string"
    if get_origin(hint) is Literal:
        choices = [str(c) for c in get_args(hint)]
        return " or ".join(choices) if len(choices) == 2 else f"one of {', '.join(choices)}"
    if hint == Mapping[str, str]:
        return 'a table of keyword = "file path"'
    if hint == Mapping[str, Any]:
        return "a table of keyword = value (numbers, strings, booleans or lists of them)"
    if hint == tuple[tuple[float, ...], ...]:
        return "a list of lists of positive numbers"
    return "a list of strings"


# --- formatting helpers -----------------------------------------------------------------------


def _suggest(word: Any, choices: Iterable[str], fmt: Callable[[str], str], kind: str) -> str:
    """' (did you mean X?)' for a near miss, else the valid names, so the user never has to guess."""
    choices = list(choices)
    close = difflib.get_close_matches(str(word), choices, n=1)
    return f" (did you mean {fmt(close[0])}?)" if close else f" (valid {kind}: {', '.join(choices)})"


def _name(key: Any) -> str:
    """A user-written name, quoted only when printing it raw could break the one-line message."""
    return key if isinstance(key, str) and key.isprintable() and key else repr(key)


def _show(value: Any) -> str:
    """A value as the user wrote it in TOML terms (true, not True), on one short line."""
    text = ("true" if value else "false") if isinstance(value, bool) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _plain(value: Any) -> Any:
    """Sections, variants, tuples and read-only mappings back to the dicts and lists TOML writes (no None)."""
    if isinstance(value, BenchVariant):
        return {"name": value.name, **_plain(value.overrides)}
    if dataclasses.is_dataclass(value):
        # An empty table is the default, so it is left out as None is.
        return {
            f.name: _plain(v)
            for f in dataclasses.fields(value)
            if (v := getattr(value, f.name)) is not None and not (isinstance(v, Mapping) and not v)
        }
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge: tables merge key by key, anything else (lists included) replaces."""
    out = dict(base)
    for key, value in top.items():
        old = out.get(key)
        out[key] = _merge(old, value) if isinstance(old, Mapping) and isinstance(value, Mapping) else value
    return out
