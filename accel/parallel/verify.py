"""Verification of a context-parallel plan no tested family wrote, before it is used.

The plan runs on N simulated ranks in this process (accel/parallel/simulate.py: the same engine,
the same collectives, one copy of the weights) on a small real input, and every rank's output is
compared with the unsplit forward's. Equal within the dtype's tolerance: the plan is used. Otherwise
context parallelism is refused in one line naming the first module whose output differs, found by a
second, recorded run. Never silently wrong. Verdicts are kept on disk per (transformer class,
config, accel version, layout), so a model is verified once, not at every start.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from accel.errors import NotAvailableError, first_line
from accel.models.base import BlockList
from accel.parallel.plan_format import AutomaticPlan, ParallelPlan
from accel.parallel.automatic import (
    AutomaticPlanRefused,
    TransformerCall,
    candidate_plans,
    diffusers_candidates,
    observe,
)
from accel.parallel.outputs import tensors_of
from accel.parallel.layout import SequenceLayout
from accel.parallel.simulate import run_ranks, simulated_meshes, weight_sharing_copy

# Largest difference from one process, as a share of the output's largest magnitude, that a plan may
# make: float32 differs only by summation order; half types by rounding at every block.
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-3}
HALF_TOLERANCE = 3e-2
RECORD_DEPTH = 3  # module names of up to three parts (blocks.3.attn) are compared when locating a divergence


@dataclass(frozen=True)
class Verdict:
    exact: bool
    error: float = 0.0
    reason: str = ""  # why not exact, one line


def tolerance(dtype: torch.dtype) -> float:
    return TOLERANCE.get(dtype, HALF_TOLERANCE)


def verify_plan(
    transformer: nn.Module, plan: ParallelPlan, call: TransformerCall, ulysses: int, ring: int, reference: Any = None
) -> Verdict:
    """Whether `plan` on ulysses × ring simulated ranks gives `transformer`'s unsplit output on `call`."""
    if reference is None:
        args, kwargs = call.fresh()
        with torch.no_grad():
            reference = transformer(*args, **kwargs)
    expected = list(tensors_of(reference))
    try:
        outputs = _split_run(transformer, plan, call, ulysses, ring)
    except Exception as error:  # the plan's failure on this model, whatever it is, is the verdict
        return Verdict(False, float("inf"), f"it fails on {ulysses * ring} simulated ranks: {first_line(error)}")
    worst = 0.0
    for output in outputs:
        got = list(tensors_of(output))
        if len(got) != len(expected) or any(a.shape != b.shape for a, b in zip(got, expected)):
            return Verdict(
                False,
                float("inf"),
                f"its output on {ulysses * ring} simulated ranks has other shapes than one process's",
            )
        worst = max([worst, *(_relative(a, b) for a, b in zip(got, expected))])
    dtype = expected[0].dtype if expected else torch.float32
    if worst <= tolerance(dtype):
        return Verdict(True, worst)
    where = first_divergence(transformer, plan, call, ulysses, ring, tolerance(dtype))
    return Verdict(
        False,
        worst,
        f"on {ulysses * ring} simulated ranks its output differs from one process's by "
        f"{worst:.1e} of its scale, first at {where}",
    )


def _split_run(
    transformer: nn.Module,
    plan: ParallelPlan,
    call: TransformerCall,
    ulysses: int,
    ring: int,
    record: dict[int, dict[str, list[Tensor]]] | None = None,
) -> list[Any]:
    from accel.parallel.engine import ContextParallel

    meshes = simulated_meshes(ulysses, ring)
    copies = [weight_sharing_copy(transformer) for _ in meshes]
    engines, handles = [], []
    try:
        for rank, (copy, mesh) in enumerate(zip(copies, meshes)):
            engines.append(ContextParallel(copy, plan, mesh))
            if record is not None:
                record[rank] = {}
                handles += _recorders(copy, record[rank])

        def forward(rank: int, _mesh: Any) -> Any:
            args, kwargs = call.fresh()
            return copies[rank](*args, **kwargs)

        return run_ranks(meshes, forward)
    finally:
        for handle in handles:
            handle.remove()
        for engine in engines:
            engine.remove()


def _recorders(transformer: nn.Module, into: dict[str, list[Tensor]]) -> list[Any]:
    """Hooks keeping the first output of each shallow module, in call order (dicts keep insertion order)."""
    handles = []
    for name, module in transformer.named_modules():
        if not name or len(name.split(".")) > RECORD_DEPTH:
            continue

        def keep(_module: nn.Module, _args: Any, output: Any, name: str = name) -> None:
            if name not in into:
                into[name] = [t.detach().clone() for t in tensors_of(output)]

        handles.append(module.register_forward_hook(keep))
    return handles


def first_divergence(
    transformer: nn.Module, plan: ParallelPlan, call: TransformerCall, ulysses: int, ring: int, limit: float
) -> str:
    """The first module (in the unsplit forward's order) whose output the split run does not reproduce."""
    reference: dict[str, list[Tensor]] = {}
    handles = _recorders(transformer, reference)
    try:
        with torch.no_grad():
            args, kwargs = call.fresh()
            transformer(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    ranks: dict[int, dict[str, list[Tensor]]] = {}
    try:
        _split_run(transformer, plan, call, ulysses, ring, record=ranks)
    except Exception:  # noqa: BLE001 - already judged; what was recorded before the failure still locates it
        pass
    modules = dict(transformer.named_modules())
    for name, expected in reference.items():
        per_rank = [ranks.get(rank, {}).get(name) for rank in range(ulysses * ring)]
        if any(outputs is None for outputs in per_rank):
            return f"{name} ({type(modules[name]).__name__}), which the split run never reached"
        for index, tensor in enumerate(expected):
            shards = [outputs[index] for outputs in per_rank if index < len(outputs)]
            error = _shard_error(tensor, shards)
            if error is not None and error > limit:
                return f"{name} ({type(modules[name]).__name__})"
    return "the transformer's output"


def _shard_error(expected: Tensor, shards: Sequence[Tensor]) -> float | None:
    """How far the ranks' tensors are from `expected`: each rank's whole copy, or their shards joined
    along the one dim they are cut on; None where the tensors are neither (several streams in one)."""
    if not shards:
        return None
    if all(shard.shape == expected.shape for shard in shards):
        return max(_relative(shard, expected) for shard in shards)
    dims = [
        d
        for d in range(expected.dim())
        if shards[0].dim() == expected.dim() and shards[0].shape[d] != expected.shape[d]
    ]
    if len(dims) != 1 or any(shard.shape != shards[0].shape for shard in shards):
        return None
    layout = SequenceLayout(expected.shape[dims[0]], len(shards))
    if layout.shard != shards[0].shape[dims[0]]:
        return None
    return _relative(layout.join(list(shards), dims[0]), expected)


def _relative(got: Tensor, expected: Tensor) -> float:
    expected = expected.float()
    if expected.numel() == 0:
        return 0.0
    scale = max(expected.abs().max().item(), 1e-6)
    return (got.float() - expected).abs().max().item() / scale


# -- choosing and caching ------------------------------------------------------------------------
def probe_calls(pipe: Any, transformer: nn.Module) -> tuple[TransformerCall, TransformerCall]:
    """The pipeline's own first call of `transformer` at the probe size (the input plans are verified
    on), and the same call with more tokens (which dims follow the token count)."""
    from accel.models.generic import first_transformer_call, other_transformer_call

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
    key = None if identity is None else _key_of(identity)
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


# A verdict's `sources` where the class's own `_cp_plan` was tried before the automatic plan.
DIFFUSERS_FIRST = "diffusers _cp_plan, automatic"


def plan_digest(plan: ParallelPlan) -> str:
    return hashlib.sha256(repr(plan).encode()).hexdigest()[:16]


def verdict_identity(transformer: nn.Module, ulysses: int, ring: int) -> dict[str, Any] | None:
    """What a verdict holds for: the transformer's class and config, accel's version, the layout.
    None for a model with no diffusers config, whose class alone does not say what it computes (it
    is verified at every start)."""
    from accel import __version__
    from accel.models.generic import config_hash

    if not getattr(transformer, "config", None):
        return None
    return {
        "class": type(transformer).__name__,
        "config": config_hash(transformer),
        "version": __version__,
        "ulysses": ulysses,
        "ring": ring,
    }


def _key_of(identity: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]


def verdict_key(transformer: nn.Module, ulysses: int, ring: int) -> str | None:
    """The verdict's name on disk (None: not kept)."""
    identity = verdict_identity(transformer, ulysses, ring)
    return None if identity is None else _key_of(identity)


def verdict_dir() -> Path:
    """Where verdicts are kept: $ACCEL_CACHE_DIR, else accel/ under the user's cache folder."""
    root = os.environ.get("ACCEL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "accel"
    )
    return Path(root) / "plans"


def verdicts_for(transformer_class: str, config: str) -> list[dict[str, Any]]:
    """The verdicts kept for a transformer class and config hash under this accel version, by layout."""
    from accel import __version__

    found = []
    for path in sorted(verdict_dir().glob("*.json")):
        verdict = read_verdict(path.stem)
        if verdict is not None and (verdict.get("class"), verdict.get("config"), verdict.get("version")) == (
            transformer_class,
            config,
            __version__,
        ):
            found.append(verdict)
    return sorted(found, key=lambda v: (v.get("ulysses", 1) * v.get("ring", 1), v.get("ring", 1)))


def read_verdict(key: str) -> dict[str, Any] | None:
    try:
        value = json.loads((verdict_dir() / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def write_verdict(key: str, verdict: dict[str, Any]) -> None:
    """Atomically, so ranks writing the same verdict at once never leave half a file; a cache that
    cannot be written only costs a verification at the next start."""
    folder = verdict_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(handle, "w") as file:
            json.dump(verdict, file)
        os.replace(temporary, folder / f"{key}.json")
    except OSError:
        pass


# -- before any rank starts ----------------------------------------------------------------------
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
