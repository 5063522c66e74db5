"""The automatic context-parallel plan (accel/parallel/automatic.py) and its verification on simulated
ranks (accel/parallel/choose.py, accel/parallel/verify.py, accel/parallel/simulate.py), issue 34.

Every family's hand plan switched off: the automatic plan learned from the tiny transformer equals one
process and the hand plan, on simulated ranks (Ulysses 2 at the probe's size, Ring 3 at a size three
ranks do not divide), and on real gloo ranks under CFG halves × Ulysses with the cache on. A
transformer that mixes tokens outside attention (a pooling over the sequence) is refused by the
verification, naming the block; the same transformer without the pooling is verified. Verdicts are
kept on disk and reused. A class that ships a diffusers `_cp_plan` and no family names is planned
from it first, its streams learned.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn

import parallel_cases as cases
from accel.errors import NotAvailableError
from accel.models.base import BlockList
from accel.models.registry import FAMILIES
from accel.parallel import choose, verdicts, verify
from accel.parallel.attention import usp_attention
from accel.parallel.observe import TransformerCall
from accel.parallel.outputs import tensors_of
from accel.parallel.derive import DIFFUSERS
from accel.parallel.plan import resolve_plan
from accel.parallel.layout import SequenceLayout
from accel.parallel.simulate import run_ranks, simulated_meshes
from families import FAMILY_CASES
from family_parallel import TOLERANCE, reference, splits_sequence

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

SIMULATED = 1e-5  # float32 on simulated ranks: only the order of sums differs


@pytest.mark.parametrize("ulysses, ring", [(2, 1), (1, 3), (2, 2)])
def test_simulated_ranks_attend_as_one_process(ulysses: int, ring: int) -> None:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 13, 8, generator=generator) for _ in range(3))
    layout = SequenceLayout(13, ulysses * ring)  # 13 tokens: every layout pads
    valid = layout.valid()[:, None, :]

    def rank(index: int, mesh: Any) -> torch.Tensor:
        shards = (layout.split(x, -2, index) for x in (q, k, v))
        return usp_attention(
            *shards, mesh.ulysses_group if ulysses > 1 else None, mesh.ring_group if ring > 1 else None, valid
        )

    joined = layout.join(run_ranks(simulated_meshes(ulysses, ring), rank), -2)
    assert (joined - F.scaled_dot_product_attention(q, k, v)).abs().max() < 1e-6


def test_a_failing_simulated_rank_raises_instead_of_hanging() -> None:
    def rank(index: int, mesh: Any) -> None:
        if index == 1:
            raise ValueError("rank 1 fails before the exchange")
        mesh.sequence_group.swap(torch.zeros(1))  # rank 0 would wait here for ever

    with pytest.raises(ValueError, match="rank 1 fails"):
        run_ranks(simulated_meshes(2, 1), rank)


def _calls(family: str) -> tuple[Any, TransformerCall, TransformerCall]:
    pipe = cases.tiny_pipeline(f"tiny-{family}")
    return pipe, *choose.probe_calls(pipe, pipe.transformer)


def _call_at(pipe: Any, call: dict[str, Any]) -> TransformerCall:
    """The transformer's first call in a pipeline call of `call`'s size (stopped there)."""
    from accel.models import pipeline_probe

    calls: list[TransformerCall] = []

    def keep(_module: Any, args: Any, kwargs: Any) -> None:
        calls.append(TransformerCall(*TransformerCall(tuple(args), dict(kwargs)).fresh()))
        raise pipeline_probe._FirstForwardDone

    handle = pipe.transformer.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        with torch.no_grad(), pytest.raises(pipeline_probe._FirstForwardDone):
            pipe(**call, generator=torch.Generator().manual_seed(0), output_type="latent")
    finally:
        handle.remove()
    return calls[0]


def _outputs(transformer: Any, plan: Any, call: TransformerCall, ulysses: int, ring: int) -> list[torch.Tensor]:
    return [t for output in verify._split_run(transformer, plan, call, ulysses, ring) for t in tensors_of(output)]


# The hand plans the automatic plan cannot write, and refuses (a family case's `refused_automatically` says why;
# test_qwen_image_21_is_refused_by_the_automatic_plan, test_cosmos_3_is_refused_by_the_automatic_plan), are left out.
@pytest.mark.parametrize(
    "family",
    [family for family in FAMILY_CASES if splits_sequence(family) and not FAMILY_CASES[family].refused_automatically],
)
def test_every_family_without_its_hand_plan_is_planned_automatically_and_exactly(
    family: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path))
    assert {plan.origin for plan in _planned_exactly(family, diffusers_first=False)} == {"automatic"}


# Where no family names a class that ships a diffusers `_cp_plan`, that plan is the first source (its
# streams learned from the probe), the automatic plan the second. FLUX's and Wan's are followed exactly.
# LTX-Video's cuts the text with its additive mask, which the engine cannot split, so the verification
# refuses it; Qwen-Image's cuts a text mask its probe never passes (an unmasked prompt), whose stream
# cannot be learned: both take the automatic plan.
@pytest.mark.parametrize(
    "family, origin", [("flux", DIFFUSERS), ("wan", DIFFUSERS), ("ltx", "automatic"), ("qwenimage", "automatic")]
)
def test_a_class_that_ships_a_cp_plan_is_planned_from_it_first(
    family: str, origin: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path))
    if (
        origin == DIFFUSERS
    ):  # a verdict kept for the automatic plan alone (--cp-plan automatic) does not answer for this
        pipe, call, other = _calls(family)
        spec = FAMILIES[family]
        assert (
            choose.automatic_plan(
                pipe.transformer, call, other, spec.blocks, spec.primary_stream, 2, 1, "[parallel]"
            ).origin
            == "automatic"
        )
    plans = _planned_exactly(
        family, diffusers_first=True, layouts=((2, 1), (1, 3)) if origin == DIFFUSERS else ((2, 1),)
    )
    assert {plan.origin for plan in plans} == {origin}
    if origin == DIFFUSERS:  # diffusers' cuts and gather, as its plan states them
        cp_plan = type(pipe.transformer)._cp_plan
        assert {split.module for split in plans[0].splits} == {
            module for module, entry in cp_plan.items() if isinstance(entry, dict)
        }
        assert plans[0].output_module == next(
            module for module, entry in cp_plan.items() if not isinstance(entry, dict)
        )
        kept = [json.loads(path.read_text()) for path in (tmp_path / "plans").glob("*.json")]
        assert sorted(
            (verdict["source"], verdict.get("sources"), verdict["ulysses"], verdict["ring"]) for verdict in kept
        ) == [
            ("automatic", None, 2, 1),
            (DIFFUSERS, verdicts.DIFFUSERS_FIRST, 1, 3),
            (DIFFUSERS, verdicts.DIFFUSERS_FIRST, 2, 1),
        ]


def _planned_exactly(
    family: str, diffusers_first: bool, layouts: tuple[tuple[int, int], ...] = ((2, 1), (1, 3))
) -> list[Any]:
    """The learned plan of `family`'s tiny transformer for each layout (Ulysses 2 at the probe's size,
    Ring 3 at a size three ranks do not divide), each checked equal to one process and to the hand plan."""
    pipe, call, other = _calls(family)
    transformer, spec = pipe.transformer, FAMILIES[family]
    hand = resolve_plan(spec.plan_for(transformer), transformer)
    odd = _call_at(pipe, dict(FAMILY_CASES[family].call, **FAMILY_CASES[family].odd))
    plans = []
    for ulysses, ring in layouts:
        on = call if ring == 1 else odd
        plan = choose.automatic_plan(
            transformer,
            call,
            other,
            spec.blocks,
            spec.primary_stream,
            ulysses,
            ring,
            "[parallel]",
            diffusers_first=diffusers_first,
        )
        args, kwargs = on.fresh()
        with torch.no_grad():
            expected = list(tensors_of(transformer(*args, **kwargs)))
        learned = _outputs(transformer, plan, on, ulysses, ring)
        by_hand = _outputs(transformer, hand, on, ulysses, ring)
        assert len(learned) == len(by_hand) == len(expected) * ulysses * ring
        for index, got in enumerate(learned):
            want, hand_made = expected[index % len(expected)], by_hand[index]
            scale = want.abs().max().item()
            assert (got - want).abs().max().item() <= SIMULATED * scale, (family, ulysses, ring)
            assert (got - hand_made).abs().max().item() <= 2 * SIMULATED * scale, (family, ulysses, ring)
        plans.append(plan)
    return plans


@pytest.mark.parametrize("ulysses, ring", [(2, 1), (1, 3)])
def test_qwen_image_21_is_refused_by_the_automatic_plan(
    ulysses: int, ring: int, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its SDPA processor attends the joint sequence segment by segment at whole-sequence positions (the
    target's queries to every key): no cut of one stream is exact, and the plan says where in one line."""
    monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path))
    pipe, call, other = _calls("qwenimage21")
    spec = FAMILIES["qwenimage21"]
    with pytest.raises(NotAvailableError) as refused:
        choose.automatic_plan(
            pipe.transformer, call, other, spec.blocks, spec.primary_stream, ulysses, ring, "[parallel]"
        )
    assert str(refused.value) == (
        "[parallel]: the automatic context-parallel plan for QwenImage21Transformer2DModel is refused: "
        "QwenImage21Transformer2DModel's "
        "transformer_blocks.*.attn attends 64 queries to 76 keys, which the automatic plan cannot place among the 76 "
        "stream tokens; "
        "run it on one process (cache, quantization and compile apply)"
    )


def test_cosmos_3_is_refused_by_the_automatic_plan(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path))
    pipe, call, other = _calls("cosmos3")
    spec = FAMILIES["cosmos3"]
    with pytest.raises(NotAvailableError) as refused:
        choose.automatic_plan(pipe.transformer, call, other, spec.blocks, spec.primary_stream, 2, 1, "[parallel]")
    assert str(refused.value) == (
        "[parallel]: the automatic context-parallel plan for Cosmos3OmniTransformer is refused: "
        "Cosmos3OmniTransformer's layers take "
        "gen_seq that is not (batch, tokens, width); run it on one process (cache, quantization and compile apply)"
    )


# CFG halves × Ulysses on real gloo ranks with the cache on, the automatic plan in place of the hand
# one: a family per way of running guidance (batched, two calls, FLUX's true CFG).
@pytest.mark.parametrize("family", ["sd3", "wan", "flux"])
def test_cfg_halves_by_ulysses_with_the_cache_equal_one_process(rank_pools: Any, family: str) -> None:
    case = FAMILY_CASES[family]
    cache = {"threshold": case.threshold}
    expected, records = reference(family, case.call, case.threshold)
    recipe = {"parallel": {"cfg": 2, "ulysses": 2, "plan": "automatic"}, "cache": cache}
    runs = rank_pools(4).run(cases.tiny_run, f"tiny-{family}", recipe, case.call)
    transformer = cases.tiny_pipeline(f"tiny-{family}").transformer
    assert verdicts.read_verdict(verdicts.verdict_key(transformer, 2, 1))[
        "exact"
    ]  # the ranks verified the automatic plan
    assert any(cached for *_, cached in records), "the threshold caches nothing on one process"
    for output, _, bytes_sent in runs:
        assert bytes_sent > 0
        assert np.abs(output - expected).max() <= TOLERANCE


class _Block(nn.Module):
    """Self-attention, then (with `pool`) the mean over the tokens added to every token: a mix of
    tokens outside attention, which no split of the sequence can run on a shard."""

    def __init__(self, pool: bool) -> None:
        super().__init__()
        self.qkv, self.out, self.pool = nn.Linear(16, 48), nn.Linear(16, 16), pool

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = hidden_states.shape
        q, k, v = self.qkv(hidden_states).view(batch, tokens, 3, 2, width // 2).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, tokens, width)
        hidden_states = hidden_states + self.out(attended)
        return hidden_states + hidden_states.mean(dim=1, keepdim=True) if self.pool else hidden_states


class _Toy(ModelMixin, ConfigMixin):
    """A diffusers model (its config says whether it pools, so the two kinds have verdicts of their own)."""

    @register_to_config
    def __init__(self, pool: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, 16)
        self.blocks = nn.ModuleList([_Block(pool and index == 1) for index in range(3)])
        self.norm_out, self.proj_out = nn.LayerNorm(16), nn.Linear(16, 4)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed(hidden_states)
        for block in self.blocks:
            hidden_states = block(hidden_states)
        return self.proj_out(self.norm_out(hidden_states))


def _toy_plan(pool: bool, **ranks: Any) -> Any:
    calls = [
        TransformerCall((), {"hidden_states": torch.randn(1, tokens, 4, generator=torch.Generator().manual_seed(1))})
        for tokens in (21, 30)
    ]
    return choose.automatic_plan(
        _Toy(pool),
        *calls,
        (BlockList("blocks", returns=("hidden_states",)),),
        "hidden_states",
        2,
        1,
        "--ulysses",
        **ranks,
    )


def test_a_transformer_that_pools_over_the_sequence_is_refused_naming_the_block(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path))
    plan = _toy_plan(pool=False)  # the same transformer without the pooling is verified
    assert plan.output_module == "norm_out" and plan.output_before
    with pytest.raises(NotAvailableError) as refused:
        _toy_plan(pool=True)
    message = str(refused.value)
    assert message.startswith(
        "--ulysses: the automatic context-parallel plan for _Toy is refused: on 2 simulated ranks its "
        "output differs from one process's by "
    )
    assert message.endswith(
        " of its scale, first at blocks.1 (_Block); run it on one process (cache, quantization and compile apply)"
    )


def test_verdicts_are_kept_on_disk_and_reused(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path))
    plan = _toy_plan(pool=False)
    with pytest.raises(NotAvailableError) as refused:
        _toy_plan(pool=True)
    assert len(list((tmp_path / "plans").glob("*.json"))) == 2

    def never(*_: Any, **__: Any) -> Any:
        raise AssertionError("verified again")

    monkeypatch.setattr(choose, "verify_plan", never)
    assert _toy_plan(pool=False) == plan
    with pytest.raises(NotAvailableError) as again:
        _toy_plan(pool=True)
    assert str(again.value) == str(refused.value)


def test_every_rank_takes_the_first_ranks_verdict(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """On several ranks only rank 0 verifies; the others take its choice or its refusal, never their own."""
    monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path))
    seen: list[Any] = []

    def as_rank_1(lead_view: Any) -> Any:
        def share(mine: Any) -> list[Any]:
            seen.append(mine)
            return [lead_view(mine), mine]

        return share

    def never(*_: Any, **__: Any) -> Any:
        raise AssertionError("a rank other than the first verified")

    monkeypatch.setattr(choose, "verify_plan", never)
    [only] = _candidate_plans_of_toy()
    chosen = _toy_plan(
        False, share=as_rank_1(lambda mine: (None, mine[1], (verdicts.plan_digest(only), ""))), lead=False
    )
    assert chosen == only and seen[-1][2] is None  # rank 1 sent no decision of its own, nor verified
    refusal = choose.refusal("--ulysses", "_Toy", "rank 0 says no")
    with pytest.raises(NotAvailableError) as refused:
        _toy_plan(False, share=as_rank_1(lambda mine: (None, mine[1], (None, refusal))), lead=False)
    assert str(refused.value) == refusal
    with pytest.raises(NotAvailableError) as differ:
        _toy_plan(False, share=as_rank_1(lambda mine: (None, ["0" * 16], ("0" * 16, ""))), lead=False)
    assert str(differ.value) == choose.refusal(
        "--ulysses", "_Toy", "the ranks learned different plans from the same call"
    )


def _candidate_plans_of_toy() -> list[Any]:
    from accel.parallel.automatic import candidate_plans
    from accel.parallel.observe import observe

    lists = (BlockList("blocks", returns=("hidden_states",)),)
    toy = _Toy(False)
    calls = [
        TransformerCall((), {"hidden_states": torch.randn(1, tokens, 4, generator=torch.Generator().manual_seed(1))})
        for tokens in (21, 30)
    ]
    return candidate_plans(toy, observe(toy, calls[0], lists), observe(toy, calls[1], lists), lists, "hidden_states")
