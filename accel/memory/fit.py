"""`accel run` / `accel serve` / `accel bench` on a flagship checkpoint: the plan's layout when none is
given, and a layout that will not fit refused before any rank starts or any weight is read.

Applies where the model is a flagship the plan knows (its alias or its repo) and the GPU memory is
known: `--gpu-memory`, else the visible GPU's. `--gpus N` with no degrees and the default placement
lets the plan choose degrees and placement; anything else given is checked as given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from accel.errors import UserError
from accel.recipe import Recipe

GIB = 2**30
# The plan's peak per GPU, handed from the launcher to the ranks it starts (the table shows it).
PLANNED_PEAK = "ACCEL_PLANNED_PEAK"


@dataclass(frozen=True)
class Planned:
    """The recipe to run, the plan's peak per GPU in bytes (None: no plan applies), and the flags that
    give the ranks the plan's layout."""

    recipe: Recipe
    peak: int | None
    flags: tuple[str, ...] = ()


def flagship_key(model: str) -> str | None:
    """The flagship a model name stands for: the checkpoint's repo, or the family alias ("flux2") where
    the alias loads that checkpoint (`kandinsky5` loads Lite, `wan` Wan 2.1, `ltx` 0.9.x 2B: their
    flagships are other checkpoints, which the plan must not lay out in their place)."""
    from accel.models.flagships import FLAGSHIPS, flagship_of_repo
    from accel.models.registry import FAMILIES

    if model in FLAGSHIPS:
        return model if model in FAMILIES and FAMILIES[model].repo == FLAGSHIPS[model].repo else None
    return flagship_of_repo(model)


def _checked_gpu_memory(given: float | None) -> float | None:
    if given is not None and not given > 0:
        raise UserError(f"--gpu-memory must be a positive number of GiB, got {given:g}")
    return given


def visible_gpu_gib(device: str) -> float | None:
    """The first visible GPU's memory, from nvidia-smi: asking torch would create a CUDA context in the
    launcher, which then holds GPU memory on rank 0's card for the whole job."""
    import os
    import subprocess

    if device not in ("cuda", "auto"):
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    command = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"] + (
        [f"--id={visible}"] if visible else []
    )
    try:
        lines = subprocess.run(command, capture_output=True, text=True, timeout=20, check=True).stdout.split()
        return float(lines[0]) / 1024 if lines else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def layout_flags(candidate: object) -> tuple[str, ...]:
    """The `accel run` flags that give a layout: degrees above 1, CFG parallel, the encoders' place."""
    degrees = candidate.degrees  # type: ignore[attr-defined]
    parts = [
        part
        for name in ("tp", "ulysses", "ring")
        if getattr(degrees, name) > 1
        for part in (f"--{name}", str(getattr(degrees, name)))
    ]
    parts += ["--cfg-parallel"] if degrees.cfg > 1 else []
    parts += ["--text-encoder", candidate.text_encoder] if candidate.text_encoder != "replicated" else []  # type: ignore[attr-defined]
    parts += ["--offload", candidate.offload] if candidate.offload != "none" else []  # type: ignore[attr-defined]
    parts += ["--parallel-vae"] if candidate.vae_parallel else []  # type: ignore[attr-defined]
    parts += ["--vae-tiling"] if candidate.vae_tiling else []  # type: ignore[attr-defined]
    return tuple(parts)


def layout_keys(candidate: object) -> str:
    """A layout as recipe keys, for a bench variant (which takes no layout flags)."""
    degrees = candidate.degrees  # type: ignore[attr-defined]
    parallel = [
        f"{name} = {getattr(degrees, name)}" for name in ("tp", "ulysses", "ring", "cfg") if getattr(degrees, name) > 1
    ]
    memory = [
        f'{key} = "{getattr(candidate, key)}"'
        for key, default in (("text_encoder", "replicated"), ("offload", "none"))
        if getattr(candidate, key) != default
    ]
    parts = ([f"parallel = {{ {', '.join(parallel)} }}"] if parallel else []) + (
        [f"memory = {{ {', '.join(memory)} }}"] if memory else []
    )
    decode = [f"{key} = true" for key in ("parallel", "tiling") if getattr(candidate, f"vae_{key}")]
    parts += [f"vae = {{ {', '.join(decode)} }}"] if decode else []
    return ", ".join(parts) or "one process"


def fitted(recipe: Recipe, gpu_memory: float | None, spell: Callable[[object], str] | None = None) -> Planned:
    """`recipe` with the plan's layout where it leaves the choice to accel, with the plan's peak per GPU;
    an explicit layout that does not fit is refused in one line, naming one that fits as `spell` writes
    it (default: the command line's flags)."""
    given = _checked_gpu_memory(gpu_memory)
    key = flagship_key(recipe.model.name)
    if key is None:
        return Planned(recipe, None)
    limit = given if given is not None else visible_gpu_gib(recipe.model.device)
    if limit is None:
        return Planned(recipe, None)
    from accel.memory.candidates import RESERVED, Candidate, fastest_fitting
    from accel.memory.plan import estimate_of, make_plan
    from accel.models.flagships import FLAGSHIPS, Size, flagship_heads
    from accel.parallel.mesh import resolve_degrees

    flagship, settings = FLAGSHIPS[key], recipe.parallel
    generate = recipe.generate
    size = Size(
        generate.width or flagship.size.width,
        generate.height or flagship.size.height,
        (generate.frames or flagship.size.frames) if flagship.size.frames else None,
    )
    plan = make_plan(key, recipe.world_size, limit, size, recipe.quant, recipe.vae.tiling, recipe.vae.parallel)
    # Offload does not compose with compile (accel.recipe.refusals.offload_refusal): a compiled run takes no
    # offloaded layout; nor does a decode split over the ranks with the VAE on the first rank alone ([memory]
    # vae = "rank0").
    allowed = tuple(
        c
        for c in plan.candidates
        if (c.offload == "none" or not recipe.compile.enabled) and (not c.vae_parallel or recipe.memory.vae != "rank0")
    )
    chosen = fastest_fitting(allowed, plan.gpu_memory)
    where = f"{recipe.world_size} GPU{'s' if recipe.world_size > 1 else ''} of {limit:g} GiB"
    leaves_choice = settings.chooses_degrees or recipe.world_size == 1
    memory = recipe.memory
    if (
        leaves_choice
        and settings.tp == 1
        and settings.cfg == 1
        and memory.text_encoder == "replicated"
        and memory.offload == "none"
    ):
        if chosen is None:
            smallest = min(allowed, key=lambda c: c.estimate.peak)
            raise UserError(
                f"{flagship.title} at {size.describe()} fits no layout of {where}: the smallest needs "
                f"{(smallest.estimate.peak + RESERVED) / GIB:.1f} GiB per GPU ({smallest.describe()}); "
                f"use more GPUs or larger ones"
            )
        degrees = chosen.degrees
        parallel = dataclasses.replace(
            settings, ulysses=degrees.ulysses, ring=degrees.ring, cfg=degrees.cfg, tp=degrees.tp, gpus=recipe.world_size
        )
        memory = dataclasses.replace(memory, text_encoder=chosen.text_encoder, offload=chosen.offload)
        vae = dataclasses.replace(
            recipe.vae,
            tiling=recipe.vae.tiling or chosen.vae_tiling,
            parallel=recipe.vae.parallel or chosen.vae_parallel,
        )
        return Planned(
            dataclasses.replace(recipe, parallel=parallel, memory=memory, vae=vae),
            chosen.estimate.peak + RESERVED,
            layout_flags(chosen),
        )
    degrees = resolve_degrees(settings, flagship_heads(key), recipe.model.name)  # as the run will lay it out
    placement = (
        memory.text_encoder if memory.text_encoder in ("cpu", "sharded") else "replicated"
    )  # rank0's busiest rank holds them too
    # [memory] vae = "rank0" changes no number either: the busiest rank, rank 0, still holds the VAE and decodes.
    asked: Candidate = next(
        (
            c
            for c in plan.candidates
            if c.degrees == degrees
            and c.text_encoder == placement
            and c.offload == memory.offload
            and c.vae_tiling == recipe.vae.tiling
            and c.vae_parallel == (recipe.vae.parallel and degrees.world_size > 1)
        ),
        None,
    ) or estimate_of(
        key, degrees, placement, size, memory.offload, limit, recipe.quant, recipe.vae.tiling, recipe.vae.parallel
    )
    peak = asked.estimate.peak + RESERVED
    if peak > limit * GIB:
        written = (
            ""
            if chosen is None
            else spell(chosen)
            if spell is not None
            else " ".join(layout_flags(chosen)) or "one process"
        )
        fits = (
            f"a layout that fits: {written}"
            if chosen is not None
            else f"no layout of {where} fits; use more GPUs or larger ones"
        )
        raise UserError(
            f"{flagship.title} at {size.describe()} needs {peak / GIB:.1f} GiB per GPU as laid out "
            f"({asked.describe()}), more than the {limit:g} GiB of each GPU; {fits}"
        )
    return Planned(recipe, peak)


def planned_here(recipe: Recipe, gpu_memory: float | None) -> Planned:
    """`fitted` once per job: on the launcher (or a lone process), which hands the peak to the ranks
    it starts through the environment and the layout through `flags`; a rank takes both from there
    rather than planning again (seconds on every rank, and nvidia-smi on every node)."""
    import os

    from accel.parallel.mesh import under_distributed_launcher

    if under_distributed_launcher():
        peak = os.environ.get(PLANNED_PEAK)
        return Planned(recipe, int(peak) if peak else None)
    planned = fitted(recipe, gpu_memory)
    if planned.peak is not None:
        os.environ[PLANNED_PEAK] = str(planned.peak)
    else:
        os.environ.pop(PLANNED_PEAK, None)  # an earlier plan of this process must not reach these ranks
    return planned


# The plan's changes to named recipes (a bench's variants) and their peaks, from the launcher to the
# ranks as JSON: a recipe file's variants cannot be given as flags.
PLANNED_RECIPES = "ACCEL_PLANNED_RECIPES"


def planned_each(
    recipes: Mapping[str, Recipe], gpu_memory: float | None, label: Callable[[str], str]
) -> dict[str, Planned]:
    """`planned_here` for several recipes run in one job: each fitted on the launcher, a refusal
    naming the recipe by `label(name)`; the ranks take each one's changes from the environment."""
    import json
    import os

    from accel.parallel.mesh import under_distributed_launcher

    if under_distributed_launcher():
        handed = json.loads(os.environ.get(PLANNED_RECIPES) or "{}")
        return {name: _taken(recipe, handed.get(name)) for name, recipe in recipes.items()}
    _checked_gpu_memory(gpu_memory)
    planned: dict[str, Planned] = {}
    for name, recipe in recipes.items():
        try:
            planned[name] = fitted(recipe, gpu_memory, layout_keys)
        except UserError as error:
            raise type(error)(f"{label(name)}: {error}") from None
    os.environ[PLANNED_RECIPES] = json.dumps(
        {
            name: {"peak": fit.peak, "changes": _changes(recipes[name], fit.recipe)}
            for name, fit in planned.items()
            if fit.peak is not None
        }
    )
    return planned


def _changes(before: Recipe, after: Recipe) -> dict[str, dict[str, Any]]:
    """What the plan changed, as a partial recipe `Recipe.with_overrides` takes."""
    old, new = before.to_dict(), after.to_dict()
    return {
        section: {key: value for key, value in keys.items() if old[section].get(key) != value}
        for section, keys in new.items()
        if keys != old[section]
    }


def _taken(recipe: Recipe, handed: dict[str, Any] | None) -> Planned:
    if handed is None:
        return Planned(recipe, None)
    return Planned(
        recipe.with_overrides(handed["changes"], source="accel plan") if handed["changes"] else recipe, handed["peak"]
    )
