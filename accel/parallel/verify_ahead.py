"""The automatic plan before any rank starts: verified here on simulated ranks (`accel inspect
--verify`), or a layout already refused for this model refused in one line before ranks load it.
"""

from __future__ import annotations

from accel.errors import NotAvailableError
from accel.parallel.choose import automatic_plan, probe_calls, refusal
from accel.parallel.plan_format import AutomaticPlan
from accel.parallel.verdicts import DIFFUSERS_FIRST
from accel.parallel.verify import Verdict


def verify_pipeline(
    model: str, ulysses: int, ring: int, dtype: str | None = None, device: str | None = None
) -> Verdict:
    """Load `model` here and verify the automatic plan of its first transformer on ulysses × ring
    simulated ranks (`accel inspect --verify`): no rank per GPU is needed, and the verdict is kept
    for the runs that follow. A refusal is a verdict, not an error."""
    import accel
    from accel.models.registry import family_of

    pipe = accel.load_pipeline(model, dtype=dtype, device=device)
    if callable(getattr(pipe, "set_progress_bar_config", None)):
        pipe.set_progress_bar_config(disable=True)
    family = family_of(pipe)
    transformer = getattr(pipe, family.transformer_attrs[0])
    try:
        automatic_plan(
            transformer,
            *probe_calls(pipe, transformer),
            family.blocks,
            family.primary_stream,
            ulysses,
            ring,
            "--verify",
            diffusers_first=isinstance(family.parallel, AutomaticPlan),
        )
    except NotAvailableError as error:
        return Verdict(False, reason=str(error))
    return Verdict(True)


def refuse_kept_verdict(model: str, ulysses: int, ring: int, where: str) -> None:
    """Refuse a layout the automatic plan was already refused on for this model (its class and
    config, read without weights), in one line before any rank starts and loads it."""
    import warnings

    from accel.models.inspect import inspect_model

    try:
        with warnings.catch_warnings():  # a model class's deprecation notices are not this line's business
            warnings.simplefilter("ignore")
            found = inspect_model(model)
    except Exception:  # noqa: BLE001 - unreadable here: the ranks will say what is wrong
        return
    for transformer in found.transformers:
        sources = DIFFUSERS_FIRST if transformer.own_cp_plan else None  # what a run of this model tries
        for verdict in transformer.verdicts:
            if (verdict.get("ulysses"), verdict.get("ring"), verdict.get("exact"), verdict.get("sources")) == (
                ulysses,
                ring,
                False,
                sources,
            ):
                raise NotAvailableError(refusal(where, transformer.cls, verdict.get("reason", "")))
