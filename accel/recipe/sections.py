"""The recipe's sections: one frozen dataclass per TOML table, each field a key declared with its
default, help line, bounds and command-line spelling (a declarative table; accel.recipe.checks reads
the annotations to validate)."""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from accel.recipe.keys import Flag, key, table
from accel.recipe.limits import MAX_FRAMES, MAX_PIXELS_SIDE, MAX_SEED, MAX_STEPS


@dataclass(frozen=True)
class ModelSection:
    """Which pipeline to load and where."""

    name: str = key("", "Model family alias or Hugging Face repo id; empty means given on the command line.")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = key(
        "auto", "Weight dtype; auto uses the family's default.", flag=Flag(help="auto, float32, float16 or bfloat16.")
    )
    device: Literal["auto", "cpu", "cuda"] = key(
        "auto", "Where to run; auto picks cuda when available.", flag=Flag(help="auto, cpu or cuda.")
    )
    pipeline: str = key(
        "",
        "Pipeline class to run the model as (FluxKontextPipeline, QwenImageEditPipeline, …); empty: the model's own.",
        flag=Flag(metavar="CLASS", help="Pipeline class to run the model as, e.g. FluxKontextPipeline."),
    )
    lora: tuple[str, ...] | None = key(
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
    components: Mapping[str, str] = table(
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

    prompt: str | None = key(None, "Text prompt.", prompt=True, flag=Flag(alias="-p"))
    negative_prompt: str | None = key(None, "Negative prompt, for pipelines that take one.", prompt=True)
    steps: int | None = key(None, "Number of denoising steps.", min=1, max=MAX_STEPS)
    height: int | None = key(None, "Output height in pixels.", min=16, max=MAX_PIXELS_SIDE)
    width: int | None = key(None, "Output width in pixels.", min=16, max=MAX_PIXELS_SIDE)
    frames: int | None = key(None, "Number of frames (video families).", min=1, max=MAX_FRAMES)
    guidance_scale: float | None = key(
        None, "Classifier-free (or distilled) guidance scale.", min=0, flag=Flag(name="--guidance")
    )
    true_cfg_scale: float | None = key(
        None,
        "FLUX true CFG scale; above 1 runs the negative prompt too.",
        min=1,
        flag=Flag(
            name="--true-cfg", help="True CFG scale (FLUX, HunyuanVideo): above 1 also runs the negative prompt."
        ),
    )
    image: str | None = key(
        None,
        "Input image file, for pipelines that edit or start from one (img2img, inpaint, Kontext, edit).",
        flag=Flag(metavar="PATH", shown="none"),
    )
    mask: str | None = key(
        None,
        "Mask image file (white: repaint), for inpaint and fill pipelines; a picture or a video of per-frame masks "
        "for VACE.",
        flag=Flag(metavar="PATH", shown="none"),
    )
    video: str | None = key(
        None,
        "Input video file (MP4, WebM, …), for video-to-video, editing and VACE pipelines.",
        flag=Flag(metavar="PATH", shown="none"),
    )
    seed: int = key(0, "Random seed, so runs and variants are comparable.", min=0, max=MAX_SEED)
    conditions: tuple[str, ...] | None = key(
        None,
        "Pictures or clips pinned to positions, for pipelines that take conditions (LTX-2, LTX-Video): "
        '"PATH@INDEX:STRENGTH", INDEX and STRENGTH optional (0 and 1); the pipeline says what INDEX counts.',
        flag=Flag(
            name="--condition",
            metavar="PATH@INDEX:STRENGTH",
            help="A picture or clip pinned to a position (LTX-2, LTX-Video condition pipelines); repeatable.",
        ),
    )
    references: tuple[str, ...] | None = key(
        None,
        'Reference pictures or clips without a position, for in-context pipelines (LTX-2 IC-LoRA): "PATH@STRENGTH", '
        "STRENGTH optional (1); or more pictures after image, for pipelines that combine several (FLUX.2, "
        "Qwen-Image-Edit-Plus): PATH.",
        flag=Flag(
            name="--reference",
            metavar="PATH@STRENGTH",
            help="A reference picture or clip without a position (LTX-2 IC-LoRA), or a picture after --image for "
            "pipelines that combine several (FLUX.2, Qwen-Image-Edit-Plus); repeatable.",
        ),
    )
    inputs: Mapping[str, str] = table(
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
    arguments: Mapping[str, Any] = table(
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

    threshold: float = key(
        0.0,
        "Skip the cached blocks while the first blocks' residual changes less than this (relative mean absolute "
        "difference); 0 is off.",
        min=0,
        flag=Flag(name="--cache", metavar="THRESHOLD", help="Cache threshold (0 = off)."),
    )
    method: Literal["fbcache", "dbcache", "taylorseer", "magcache"] = key(
        "fbcache",
        "fbcache: block 0 decides, every later block is cached; dbcache: the first first_blocks decide and "
        "always run, the last last_blocks always run, the blocks between are cached; taylorseer: inside every block, "
        "attention and feed-forward outputs are computed every interval steps and extrapolated between (no threshold); "
        "magcache: whole calls are skipped while the calibrated residual-magnitude curve's accumulated error stays "
        "under the threshold.",
        flag=Flag(name="--cache-method", metavar="METHOD", help="fbcache, dbcache, taylorseer or magcache."),
    )
    first_blocks: int = key(
        1,
        "dbcache: blocks always computed at the start, whose residual drives the decision.",
        min=1,
        flag=Flag(metavar="N", help="dbcache: blocks always computed first; they decide."),
    )
    last_blocks: int = key(
        0,
        "dbcache: blocks always computed at the end, on the cached middle's output.",
        min=0,
        flag=Flag(metavar="N", help="dbcache: blocks always computed last."),
    )
    calibrator: Literal["none", "taylorseer"] = key(
        "none",
        "fbcache / dbcache: what a cached call adds for the skipped blocks: none reuses their last computed "
        "residual, taylorseer extrapolates it from the last computed ones (finite differences over the steps).",
        flag=Flag(metavar="NAME", help="none (reuse the skipped blocks' residual) or taylorseer (extrapolate it)."),
    )
    taylor_order: Literal[1, 2] = key(
        1,
        "taylorseer (method or calibrator): order of the extrapolation (1 linear, 2 quadratic).",
        flag=Flag(metavar="N", help="taylorseer: 1 or 2."),
    )
    interval: int = key(
        3,
        "taylorseer: compute every interval-th step, extrapolate the steps between.",
        min=2,
        flag=Flag(metavar="N", help="taylorseer: compute every N-th step, extrapolate between."),
    )
    disable_before: int = key(0, "taylorseer: steps before this one are always computed.", min=0)
    disable_after: int = key(0, "taylorseer: steps from this one on are always computed; 0 means none.", min=0)
    interval_offset: int = key(
        0,
        "taylorseer: the first interval-th step comes this many steps after disable_before, the steps between "
        "extrapolated (diffusers' TaylorSeer schedule is 1, with extrapolate_early); below interval.",
        min=0,
    )
    extrapolate_early: bool = key(
        False,
        "taylorseer: extrapolate once a module has one computed output, at the order its outputs so far allow "
        "(the first extrapolated step reuses it, as diffusers' TaylorSeer does); false computes the first "
        "taylor_order + 1 steps.",
    )
    mag_ratios: tuple[tuple[float, ...], ...] = key(
        (),
        "magcache: the pipeline's residual-magnitude ratio per step, one list per CFG branch; accel tune RECIPE "
        "--calibrate measures them and writes them here.",
    )
    warmup_steps: int = key(0, "Steps always computed in full before caching may start.", min=0)
    max_consecutive_cached: int = key(0, "Most cached steps in a row before one full step; 0 means no limit.", min=0)
    max_cached_steps: int = key(
        0,
        "Most cached calls per generation (per CFG branch); 0 means no limit.",
        min=0,
        flag=Flag(metavar="N", help="Most cached calls per generation (0 = no limit)."),
    )


@dataclass(frozen=True)
class ParallelSection:
    """Context and tensor parallelism: one process per GPU (gloo ranks on a CPU-only machine)."""

    gpus: int = key(
        0,
        "Processes (GPUs); 0 means ulysses × ring × cfg × tp. With gpus set and no ulysses or ring, those two are "
        "chosen to fill gpus / (cfg × tp): Ulysses over all of them when it divides the head count or pads it by at "
        "most 25 %, else the largest degree dividing both and the rest Ring.",
        min=0,
    )
    ulysses: int = key(
        1,
        "Ulysses (all-to-all head) parallel degree; at most the head count, which it need not "
        "divide (heads are padded).",
        min=1,
        flag=Flag(help="Ulysses degree.", shown="{recipe}, or chosen for --gpus"),
    )
    ring: int = key(
        1,
        "Ring attention parallel degree.",
        min=1,
        flag=Flag(help="Ring degree.", shown="{recipe}, or chosen for --gpus"),
    )
    cfg: Literal[1, 2] = key(
        1,
        "2 runs the conditional and unconditional CFG branches on separate GPUs.",
        flag=Flag(name="--cfg-parallel", help="Run CFG halves on separate ranks.", shown="recipe, else off", switch=2),
    )
    tp: int = key(
        1,
        "Tensor-parallel degree: each block's attention heads and MLP width are split over tp GPUs, "
        "which hold 1/tp of those weights each; it must divide the heads and every split width.",
        min=1,
        flag=Flag(help="Tensor-parallel degree: each block's heads and MLP width split over tp ranks."),
    )
    timeout: float = key(
        600.0,
        "Seconds a collective may wait for the other ranks before the job fails, naming the rank it waited for.",
        min=1,
    )
    plan: Literal["family", "automatic"] = key(
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

    parallel: bool = key(
        False,
        "Split the VAE decode across every GPU of the job (exact: equals the one-GPU decode).",
        flag=Flag(name="--parallel-vae", help="Split the VAE decode over the ranks."),
    )
    tiling: bool = key(
        False,
        "Decode in tiles to bound memory (with parallel, each tile is split).",
        flag=Flag(name="--vae-tiling", help="Decode in tiles (the VAE's own tiling) to bound the decode's memory."),
    )
    all_ranks: bool = key(False, "With parallel: every rank gets the decoded pixels, not only rank 0.")


@dataclass(frozen=True)
class QuantSection:
    """Weight (and optionally activation) quantization of the transformer via torchao."""

    type: Literal["none", "int8wo", "int8dq", "fp8dq", "fp8wo", "int4wo"] = key(
        "none",
        "Quantization scheme; none keeps the model dtype.",
        flag=Flag(name="--quant", help="none, int8wo, int8dq, fp8dq, fp8wo or int4wo."),
    )
    scope: Literal["blocks", "transformer"] = key(
        "blocks",
        "Quantize the repeated blocks' Linear layers (embedders and output layers keep the model dtype) or every "
        "Linear layer.",
    )
    exclude: tuple[str, ...] = key(
        (), 'Module-name patterns left unquantized (fnmatch, * also spans dots: "*.norm1.linear").'
    )


@dataclass(frozen=True)
class CompileSection:
    """torch.compile options."""

    enabled: bool = key(
        False,
        "Compile the transformer with torch.compile (the first run compiles; it is timed as warm-up).",
        flag=Flag(name="--compile", help="torch.compile the transformer blocks."),
    )
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = key(
        "default", "torch.compile mode."
    )
    scope: Literal["blocks", "transformer"] = key(
        "blocks", "Compile the repeated blocks (one graph per block class, fast to compile) or the whole transformer."
    )
    backend: Literal["inductor", "aot_eager", "eager"] = key(
        "inductor",
        "torch.compile backend: inductor generates kernels; aot_eager and eager trace the same graphs (graph "
        "breaks, recompiles) and run them with torch's own kernels, in seconds, to find what stops a compile.",
    )


@dataclass(frozen=True)
class MemorySection:
    """Where the large components live, so that a model fits the GPUs there are."""

    text_encoder: Literal["replicated", "rank0", "cpu", "sharded"] = key(
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
    vae: Literal["replicated", "rank0"] = key(
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
    offload: Literal["none", "model", "group"] = key(
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


@dataclass(frozen=True)
class BenchVariant:
    """One benchmark variant: a name plus a validated partial override of the other sections."""

    name: str
    # Read-only so a frozen recipe stays immutable; excluded from hashing since mappings cannot hash.
    overrides: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: types.MappingProxyType({}), hash=False)


@dataclass(frozen=True)
class BenchSection:
    """Benchmark: variants of the recipe, measured the same way and compared with the first."""

    variants: tuple[BenchVariant, ...] = key(
        (), 'Variants to compare, each {name = "...", <section> = {<key> = ...}}; the first is the baseline.'
    )
    repeats: int = key(3, "Timed runs per variant.", min=1)
    warmup: int = key(1, "Untimed runs per variant before timing (compilation, caches).", min=0)


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
