"""What `accel inspect --json` prints of what accel found in a model (accel/models/inspect.py).

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
from typing import Any

from accel.cache.config import CACHE_METHODS
from accel.models.inspect import Found
from accel.models.vaes import vae_plan
from accel.parallel.plan_format import AutomaticPlan, FromDiffusers, ParallelPlan

PLAN_SOURCES = {ParallelPlan: "accel family plan", FromDiffusers: "diffusers _cp_plan", AutomaticPlan: "automatic"}


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
