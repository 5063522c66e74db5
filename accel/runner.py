"""load → warm up → timed generation → save; what `accel run` does, returning Metrics."""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from accel.compose import apply
from accel.errors import UserError
from accel.media import save_image, save_video
from accel.models.base import Family, GenerationDefaults
from accel.models.loading import load_pipeline, resolve_device, resolve_dtype, resolve_model
from accel.optimize.compile import compiled_graphs
from accel.optimize.quantize import check_hardware
from accel.parallel.comm import TRAFFIC
from accel.parallel.mesh import init_distributed
from accel.models.registry import family_of
from accel.quality import psnr
from accel.recipe import Recipe
from accel.steps import StepEvents, StepListener


@dataclass
class Measurement:
    """One timed generation after its warm-up runs."""

    output: np.ndarray
    seconds: float
    warmup_seconds: float
    steps: int
    peak_memory_bytes: int
    # Bytes this rank sent through collectives during the timed run, by kind.
    bytes_sent: dict[str, int]
    # Graphs torch.compile built during the warm-up and during the timed run (None: not counted).
    graphs_warmup: int | None = None
    graphs_timed: int | None = None


@dataclass
class Metrics:
    """Everything `accel run` reports; `as_dict()` is the --json document."""

    model: str
    family: str
    output_kind: str
    device: str
    dtype: str
    settings: dict[str, Any]
    load_s: float
    warmup_s: float
    generate_s: float
    steps: int
    peak_memory_bytes: int
    peak_memory_kind: str
    output_path: str | None = None
    cache: dict[str, Any] | None = None
    # Context parallelism: degrees, whether they were chosen automatically, bytes this rank sent.
    parallel: dict[str, Any] | None = None
    # Quantization: scheme and layer counts; compile: scope, mode, graphs built (warm-up / timed).
    quant: dict[str, Any] | None = None
    compile: dict[str, Any] | None = None
    baseline_s: float | None = None
    psnr_db: float | None = None

    @property
    def per_step_s(self) -> float:
        return self.generate_s / self.steps if self.steps else float("nan")

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.generate_s if self.generate_s > 0 else float("nan")

    @property
    def speedup(self) -> float | None:
        return self.baseline_s / self.generate_s if self.baseline_s and self.generate_s > 0 else None

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(per_step_s=self.per_step_s, steps_per_s=self.steps_per_s, speedup=self.speedup)
        return data


def generation_kwargs(family: Family, tiny: bool, recipe: Recipe) -> dict[str, Any]:
    """The pipeline call's keyword arguments: recipe values over the family's (or tiny) defaults."""
    defaults: GenerationDefaults = (family.tiny_defaults if tiny else None) or family.defaults
    settings = recipe.generate

    def pick(name: str, default: Any) -> Any:
        value = getattr(settings, name)
        return default if value is None else value

    kwargs: dict[str, Any] = {
        "prompt": pick("prompt", defaults.prompt),
        "num_inference_steps": pick("steps", defaults.steps),
        "height": pick("height", defaults.height),
        "width": pick("width", defaults.width),
    }
    guidance = pick("guidance_scale", defaults.guidance_scale)
    if guidance is not None:
        kwargs["guidance_scale"] = guidance
    negative = pick("negative_prompt", defaults.negative_prompt)
    if negative is not None:
        kwargs["negative_prompt"] = negative
    if settings.true_cfg_scale is not None:
        if not family.true_cfg:
            raise UserError(f"[generate] true_cfg_scale: {family.title} pipelines have no true CFG scale")
        kwargs["true_cfg_scale"] = settings.true_cfg_scale
    if family.frames_arg is not None:
        kwargs[family.frames_arg] = pick("frames", defaults.frames)
    elif settings.frames is not None:
        raise UserError(f"[generate] frames: {family.title} makes images; remove frames")
    if recipe.parallel.cfg > 1 and (reason := family.cfg_off(kwargs)):
        raise UserError(f"[parallel] cfg = 2 splits the classifier-free guidance branches, but {reason}; turn guidance on or set cfg = 1")
    return kwargs


def generate(pipe: Any, kwargs: dict[str, Any], seed: int) -> np.ndarray:
    """One pipeline call from a fresh CPU generator: the same seed gives the same noise on any device."""
    generator = torch.Generator("cpu").manual_seed(seed)
    result = pipe(**kwargs, generator=generator, output_type="np")
    frames = getattr(result, "frames", None)
    output = frames if frames is not None else result.images
    return np.asarray(output)[0]


def measure(
    pipe: Any,
    kwargs: dict[str, Any],
    seed: int,
    warmup: int,
    progress: Callable[[str], AbstractContextManager[Any]] | None = None,
    label: str = "generating",
) -> Measurement:
    """Warm-up runs, then one timed run; bench and `run --compare` share this.

    `progress(label)` gives a context in which step events drive a bar (None: no bar)."""
    show = progress or (lambda _label: nullcontext())
    graphs_before = compiled_graphs()
    start = time.perf_counter()
    for index in range(warmup):
        with show(f"{label}: warm-up {index + 1}/{warmup}"):
            generate(pipe, kwargs, seed)
    warmup_seconds = time.perf_counter() - start
    graphs_warmed = compiled_graphs()
    device = _device_of(pipe)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    TRAFFIC.reset()
    with show(label):
        start = time.perf_counter()
        output = generate(pipe, kwargs, seed)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
    graphs_after = compiled_graphs()
    return Measurement(
        output, seconds, warmup_seconds, kwargs["num_inference_steps"], _peak_memory(device), dict(TRAFFIC.bytes_sent),
        _difference(graphs_warmed, graphs_before), _difference(graphs_after, graphs_warmed),
    )


def _difference(after: int | None, before: int | None) -> int | None:
    return after - before if after is not None and before is not None else None


def run(
    recipe: Recipe,
    *,
    out: Path | None = None,
    overwrite: bool = False,
    compare: bool = False,
    warmup: int = 1,
    progress: Callable[[str], Any] | None = None,
) -> Metrics:
    """Run the recipe's model once as `accel run` does. `progress(label)` returns a context manager
    that shows denoising progress (the CLI passes a rich bar; the API passes nothing)."""
    if warmup < 0:
        raise UserError(f"--warmup must be >= 0, got {warmup}")
    ref = resolve_model(recipe.model.name)
    _check_out(out, overwrite, ref.family)
    if ref.family is not None:
        generation_kwargs(ref.family, ref.tiny, recipe)  # refuse bad settings before a long load

    device = resolve_device(recipe.model.device)
    check_hardware(recipe.quant.type, device, resolve_dtype(recipe.model.dtype, ref))
    lead = True
    if recipe.parallel.world_size > 1:  # before loading: on CUDA it picks this rank's GPU
        lead = init_distributed(device.type, recipe.parallel.timeout)[0] == 0
    start = time.perf_counter()
    pipe = load_pipeline(recipe.model.name, recipe.model.dtype, device)
    load_s = time.perf_counter() - start
    family = family_of(pipe)
    pipe.set_progress_bar_config(disable=True)
    kwargs = generation_kwargs(family, ref.tiny, recipe)
    seed = recipe.generate.seed

    bar = (lambda label: _progress_over_steps(pipe, progress, label)) if progress else None

    baseline = measure(pipe, kwargs, seed, warmup, bar, "baseline") if compare else None
    handle = apply(pipe, recipe)
    try:
        result = measure(pipe, kwargs, seed, warmup, bar, "accelerated" if compare else "generating")
        stats = handle.cache_stats
        degrees = handle.degrees
        vae_split = handle.vae_decode is not None
        quant = handle.quant.as_dict() if handle.quant is not None else None
        compiled = sum(len(regions.modules) for regions in handle.compiled)
    finally:
        handle.remove()

    out_path = None
    if lead:  # every rank holds the output; one writes it
        _check_out(out, True, family)  # a hub id or folder reveals its family (image or video) only now
        out_path = _output_path(ref.name, family, out)
        if family.output == "video":
            save_video(result.output, out_path, family.fps)
        else:
            save_image(result.output, out_path)
    parallel = None
    if degrees is not None:
        parallel = {
            "world_size": degrees.world_size, "ulysses": degrees.ulysses, "ring": degrees.ring, "cfg": degrees.cfg,
            "chosen": recipe.parallel.chooses_degrees, "vae_split": vae_split,
            # Collectives inside compiled code are not counted (comm.Traffic): no partial figure.
            "bytes_sent_per_rank": None if recipe.compile.enabled else result.bytes_sent,
        }
    compile_info = None
    if recipe.compile.enabled:
        compile_info = {
            "scope": recipe.compile.scope, "mode": recipe.compile.mode, "compiled_modules": compiled,
            "graphs_warmup": result.graphs_warmup, "graphs_timed": result.graphs_timed,
        }
    device = _device_of(pipe)
    return Metrics(
        model=recipe.model.name,
        family=family.name,
        output_kind=family.output,
        device=str(device),
        dtype=str(pipe.transformer.dtype).removeprefix("torch."),
        settings=dict(kwargs, seed=seed),
        load_s=load_s,
        warmup_s=result.warmup_seconds,
        generate_s=result.seconds,
        steps=result.steps,
        peak_memory_bytes=result.peak_memory_bytes,
        peak_memory_kind="CUDA allocated" if device.type == "cuda" else "process RSS",
        output_path=str(out_path) if out_path is not None else None,
        cache=stats.as_dict() if stats is not None else None,
        parallel=parallel,
        quant=quant,
        compile=compile_info,
        baseline_s=baseline.seconds if baseline else None,
        psnr_db=psnr(result.output, baseline.output) if baseline else None,
    )


@contextmanager
def _progress_over_steps(pipe: Any, progress: Callable[[str], Any], label: str) -> Iterator[None]:
    """Feeds the caller's progress bar from the scheduler's step events."""
    with progress(label) as bar:
        listener = _BarListener(bar)
        events = StepEvents.of(pipe)
        events.add(listener)
        try:
            yield
        finally:
            events.remove(listener)


class _BarListener(StepListener):
    def __init__(self, bar: Any) -> None:
        self.bar = bar

    def on_generation_start(self, num_steps: int) -> None:
        self.bar.start(num_steps)

    def on_step_end(self, step_index: int) -> None:
        self.bar.advance()


def _suffix(family: Family) -> str:
    return ".mp4" if family.output == "video" else ".png"


def _check_out(out: Path | None, overwrite: bool, family: Family | None) -> None:
    """Refuse a bad --out before the (possibly long) load, not after the generation."""
    if out is None:
        return
    if out.exists() and not overwrite:
        raise UserError(f"{out} already exists; pass --overwrite to replace it or choose another --out")
    if family is not None and out.suffix.lower() != _suffix(family):
        raise UserError(f"--out {out}: {family.title} makes {family.output}s, so the name must end in {_suffix(family)}")


def _output_path(name: str, family: Family, out: Path | None) -> Path:
    """The file to write: `out` as given (already checked), else a fresh name under outputs/."""
    suffix = _suffix(family)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        return out
    folder = Path("outputs")
    folder.mkdir(exist_ok=True)
    stem = Path(name).name or "output"
    candidate, index = folder / f"{stem}{suffix}", 1
    while candidate.exists():
        candidate, index = folder / f"{stem}-{index}{suffix}", index + 1
    return candidate


def _device_of(pipe: Any) -> torch.device:
    return next(pipe.transformer.parameters()).device


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
