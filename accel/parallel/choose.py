"""Choosing the learned context-parallel plan to use: the candidates of each source (the class's own
diffusers `_cp_plan`, then the automatic plan) verified in turn on simulated ranks
(accel/parallel/verify.py), the closest exact one taken, the verdict kept on disk
(accel/parallel/verdicts.py), and on several ranks one rank's choice taken by all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from accel.errors import NotAvailableError
from accel.models.base import BlockList
from accel.parallel.automatic import AutomaticPlanRefused, candidate_plans
from accel.parallel.diffusers_candidates import diffusers_candidates
from accel.parallel.observe import TransformerCall, observe
from accel.parallel.outputs import tensors_of
from accel.parallel.plan_format import ParallelPlan
from accel.parallel.verdicts import (
    DIFFUSERS_FIRST,
    identity_key,
    plan_digest,
    read_verdict,
    verdict_identity,
    write_verdict,
)
from accel.parallel.verify import Verdict, tolerance, verify_plan


def probe_calls(pipe: Any, transformer: nn.Module) -> tuple[TransformerCall, TransformerCall]:
    """The pipeline's own first call of `transformer` at the probe size (the input plans are verified
    on), and the same call with more tokens (which dims follow the token count)."""
    from accel.models.pipeline_probe import first_transformer_call, other_transformer_call

    return first_transformer_call(pipe, transformer), other_transformer_call(pipe, transformer)


# What one rank saw: its refusal of every candidate (None: it has candidates), its candidates'
# digests, and, on the rank that verifies, the digest of the plan chosen (None: refused) and why not.
RankView = tuple[str | None, list[str], tuple[str | None, str] | None]


def automatic_plan(
    transformer: nn.Module,
    call: TransformerCall,
    other: TransformerCall,
    lists: Sequence[BlockList],
    primary: str,
    ulysses: int,
    ring: int,
    where: str,
    share: Callable[[RankView], list[RankView]] | None = None,
    lead: bool = True,
    diffusers_first: bool = False,
) -> ParallelPlan:
    """The learned plan verified exact on this layout, or NotAvailableError in one line. `call` is the
    input it is verified on, `other` the same call with more tokens. With `diffusers_first` (a
    transformer no family describes), the class's own `_cp_plan` read with learned streams is tried
    before the automatic plan's candidates: the first source with an exact candidate is used.

    On several ranks, `share` all-gathers each rank's view (rank 0's first) and only the `lead` rank
    verifies: every rank then takes the same plan or raises the same line, even where a borderline
    half-precision check could come out differently on two devices, so none waits alone in a collective."""
    name = type(transformer).__name__
    observation = observe(transformer, call, lists)
    try:
        other_observation = observe(transformer, other, lists)
        automatic = candidate_plans(transformer, observation, other_observation, lists, primary)
        derived = (
            diffusers_candidates(
                transformer, (call, other), (observation, other_observation), lists, primary, automatic
            )
            if diffusers_first
            else []
        )
        refused = None
    except AutomaticPlanRefused as error:
        automatic, derived, refused = [], [], refusal(where, name, str(error))
    sources = [group for group in (derived, automatic) if group]
    candidates = [plan for group in sources for plan in group]
    digests = [plan_digest(plan) for plan in candidates]
    decision = (
        _decide(transformer, sources, call, observation.output, ulysses, ring, where, tried=bool(derived))
        if lead and refused is None
        else None
    )
    views = [(refused, digests, decision)] if share is None else share((refused, digests, decision))
    for their_refusal, _, _ in views:
        if their_refusal is not None:
            raise NotAvailableError(their_refusal)
    chosen, why = views[0][2] or (None, refusal(where, name, "the first rank did not verify it"))
    if chosen is None:
        raise NotAvailableError(why)
    if any(chosen not in their_digests for _, their_digests, _ in views):
        raise NotAvailableError(refusal(where, name, "the ranks learned different plans from the same call"))
    return candidates[digests.index(chosen)]


def _decide(
    transformer: nn.Module,
    sources: Sequence[Sequence[ParallelPlan]],
    call: TransformerCall,
    reference: Any,
    ulysses: int,
    ring: int,
    where: str,
    tried: bool = False,
) -> tuple[str | None, str]:
    """The digest of the candidate to use (None: refused) and the refusal's line: the kept verdict
    where this model and layout were verified before, else a verification of each source's
    candidates in turn (the first with an exact one is used; the last source's reason refuses), kept.
    `tried`: the class's own `_cp_plan` came first, which its verdict is kept apart for (the same
    model under `--cp-plan automatic` may keep another)."""
    name = type(transformer).__name__
    identity = verdict_identity(transformer, ulysses, ring)
    if identity is not None and tried:
        identity["sources"] = DIFFUSERS_FIRST
    key = None if identity is None else identity_key(identity)
    digests = [plan_digest(plan) for group in sources for plan in group]
    cached = read_verdict(key) if key is not None else None
    if cached is not None:
        if cached.get("exact") and cached.get("plan") in digests:
            return cached["plan"], ""
        if not cached.get("exact") and cached.get("candidates") == digests:
            return None, refusal(where, name, cached.get("reason", ""))
    for candidates in sources:
        plan, verdict = best_candidate(transformer, candidates, call, ulysses, ring, reference)
        if verdict.exact:
            break
    if key is not None and identity is not None:
        write_verdict(
            key,
            {**identity, "exact": True, "plan": plan_digest(plan), "source": plan.origin, "error": verdict.error}
            if verdict.exact
            else {**identity, "exact": False, "reason": verdict.reason, "candidates": digests},
        )
    return (plan_digest(plan), "") if verdict.exact else (None, refusal(where, name, verdict.reason))


def best_candidate(
    transformer: nn.Module,
    candidates: Sequence[ParallelPlan],
    call: TransformerCall,
    ulysses: int,
    ring: int,
    reference: Any,
) -> tuple[ParallelPlan, Verdict]:
    """The candidate closest to one process, with its verdict. A wrong candidate on a small random
    input can differ by little more than half-precision rounding, so in half types every candidate
    is measured and the best must also be clearly better than the next one within tolerance; in
    float32 the first within 1 % of the tolerance is taken at once."""
    verdicts: list[tuple[ParallelPlan, Verdict]] = []
    quite_exact = tolerance(next(tensors_of(reference)).dtype) / 100
    for plan in candidates:
        verdict = verify_plan(transformer, plan, call, ulysses, ring, reference=reference)
        verdicts.append((plan, verdict))
        if verdict.exact and verdict.error <= quite_exact:
            return plan, verdict
    verdicts.sort(key=lambda item: item[1].error)
    plan, best = verdicts[0]
    if best.exact and len(verdicts) > 1 and verdicts[1][1].exact and verdicts[1][1].error < 2 * best.error:
        return plan, Verdict(
            False,
            best.error,
            f"{len(verdicts)} ways of reading its attention come out equally close "
            "to one process on the probe, so none is known to be right",
        )
    first_failure = next((verdict for _, verdict in verdicts if not verdict.exact), best)
    return (plan, best) if best.exact else (candidates[0], _first_reason(verdicts, first_failure))


def _first_reason(verdicts: list[tuple[ParallelPlan, Verdict]], fallback: Verdict) -> Verdict:
    """The refusal of the closest candidate that ran (a finite error), else the first failure's."""
    finite = [verdict for _, verdict in verdicts if verdict.error != float("inf")]
    return finite[0] if finite else fallback


def refusal(where: str, transformer_class: str, why: str) -> str:
    return (
        f"{where}: the automatic context-parallel plan for {transformer_class} is refused: {why}; "
        "run it on one process (cache, quantization and compile apply)"
    )
