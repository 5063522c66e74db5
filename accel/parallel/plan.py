"""Which plans the parallel engines run on a pipeline, resolved once, and the refusals of a layout.

A family writes a hand `ParallelPlan`, a `FromDiffusers` derivation or the `AutomaticPlan`
(accel/parallel/plan_format.py); the engines run only resolved plans: `resolve_plans` makes each
transformer's `ParallelPlan` (derived from diffusers' `_cp_plan`, or learned and verified) and CFG
parallelism's `CfgPlan`, before the mesh is built. Every refusal of a layout a family cannot run is
written here once, for the CLI before ranks start and for `apply` alike. Torch-free at import.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from accel.errors import NotAvailableError, UserError
from accel.parallel.plan_format import AutomaticPlan, FamilyPlan, FromDiffusers, ParallelPlan

if TYPE_CHECKING:
    from accel.models.base import Family
    from accel.models.variant_format import Variant
    from accel.parallel.cfg import CfgPlan
    from accel.parallel.mesh import Degrees
    from accel.recipe.sections import ParallelSection


def plan_of(family: Family, where: str) -> FamilyPlan:
    """The family's parallel plan, or the one-line refusal (`where`: the flag or key that asked).
    A `FromDiffusers` plan is derived when applied, an `AutomaticPlan` learned and verified then
    (accel/parallel/choose.py)."""
    if family.parallel is None:
        raise NotAvailableError(f"{where}: {family.title} has no context-parallel plan yet; run it on one process")
    return family.parallel


def untaught_message(where: str, pipeline_class: str, what: str) -> str:
    """The refusal of `what` (CFG or tensor parallelism) for a pipeline no family describes."""
    return (
        f"{where}: {pipeline_class} is not a family accel was taught, and {what} needs one (its context "
        "parallelism is planned automatically and verified before use); use ulysses / ring alone, or one process"
    )


def refuse_untaught_before_start(ref: Any, where: str, settings: Any) -> None:
    """A saved pipeline whose classes no family knows gets its layout's CFG and TP refused before any
    rank starts (a hub id's classes are known only once loaded, where apply refuses them alike)."""
    if ref.family is not None or ref.pipeline is None:
        return
    if settings.cfg > 1:
        raise NotAvailableError(untaught_message(where, ref.pipeline, "CFG parallelism"))
    if settings.tp > 1:
        raise NotAvailableError(untaught_message(where, ref.pipeline, "tensor parallelism"))


def no_guidance_message(title: str) -> str:
    """cfg = 2 for a family whose pipelines run no classifier-free guidance at all (FLUX.2-dev)."""
    return f"[parallel] cfg = 2: {title} pipelines have no classifier-free guidance to split; set cfg = 1"


def refuse_layout(family: Family, variant: Variant, settings: ParallelSection) -> None:
    """What this pipeline cannot run under the layout, in one line before any rank starts: Ulysses /
    Ring on a pipeline they cannot cut, CFG parallelism on a family with no guidance to split."""
    if settings.sequence_ranks > 1 and variant.not_split:
        raise UserError(
            f"[parallel] ulysses × ring = {settings.sequence_ranks}: context parallelism cannot split "
            f"{variant.pipeline_class}: {variant.not_split}; set ulysses = 1 and ring = 1 (the cache, quantization "
            "and compile still apply)"
        )
    if settings.cfg > 1 and family.cfg is None:
        if family.learned:
            raise NotAvailableError(untaught_message("[parallel] cfg = 2", family.title, "CFG parallelism"))
        raise NotAvailableError(no_guidance_message(family.title))


def resolve_plan(plan: ParallelPlan | FromDiffusers, transformer: Any) -> ParallelPlan:
    """The ParallelPlan to run on `transformer`: `plan` itself, or derived from the class's `_cp_plan`;
    a transformer config the plan says it cannot split is refused in one line."""
    if isinstance(plan, FromDiffusers):
        from accel.parallel.derive import PlanDerivationError, derive_plan

        cp_plan = getattr(type(transformer), "_cp_plan", None)
        if not cp_plan:
            raise PlanDerivationError(
                f"{type(transformer).__name__} has no diffusers _cp_plan to derive the parallel plan from; "
                "this diffusers version may predate it (upgrade diffusers)"
            )
        plan = derive_plan(cp_plan, plan)
    config = getattr(transformer, "config", {})
    for key, value, why in plan.refuses:  # Kandinsky 5's sparse attention
        if config.get(key) == value:
            raise NotAvailableError(
                f"context parallelism: {type(transformer).__name__} with {key} = {value!r} {why}; run it on one process"
            )
    return plan


@dataclass(frozen=True)
class ResolvedPlans:
    """What the parallel engines run on one pipeline: each transformer's plan for context parallelism
    (empty: sequence degree 1), CFG parallelism's plan (None: cfg degree 1), and the automatic plans
    among them (empty: the family's own plans), which reports name."""

    sequence: Mapping[str, ParallelPlan] = field(default_factory=dict)
    cfg: CfgPlan | None = None
    automatic: Mapping[str, ParallelPlan] = field(default_factory=dict)


def resolve_plans(
    pipe: Any, family: Family, transformers: dict[str, Any], degrees: Degrees, asked: str
) -> ResolvedPlans:
    """Every plan the layout needs on `pipe`, resolved once, before the mesh is built (`asked`: the
    recipe's [parallel] plan). A transformer with no plan is refused first, then automatic plans are
    learned and verified, then hand plans derived and checked against each transformer's config."""
    if degrees.sequence > 1:
        for transformer in transformers.values():
            if (
                family.plan_for(transformer) is None
            ):  # a variant's own transformer class has its own plan (VACE, Animate)
                raise NotAvailableError(
                    f"[parallel] ulysses {degrees.ulysses} × ring {degrees.ring}: {type(transformer).__name__} has no "
                    "context-parallel plan yet; run it on one process, or with cfg = 2 alone"
                )
    automatic: dict[str, ParallelPlan] = {}
    if (isinstance(family.parallel, AutomaticPlan) or asked == "automatic") and degrees.sequence * degrees.cfg > 1:
        automatic = _automatic_plans(pipe, family, transformers, degrees)
    sequence: dict[str, ParallelPlan] = {}
    if degrees.sequence > 1:
        for attr, transformer in transformers.items():
            own = automatic.get(attr) or family.plan_for(transformer)
            assert own is not None and not isinstance(own, AutomaticPlan)  # refused or learned above
            sequence[attr] = resolve_plan(own, transformer)
    cfg = None
    if degrees.cfg > 1:
        plan = next(iter(automatic.values())) if automatic else plan_of(family, "[parallel]")
        # An automatic plan is learned only where a sequence or CFG split needs one (not for TP alone).
        assert not isinstance(plan, AutomaticPlan)
        cfg = cfg_plan(family, plan)
    return ResolvedPlans(sequence, cfg, automatic)


def _automatic_plans(
    pipe: Any, family: Family, transformers: dict[str, Any], degrees: Degrees
) -> dict[str, ParallelPlan]:
    """Each transformer's automatic plan, learned from the pipeline's own first transformer call and
    verified on simulated ranks of this layout (refused in one line where no candidate is exact).
    Every rank learns the candidates; rank 0 alone verifies them (or reads its kept verdict) and every
    rank takes its choice, before any collective of the mesh. Under CFG parallelism alone the plan
    only says which arguments carry the batch."""
    import torch.distributed as dist

    from accel.parallel.agree import every_rank_object
    from accel.parallel.automatic import batch_arguments_of
    from accel.parallel.choose import automatic_plan, probe_calls

    plans, calls = {}, {}
    for attr, transformer in transformers.items():
        kind = type(transformer)
        if kind not in calls:  # a second expert of the same class (Wan 2.2's transformer_2) takes the same inputs
            calls[kind] = probe_calls(pipe, transformer)
        call, wider = calls[kind]
        if degrees.sequence > 1:
            plans[attr] = automatic_plan(
                transformer,
                call,
                wider,
                family.blocks,
                family.primary_stream,
                degrees.ulysses,
                degrees.ring,
                "[parallel]",
                share=every_rank_object,
                lead=dist.get_rank() == 0,
                diffusers_first=isinstance(family.parallel, AutomaticPlan),
            )
        else:
            plans[attr] = batch_arguments_of(transformer, call, family.primary_stream)
    return plans


def cfg_plan(family: Family, plan: ParallelPlan | FromDiffusers) -> CfgPlan:
    """What CFG parallelism needs of the family and its plan: the batch arguments and items to halve,
    the deferred splits of those items (padded to a module's first input), the output's structure."""
    from accel.parallel.cfg import CfgPlan

    assert family.cfg is not None  # refused before (refuse_layout)
    extra = plan.splits if isinstance(plan, ParallelPlan) else plan.extra_splits
    return CfgPlan(
        style=family.cfg,
        batch_args=plan.batch_args,
        batch_items=plan.batch_items,
        padded=tuple(split for split in extra if split.at and split.value in plan.batch_items),
        outputs_vary=family.cfg_outputs_vary,
        output_like=family.acceleration.cfg_output_like,
    )
