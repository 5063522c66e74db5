"""The class's own diffusers `_cp_plan` as candidates beside the automatic plan's: its cuts and
gather (accel/parallel/derive.py), each cut's stream learned from the same two probe calls the
automatic plan is learned from, verified before use like any plan learned (accel/parallel/choose.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from accel.models.base import BlockList
from accel.parallel.automatic import STREAM, TEXT, token_lengths
from accel.parallel.observe import Observation, TransformerCall
from accel.parallel.plan_format import FromDiffusers, ParallelPlan


def diffusers_candidates(
    transformer: nn.Module,
    calls: tuple[TransformerCall, TransformerCall],
    observations: tuple[Observation, Observation],
    lists: Sequence[BlockList],
    primary: str,
    candidates: Sequence[ParallelPlan],
) -> list[ParallelPlan]:
    """The class's own diffusers `_cp_plan` as accel plans, one per reading of the attention among
    `candidates` (the automatic plan's, from the same two `calls` and their `observations`): its cuts
    and gather, each cut's stream learned from the two calls (accel/parallel/derive.py). Empty where
    the class has none, where a cut follows no stream, or where accel cannot express the plan
    (several gathers): the automatic plan is then the source."""
    from accel.parallel.derive import PlanDerivationError, cut_keys, cut_lengths, derive_plan, learned_streams

    cp_plan = getattr(type(transformer), "_cp_plan", None)
    if not cp_plan or not candidates:
        return []
    name = type(transformer).__name__
    (length, text), (more, _) = (token_lengths(name, observation, lists, primary) for observation in observations)

    def lengths_in(call: TransformerCall) -> dict[str, int | None]:
        args, kwargs = call.fresh()
        with torch.no_grad():
            return cut_lengths(transformer, lambda: transformer(*args, **kwargs))

    streams = learned_streams(
        cut_keys(cp_plan),
        lengths_in(calls[0]),
        lengths_in(calls[1]),
        (STREAM, length, more),
        None if text is None else (TEXT, text),
    )
    if streams is None:
        return []
    derived: dict[str, ParallelPlan] = {}
    for plan in candidates:
        spec = FromDiffusers(
            streams=streams,
            attention_keys=plan.attention_keys,
            output_stream=plan.output_stream,
            local_attention=plan.local_attention,
            batch_args=plan.batch_args,
            module_keys=plan.module_keys,
            whole_queries=plan.whole_queries,
        )
        try:
            cut = derive_plan(cp_plan, spec)
        except PlanDerivationError:
            return []
        text_cut = any(split.stream == TEXT for split in cut.splits)
        cut = replace(
            cut,
            pairwise_mask=plan.pairwise_mask,
            leading_counts=plan.leading_counts,
            whole_streams=() if text_cut else plan.whole_streams,
        )
        derived.setdefault(repr(cut), cut)
    return list(derived.values())
