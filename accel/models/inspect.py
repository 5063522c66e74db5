"""What accel finds in a model (`accel inspect MODEL`): its pipeline, transformers, blocks, streams,
where its context-parallel plan comes from and which accelerators apply.

A tiny alias is built (a second); anything else is read without weights: a folder's or a hub id's
model_index.json and transformer configs, else a registry family's flagship configs (accel plan's),
the transformers built on the meta device to count their blocks. A pipeline no family knows is
described from its transformer itself (accel/models/discover.py: the block lists, what declared
them, what the blocks return where diffusers' registry says, the class's own `_cp_plan`), with
`tested` false and `generic` saying what the generic path (accel/models/generic.py) gives it at
load: cache, quantization and compile over the blocks found, context parallelism from the class's
own `_cp_plan` where accel can follow it (its streams learned), else the automatic plan (either
verified on simulated ranks at first use; `verdicts` lists the layouts already verified or refused
here, and which source each used); `refused` says why nothing applies where the transformer has no repeated blocks.

The JSON (`as_json`), a stable shape:

    {"model": str, "source": "tiny" | "registry" | "folder" | "hub", "pipeline": str,
     "family": {"name": str | null, "title": str, "tested": bool},
     "refused": str | null, "generic": str | null,
     "transformers": [{"attr": str, "class": str, "heads": int | null,
                       "blocks": [{"attr": str, "count": int | null, "class": str | null, "returns": [str] | null,
                                   "found_by": "family" | "_repeated_blocks" | "_no_split_modules" | "structure",
                                   "unknown": str | null}]}],
     "streams": [str], "primary_stream": str | null,
     "parallel": {"plan": "accel family plan" | "diffusers _cp_plan" | "automatic" | null, "heads": int | null,
                  "cfg_style": "batch" | "calls" | null,
                  "modes": {"ulysses": bool, "ring": bool, "cfg": bool, "tp": bool},
                  "refused": {mode: why},
                  "verdicts": [{"ulysses": int, "ring": int, "exact": bool, "reason": str | null,
                                "source": "diffusers _cp_plan" | "automatic" | null}]},
     "accelerators": {"cache": [str], "quant": [str], "compile": "regional" | null, "vae_tiling": bool,
                      "vae": {"class": str | null, "parallel": bool, "method": str | null},
                      "text_encoders": [str], "placement": {"text_encoder": [str], "vae": [str]}}}
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accel.cache.config import CACHE_METHODS
from accel.errors import ModelError
from accel.models.base import BlockList, Family
from accel.parallel.plan_format import AutomaticPlan, FromDiffusers, ParallelPlan
from accel.models.folder_check import read_index, read_json
from accel.models.refs import ModelRef, resolve_model
from accel.models.registry import lookup
from accel.models.vaes import vae_plan

PLAN_SOURCES = {ParallelPlan: "accel family plan", FromDiffusers: "diffusers _cp_plan", AutomaticPlan: "automatic"}


@dataclass(frozen=True)
class Blocks:
    attr: str
    count: int | None
    cls: str | None
    returns: tuple[str, ...] | None  # None: not known (`unknown` says why)
    found_by: str = "family"
    unknown: str = ""


@dataclass(frozen=True)
class Transformer:
    attr: str
    cls: str
    heads: int | None
    blocks: tuple[Blocks, ...]
    plan: ParallelPlan | FromDiffusers | AutomaticPlan | None
    # The class ships a diffusers `_cp_plan` accel can read (tried before the automatic plan where no family knows it).
    own_cp_plan: bool = False
    # The automatic plan's verdicts kept on disk for this class and config (accel/parallel/verdicts.py).
    verdicts: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class Found:
    """What accel found in a model, before any accelerator is applied."""

    model: str
    source: str
    pipeline: str
    family: Family | None  # None: no family knows this pipeline (described from the model itself)
    transformers: tuple[Transformer, ...]
    vae: str | None
    text_encoders: tuple[str, ...]


@dataclass(frozen=True)
class _Classes:
    """A pipeline as named by its index: class names and configs, no weights."""

    pipeline: str
    transformers: tuple[tuple[str, str, dict[str, Any] | None], ...]  # (attr, class, config)
    vae: str | None
    text_encoders: tuple[str, ...]


def inspect_model(name: str) -> Found:
    """What accel finds in `name` (a registry alias, hub id or folder); a ModelError for bad input."""
    ref = resolve_model(name)
    if ref.tiny and ref.family is not None:
        return _of_pipeline(name, ref.family, ref.family.tiny())  # type: ignore[misc]
    classes = _classes(ref)
    family = ref.family or _family_of(classes)
    source = "folder" if Path(ref.source).is_dir() else ("registry" if lookup(name) is not None else "hub")
    if family is None:
        transformers = tuple(_discovered(attr, cls, config) for attr, cls, config in classes.transformers)
        return Found(name, source, classes.pipeline, None, transformers, classes.vae, classes.text_encoders)
    transformers = tuple(_transformer(family, attr, cls, config) for attr, cls, config in classes.transformers)
    return Found(name, source, classes.pipeline, family, transformers, classes.vae, classes.text_encoders)


def _family_of(classes: _Classes) -> Family | None:
    """The family of the named classes (None: none knows them); a pipeline without a transformer is refused."""
    from accel.models.registry import family_of_classes

    if not classes.transformers:
        raise ModelError(f"{classes.pipeline} has no transformer component: accel accelerates diffusion transformers")
    return family_of_classes(classes.transformers[0][1], classes.pipeline)


def _discovered(attr: str, cls: str, config: dict[str, Any] | None) -> Transformer:
    """A transformer no family describes, found from its class and config (built on meta)."""
    import diffusers

    if config is None or not hasattr(diffusers, cls):
        raise ModelError(f"{cls} ({attr}) is not a diffusers model class with a config here: accel cannot describe it")
    from accel.memory.estimate import build
    from accel.models.discover import discover_blocks
    from accel.models.flagships import Component
    from accel.parallel.derive import readable_cp_plan

    model = build(Component(attr, "diffusers", cls, config))
    discovery = discover_blocks(model)  # a UserError in one line where the model has no repeated blocks
    blocks = tuple(
        Blocks(item.attr, item.count, item.block_class, item.returns, item.found_by, item.unknown)
        for item in discovery.lists
    )
    heads = config.get("num_attention_heads")
    return Transformer(
        attr,
        cls,
        heads if isinstance(heads, int) else None,
        blocks,
        AutomaticPlan(),
        readable_cp_plan(type(model)),
        _verdicts(model),
    )


def _of_pipeline(name: str, family: Family, pipe: Any) -> Found:
    """A built pipeline's classes and modules (the tiny variants)."""
    transformers = []
    for attr in family.transformer_attrs:
        model = getattr(pipe, attr, None)
        if model is None:
            continue
        blocks = tuple(_blocks_of(model, block) for block in family.blocks)
        transformers.append(
            Transformer(
                attr,
                type(model).__name__,
                family.heads_in(model.config),
                blocks,
                family.plan_for(model),
                verdicts=_verdicts(model),
            )
        )
    vae = getattr(pipe, "vae", None)
    encoders = tuple(
        sorted(key for key in pipe.components if key.startswith("text_encoder") and pipe.components[key] is not None)
    )
    return Found(
        name,
        "tiny",
        type(pipe).__name__,
        family,
        tuple(transformers),
        type(vae).__name__ if vae is not None else None,
        encoders,
    )


def _blocks_of(model: Any, block: BlockList) -> Blocks:
    modules = getattr(model, block.attr, None)
    if modules is None:
        return Blocks(block.attr, None, None, block.returns)
    return Blocks(block.attr, len(modules), type(modules[0]).__name__ if len(modules) else None, block.returns)


def _transformer(family: Family, attr: str, cls: str, config: dict[str, Any] | None) -> Transformer:
    """A transformer known by class and config: built on meta (no memory) to count its blocks."""
    plan = next((v.parallel for v in family.variants if v.transformer_class == cls), family.parallel)
    if config is None:
        return Transformer(
            attr, cls, family.heads, tuple(Blocks(b.attr, None, None, b.returns) for b in family.blocks), plan
        )
    from accel.memory.estimate import build
    from accel.models.flagships import Component

    model = build(Component(attr, "diffusers", cls, config))
    return Transformer(
        attr,
        cls,
        family.heads_in(model.config),
        tuple(_blocks_of(model, block) for block in family.blocks),
        plan,
        verdicts=_verdicts(model),
    )


def _verdicts(model: Any) -> tuple[dict[str, Any], ...]:
    """The automatic plan's verdicts kept for this model's class and config (accel/parallel/verdicts.py)."""
    from accel.models.generic import config_hash
    from accel.parallel.verdicts import verdicts_for

    return tuple(verdicts_for(type(model).__name__, config_hash(model)))


def _classes(ref: ModelRef) -> _Classes:
    folder = Path(ref.source)
    if folder.is_dir():
        index = read_index(folder)
        return _from_index(index, lambda attr: _folder_config(folder, attr))
    from accel.models.flagships import FLAGSHIPS, flagship_of_repo
    from accel.models.refs import _cached_json

    if ref.family is None or ref.source != ref.family.repo:
        index = _cached_json(ref.source, "model_index.json")
        if index is not None:
            return _from_index(index, lambda attr: _cached_json(ref.source, f"{attr}/config.json"))
    key = ref.family.name if ref.family is not None and ref.source == ref.family.repo else flagship_of_repo(ref.source)
    if key is not None and key in FLAGSHIPS:
        flagship = FLAGSHIPS[key]
        from accel.models.registry import FAMILIES

        vae = next((c.cls for c in flagship.of_kind("vae")), None)
        transformers = tuple((c.attr, c.cls, dict(c.config)) for c in flagship.of_kind("transformer"))
        return _Classes(
            FAMILIES[key].pipeline_class, transformers, vae, tuple(c.attr for c in flagship.of_kind("text_encoder"))
        )
    if ref.family is not None:  # a family without a flagship config: its class names alone
        family = ref.family
        return _Classes(
            family.pipeline_class, ((family.transformer_attrs[0], family.transformer_class, None),), family.vae, ()
        )
    return _from_index(
        _hub_json(ref.source, "model_index.json"), lambda attr: _hub_json(ref.source, f"{attr}/config.json")
    )


def _folder_config(folder: Path, attr: str) -> dict[str, Any] | None:
    path = folder / attr / "config.json"
    return read_json(path) if path.is_file() else None


def _hub_json(repo: str, filename: str) -> dict[str, Any]:
    """A small JSON file of a hub repo (no weights), downloaded; a ModelError in one line when it cannot be."""
    from huggingface_hub import hf_hub_download

    try:
        path = hf_hub_download(repo, filename)
    except Exception as error:  # noqa: BLE001 - offline, gated, missing: one line says which
        raise ModelError(
            f"cannot read {repo}'s {filename} ({type(error).__name__}); download the pipeline and pass its folder"
        ) from None
    return read_json(Path(path))


def _from_index(index: dict[str, Any], config_of: Callable[[str], dict[str, Any] | None]) -> _Classes:
    def named(key: str) -> str | None:
        entry = index.get(key)
        return str(entry[-1]) if isinstance(entry, list) and len(entry) == 2 and entry[-1] else None

    keys = sorted(key for key in index if not key.startswith("_"))
    transformers = tuple(
        (key, cls, config_of(key)) for key in keys if key.startswith("transformer") and (cls := named(key))
    )
    encoders = tuple(key for key in keys if key.startswith("text_encoder") and named(key))
    return _Classes(str(index.get("_class_name")), transformers, named("vae"), encoders)


def _streams(plan: ParallelPlan | FromDiffusers | None) -> tuple[str, ...]:
    if isinstance(plan, ParallelPlan):
        cut = [stream for split in plan.splits for stream in split.streams]
    elif isinstance(plan, FromDiffusers):
        cut = [stream for _key, stream in plan.streams] + [s for split in plan.extra_splits for s in split.streams]
    else:
        return ()
    return tuple(dict.fromkeys((*cut, *plan.attention_keys, plan.output_stream)))


def _choices(section: type, key: str) -> list[str]:
    return [str(value) for value in typing.get_args(typing.get_type_hints(section)[key])]


def as_json(found: Found) -> dict[str, Any]:
    """`found` in the shape the module docstring documents."""
    from accel.recipe.sections import MemorySection, QuantSection

    family = found.family
    if family is None:
        return _unknown_json(found)
    plan = found.transformers[0].plan if found.transformers else family.parallel
    variant = next((v for v in family.variants if v.pipeline_class == found.pipeline), None)
    refused: dict[str, str] = {}
    if plan is None:
        refused["ulysses"] = refused["ring"] = f"{family.title} has no context-parallel plan"
    elif variant is not None and variant.not_split:
        refused["ulysses"] = refused["ring"] = variant.not_split
    if family.cfg is None:
        refused["cfg"] = f"{family.title} pipelines have no classifier-free guidance"
    if family.tensor is None:
        refused["tp"] = f"{family.title} has no tensor-parallel plan"
    heads = next((t.heads for t in found.transformers if t.heads is not None), None)
    blocks = any(t.blocks for t in found.transformers)
    split = vae_plan(found.vae) if found.vae else None
    return {
        "model": found.model,
        "source": found.source,
        "pipeline": found.pipeline,
        "family": {"name": family.name, "title": family.title, "tested": True},
        "refused": None,
        "generic": None,
        "transformers": _transformers_json(found),
        "streams": list(_streams(plan)),
        "primary_stream": family.primary_stream,
        "parallel": {
            "plan": PLAN_SOURCES[type(plan)] if plan is not None else None,
            "heads": heads,
            "cfg_style": family.cfg,
            "modes": {mode: mode not in refused for mode in ("ulysses", "ring", "cfg", "tp")},
            "refused": refused,
            "verdicts": _verdicts_json(found),  # of the automatic plan (--cp-plan automatic), where verified here
        },
        "accelerators": {
            "cache": list(CACHE_METHODS) if blocks else [],
            "quant": [kind for kind in _choices(QuantSection, "type") if kind != "none"] if blocks else [],
            "compile": "regional" if blocks else None,
            "vae_tiling": _tiles(found.vae),
            "vae": {
                "class": found.vae,
                "parallel": split is not None,
                "method": split.method if split is not None else None,
            },
            "text_encoders": list(found.text_encoders),
            "placement": {
                "text_encoder": _choices(MemorySection, "text_encoder"),
                "vae": _choices(MemorySection, "vae"),
            },
        },
    }


def _verdicts_json(found: Found) -> list[dict[str, Any]]:
    return [
        {
            "ulysses": v.get("ulysses", 1),
            "ring": v.get("ring", 1),
            "exact": bool(v.get("exact")),
            "reason": v.get("reason"),
            "source": v.get("source"),
        }
        for t in found.transformers
        for v in t.verdicts
    ]


def _learned_source(found: Found) -> str:
    """Where a pipeline no family knows takes its plan from: what a kept exact verdict says, else the
    class's own `_cp_plan` where accel can read it (tried first), else the automatic plan."""
    kept = next(
        (v["source"] for t in found.transformers for v in t.verdicts if v.get("exact") and v.get("source")), None
    )
    return kept or (
        PLAN_SOURCES[FromDiffusers] if any(t.own_cp_plan for t in found.transformers) else PLAN_SOURCES[AutomaticPlan]
    )


def _transformers_json(found: Found) -> list[dict[str, Any]]:
    return [
        {
            "attr": t.attr,
            "class": t.cls,
            "heads": t.heads,
            "blocks": [
                {
                    "attr": b.attr,
                    "count": b.count,
                    "class": b.cls,
                    "returns": list(b.returns) if b.returns is not None else None,
                    "found_by": b.found_by,
                    "unknown": b.unknown or None,
                }
                for b in t.blocks
            ],
        }
        for t in found.transformers
    ]


def _unknown_json(found: Found) -> dict[str, Any]:
    """A pipeline no family knows: what its transformers show, and what the generic path gives it."""
    from accel.recipe.sections import MemorySection, QuantSection

    blocks = any(t.blocks for t in found.transformers)
    probe = any(b.returns is None for t in found.transformers for b in t.blocks)
    generic = (
        "accel learns the blocks from the model at load"
        + (" (one probe call learns what a block returns)" if probe else "")
        + "; cache, quantization and compile apply"
    )
    why = (
        None
        if blocks
        else f"{found.pipeline}'s transformer has no repeated blocks: accel's cache, compile and parallelism do not "
        "apply"
    )
    split = vae_plan(found.vae) if found.vae else None
    untaught = f"{found.pipeline} is not a family accel was taught"
    verdicts = _verdicts_json(found)
    refusal = next((v["reason"] for v in verdicts if not v["exact"]), None)
    refused_here = (
        f"the automatic plan was refused on this model: {refusal}"
        if refusal and not any(v["exact"] for v in verdicts)
        else None
    )
    return {
        "model": found.model,
        "source": found.source,
        "pipeline": found.pipeline,
        "family": {"name": None, "title": found.pipeline, "tested": False},
        "refused": why,
        "generic": generic if blocks else None,
        "transformers": _transformers_json(found),
        "streams": [],
        "primary_stream": None,
        "parallel": {
            "plan": _learned_source(found) if blocks else None,
            "heads": next((t.heads for t in found.transformers if t.heads is not None), None),
            "cfg_style": None,
            "modes": {
                "ulysses": blocks and not refused_here,
                "ring": blocks and not refused_here,
                "cfg": False,
                "tp": False,
            },
            "refused": {
                **({"ulysses": refused_here, "ring": refused_here} if refused_here else {}),
                **(
                    {}
                    if blocks
                    else {
                        "ulysses": f"{untaught}: with no repeated blocks there is no plan to learn",
                        "ring": f"{untaught}: with no repeated blocks there is no plan to learn",
                    }
                ),
                "cfg": f"{untaught}: how it runs classifier-free guidance is not known",
                "tp": f"{untaught}: it has no tensor-parallel plan",
            },
            "verdicts": verdicts,
        },
        "accelerators": {
            "cache": list(CACHE_METHODS) if blocks else [],
            "quant": [kind for kind in _choices(QuantSection, "type") if kind != "none"] if blocks else [],
            "compile": "regional" if blocks else None,
            "vae_tiling": _tiles(found.vae),  # what its VAE class supports
            "vae": {
                "class": found.vae,
                "parallel": split is not None,
                "method": split.method if split is not None else None,
            },
            "text_encoders": list(found.text_encoders),
            "placement": {
                "text_encoder": _choices(MemorySection, "text_encoder"),
                "vae": _choices(MemorySection, "vae"),
            },
        },
    }


def _tiles(vae: str | None) -> bool:
    """Whether the VAE class decodes in tiles (diffusers' enable_tiling)."""
    if vae is None:
        return False
    import diffusers

    return callable(getattr(getattr(diffusers, vae, None), "enable_tiling", None))
