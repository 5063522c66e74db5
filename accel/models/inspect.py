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

The pipeline's class names and configs are read by accel/models/pipeline_classes.py; the JSON
`accel inspect --json` prints is accel/models/inspect_json.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accel.errors import ModelError
from accel.models.base import BlockList, Family
from accel.models.pipeline_classes import PipelineClasses, classes_of
from accel.models.refs import resolve_model
from accel.models.registry import lookup
from accel.parallel.plan_format import AutomaticPlan, FromDiffusers, ParallelPlan


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


def inspect_model(name: str) -> Found:
    """What accel finds in `name` (a registry alias, hub id or folder); a ModelError for bad input."""
    ref = resolve_model(name)
    if ref.tiny and ref.family is not None:
        return _of_pipeline(name, ref.family, ref.family.tiny())  # type: ignore[misc]
    classes = classes_of(ref)
    family = ref.family or _family_of(classes)
    source = "folder" if Path(ref.source).is_dir() else ("registry" if lookup(name) is not None else "hub")
    if family is None:
        transformers = tuple(_discovered(attr, cls, config) for attr, cls, config in classes.transformers)
        return Found(name, source, classes.pipeline, None, transformers, classes.vae, classes.text_encoders)
    transformers = tuple(_transformer(family, attr, cls, config) for attr, cls, config in classes.transformers)
    return Found(name, source, classes.pipeline, family, transformers, classes.vae, classes.text_encoders)


def _family_of(classes: PipelineClasses) -> Family | None:
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
    from accel.memory.build import build
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
    from accel.memory.build import build
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
