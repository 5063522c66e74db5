"""The fake-CUDA tier: every family's transformer and VAE, as the first or last rank of 2 to 8 GPUs.

Each case builds the real diffusers class on fake `cuda` in bfloat16 (tests/fakecuda.py), puts it
under accel's real engines as `accel.apply` does (ContextParallel, CfgParallel, FirstBlockCache with
compose's cache group and token mask) and runs it as one rank of a `fake` process group. Fake
tensors hold no data, so nothing here checks numbers (the gloo tests do); what a CPU run cannot
show is checked instead:

- no op mixes devices (fake mode raises as a GPU would) or dtypes (the meta kernels raise);
- the output is a bfloat16 `cuda` tensor of the single-process shape;
- each context-parallel attention block ran the intended kernel: flash with no mask wherever the
  real keys are a prefix of the block (nothing padded, or padding only at its end, sliced off on
  the host), the masked efficient kernel only where padding sits inside the block (two padded
  streams side by side) or the model hands its attention a mask (a key mask, or a whole-sequence
  pair mask, bool or additive: every block of keys, padding alone included), as the engine saw it;
- every collective got `cuda` tensors;
- zero host synchronisations inside the forward, except (a) the cache's one decision per call
  once it has a previous residual to compare with, (b) Mochi's own diffusers attention
  processor, which compacts each sample's text with `nonzero` (model code, one per sample and block),
  and (c) HunyuanVideo 1.5's and HunyuanImage 2.1's own forwards, which reorder their text streams
  with boolean masks before the blocks, and Qwen-Image 2.1's, which lays out its tokens from the
  encoder's slot mask (model code, once per call; that mask's values are kept: see FakeCuda.host_values).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the suite may reach a model hub

from collections import Counter  # noqa: E402
from contextlib import nullcontext  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from fakecuda import (  # noqa: E402
    DIVIDING,
    DTYPE,
    HEADS,
    UNEVEN,
    Grid,
    Kernel,
    Layout,
    Probe,
    ToyScheduler,
    fake_cuda,
    fake_mesh,
    fake_rank,
    needs_cuda_build,
    new_fake_mode,
    on_fake_cuda,
    randn,
    run_probed,
)

from families import FAMILY_CASES  # noqa: E402
from family_parallel import splits_sequence  # noqa: E402

from accel.cache.fbcache import FirstBlockCache  # noqa: E402
from accel.cache.sums import _cache_group, _real_tokens  # noqa: E402
from accel.memory.fake_cuda import KnownValues  # noqa: E402
from accel.models.base import Family  # noqa: E402
from accel.parallel.plan_format import ParallelPlan  # noqa: E402
from accel.models.registry import FAMILIES  # noqa: E402
from accel.optimize.processors import install_processors  # noqa: E402
from accel.parallel.cfg import CfgParallel, CfgPlan  # noqa: E402
from accel.parallel.layout import SequenceLayout, group_runs  # noqa: E402
from accel.parallel.mesh import Degrees, ParallelMesh  # noqa: E402
from accel.parallel.outputs import sample_of  # noqa: E402
from accel.parallel.engine import ContextParallel  # noqa: E402
from accel.parallel.plan import resolve_plan  # noqa: E402
from accel.parallel.tensor import TensorParallel, resolve_tensor_plan  # noqa: E402
from accel.steps import StepEvents  # noqa: E402

# MochiRoPE enters a float32 CPU autocast region, which torch warns about and skips; harmless here.
pytestmark = [needs_cuda_build, pytest.mark.filterwarnings("ignore:In CPU autocast:UserWarning", "ignore::UserWarning")]


# -- the families' transformers and inputs ----------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_configs() -> dict[str, tuple[type, dict[str, Any], type, dict[str, Any]]]:
    """(transformer class, config, VAE class, config) of each family's `build_tiny`, built once on the CPU."""
    configs = {}
    for name, family in FAMILIES.items():
        assert family.tiny is not None
        pipe = family.tiny()
        configs[name] = (type(pipe.transformer), dict(pipe.transformer.config), type(pipe.vae), dict(pipe.vae.config))
    return configs


def tiny_overrides(name: str, config: dict[str, Any]) -> dict[str, Any]:
    """HEADS heads of the tiny head size (widths tied to the head count follow it), the fewest blocks
    the cache accepts (two)."""
    fake = FAMILY_CASES[name].fake
    if fake.overrides is not None:
        return fake.overrides(config)
    overrides: dict[str, Any] = {"num_attention_heads": HEADS}
    if "num_single_layers" in config:  # one block of each kind: every op costs time in fake mode
        overrides.update(num_layers=1, num_single_layers=1)
    if fake.more_overrides is not None:
        overrides.update(fake.more_overrides(config, HEADS * config["attention_head_dim"]))
    return overrides


def inputs(name: str, config: dict[str, Any], grid: Grid, batch: int) -> dict[str, Any]:
    """The arguments the family's pipeline passes its transformer, on fake cuda."""
    t = torch.full((batch,), 500.0, device="cuda", dtype=DTYPE)
    return FAMILY_CASES[name].fake.inputs(config, grid, batch, t)


def kv_caches(name: str, config: dict[str, Any], calls: int) -> list[Any] | None:
    """The family's K/V caches, one per CFG branch, as its pipeline makes them; None for most."""
    make = FAMILY_CASES[name].fake.kv_caches
    return None if make is None else make(config, calls)


def expected_shape(name: str, config: dict[str, Any], grid: Grid, batch: int, prefill: bool = False) -> tuple[int, ...]:
    return FAMILY_CASES[name].fake.output_shape(config, grid, batch, prefill)


# -- what the engine should do ----------------------------------------------------------------------
def key_layouts(family: Family, grid: Grid, world: int) -> list[SequenceLayout]:
    """The layout of each stream in the keys of the family's attention, in order (a replicated
    stream's too: the engine shares it out among the ranks for the call)."""
    history = FAMILY_CASES[family.name].fake.history_tokens if family.name in FAMILY_CASES else None
    video = grid.tokens + (history(grid) if history else 0)  # Helios: history, then the chunk
    lengths = {
        "text": grid.text,
        "video": video,
        "image": grid.tokens,
        "hidden": grid.tokens,
        "generation": grid.tokens,  # hidden: the automatic plan's
        "unified": -(-grid.tokens // 32) * 32 + -(-grid.text // 32) * 32,  # Z-Image pads image and caption to 32s
        "prompt": grid.text,
        "target": 4 * grid.rows * grid.cols,
    }  # Qwen-Image 2.1: unpatched, 2x2 tokens a grid cell
    plan = family.parallel
    assert plan is not None
    # The automatic plan names its joint attentions' keys per module (one order for every list of a family here).
    keys = (
        plan.module_keys[0][1]
        if isinstance(plan, ParallelPlan) and plan.output_before and plan.module_keys
        else plan.attention_keys
    )
    return [SequenceLayout(lengths[stream], world) for stream in keys]


def expected_kernels(family: Family, grid: Grid, degrees: Degrees, calls: int, masked: bool) -> Counter[Kernel]:
    """The kernel of every ring block of `calls` attention calls, by the rule in the module docstring
    (a block holding only padding runs none, unless the model's mask (`masked`) makes every block
    masked). Plain Python: this runs under fake mode."""
    layouts = key_layouts(family, grid, degrees.sequence)

    def valid(shard: int) -> list[bool]:  # which of shard p's key slots are real, stream after stream
        return [
            p * layout.shard + i < layout.length for layout in layouts for i in range(layout.shard) for p in [shard]
        ]

    kernels: Counter[Kernel] = Counter()
    for source in range(degrees.ring):  # ring rank `source` holds Ulysses shards source*U .. source*U+U-1
        block = [slot for u in range(degrees.ulysses) for slot in valid(source * degrees.ulysses + u)]
        real = sum(block)
        prefix = block == [i < real for i in range(len(block))]
        if masked or not prefix:
            kernels[Kernel("efficient", True)] += calls
        elif real:
            kernels[Kernel("flash", False)] += calls
    return kernels


def whole_query_kernels(family: Family, grid: Grid, degrees: Degrees, rank: int, blocks: int) -> Counter[Kernel]:
    """The kernels of the plan's whole-query attention (LTX-2's audio to the video): one per block
    run, over this rank's own shard of the keys, cut to its real keys (none where it holds only padding)."""
    assert family.parallel is not None
    if not family.parallel.whole_queries:
        return Counter()
    real = SequenceLayout(grid.tokens, degrees.sequence).real(rank % degrees.sequence)
    return Counter({Kernel("flash", False): blocks}) if real else Counter()


def attention_calls(name: str, config: dict[str, Any], batch: int, cached: bool) -> int:
    """Context-parallel attention calls per forward: one per block run (Mochi: per block and sample);
    a call the cache skips runs block 0 alone."""
    layers = config.get(
        "num_layers", config.get("n_layers", config.get("num_visual_blocks", config.get("num_hidden_layers")))
    )
    blocks = 1 if cached else layers + config.get("num_single_layers", 0)
    return blocks * batch if FAMILY_CASES[name].fake.attention_per_sample else blocks


def model_syncs(name: str, config: dict[str, Any], batch: int, cached: bool) -> int:
    """Host syncs the family's own diffusers code makes per forward (Mochi's text compaction, per block
    run; HunyuanVideo 1.5's check whether the image embeddings are all zero, then its reordering of each
    sample's text stream, valid tokens first, with twelve boolean-mask selections; HunyuanImage 2.1's
    reordering of its glyph and prompt tokens, with eight)."""
    count = FAMILY_CASES[name].fake.model_syncs
    return 0 if count is None else count(config, batch, cached)


# -- one rank of one layout --------------------------------------------------------------------------


@dataclass
class Accelerated:
    """A transformer under the engines as `accel.apply` installs them, and how to undo that;
    `masks`: (shape, dtype) of each attention mask the engine was handed (None: no mask)."""

    transformer: torch.nn.Module
    events: StepEvents
    cache: FirstBlockCache | None
    undo: list[Any]
    masks: list[tuple[tuple[int, ...], torch.dtype] | None]

    def remove(self) -> None:
        while self.undo:
            self.undo.pop()()


def accelerate(
    transformer: torch.nn.Module,
    family: Family,
    layout: Layout,
    mesh: ParallelMesh,
    cache_class: type[FirstBlockCache] = FirstBlockCache,
) -> Accelerated:
    """compose's steps (leaner processors, TP split, parallel, CFG, cache) with compose's own cache
    group and real-token count. The split is not undone: `fake_transformer` keeps a split copy per TP slice."""
    assert family.parallel is not None
    events = StepEvents(ToyScheduler())
    undo: list[Any] = [install_processors(transformer, family)]
    masks: list[tuple[tuple[int, ...], torch.dtype] | None] = []
    engine = None
    if layout.tp > 1:
        assert family.tensor is not None
        TensorParallel(transformer, resolve_tensor_plan(family.tensor, transformer), mesh.tp_group)
    if layout.degrees.sequence > 1:
        engine = ContextParallel(transformer, resolve_plan(family.parallel, transformer), mesh)
        undo.append(engine.remove)
        attend = engine._route.attend

        def seeing(
            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None
        ) -> torch.Tensor:
            masks.append(None if mask is None else (tuple(mask.shape), mask.dtype))
            return attend(q, k, v, mask, scale)

        engine._route.attend = seeing  # type: ignore[method-assign]  # this instance's router is made from it at each forward
    if layout.cfg > 1:
        assert family.cfg is not None
        cfg = CfgParallel(
            {"transformer": transformer},
            CfgPlan(
                family.cfg,
                getattr(family.parallel, "batch_args", ()),
                output_like=family.acceleration.cfg_output_like,
            ),
            mesh,
            events,
        )
        undo.append(cfg.remove)
    cache = None
    if layout.cache:
        handle = SimpleNamespace(mesh=mesh, family=family)
        cache = cache_class(
            transformer,
            family.blocks,
            threshold=0.1,
            primary_stream=family.primary_stream,
            events=events,
            group=_cache_group(handle),
            real_tokens=_real_tokens(engine, family.primary_stream),
        )
        undo.append(cache.remove)
    return Accelerated(transformer, events, cache, undo, masks)


class PlainPending:
    """Test double of `accel.parallel.cfg.Pending` (the other CFG half's output, filled in place
    later): a tensor subclass cannot wrap a FakeTensor, so this is a plain tensor made where Pending
    makes its own (the call's device and dtype) and filled the way Pending fills."""

    def __new__(
        cls, shape: tuple[int, ...] | None, dtype: torch.dtype, device: torch.device, defers: bool = False
    ) -> Any:
        tensor = torch.empty(shape or (0,), dtype=dtype, device=device)

        def fill(value: torch.Tensor) -> None:
            if tensor.shape != value.shape:
                tensor.resize_(value.shape)
            tensor.copy_(value)

        tensor.fill = fill  # type: ignore[method-assign]
        return tensor


@pytest.fixture(autouse=True)
def _fake_mode_pending(monkeypatch: pytest.MonkeyPatch) -> None:
    import accel.parallel.cfg as cfg_module

    if hasattr(cfg_module, "Pending"):
        monkeypatch.setattr(cfg_module, "Pending", PlainPending)


# One fake mode for the module's transformers, each built once (a build is hundreds of init ops);
# every test installs its engines and removes them again.
_MODE = new_fake_mode()
_BUILT: dict[str, torch.nn.Module] = {}


def fake_transformer(cls: type, config: dict[str, Any], split: str = "") -> torch.nn.Module:
    """Built once per class and config (and per TP slice `split`, which outlives the test)."""
    key = f"{cls.__name__}{sorted(config.items())}{split}"
    if key not in _BUILT:
        with fake_cuda(_MODE):
            _BUILT[key] = on_fake_cuda(cls, config)
    return _BUILT[key]


Arguments = Callable[
    [dict[str, Any], Grid, int], dict[str, Any]
]  # (config, grid, batch) -> the transformer's arguments


def run_layout(
    name: str,
    cls: type,
    config: dict[str, Any],
    layout: Layout,
    rank: int,
    cache_class: type[FirstBlockCache] = FirstBlockCache,
    overrides: dict[str, Any] | None = None,
    family: Family | None = None,
    arguments: Arguments | None = None,
) -> list[tuple[tuple[int, ...], torch.dtype] | None]:
    """Denoising steps of `layout` as `rank` (two with the cache: the second is its first comparison),
    every check of the module docstring on each call this rank computes. `family` (a variant's plan)
    and `arguments` replace the family's and `inputs`; returns the masks the engine was handed."""
    family = family or FAMILIES[name]
    config = {**config, **(tiny_overrides(name, config) if overrides is None else overrides)}
    transformer = fake_transformer(cls, config, f"tp{layout.tp}.{rank % layout.tp}" if layout.tp > 1 else "")
    with fake_rank(rank, layout.world):
        mesh = fake_mesh(layout.degrees)  # outside fake mode: the mesh is built from real rank tensors
        known = KnownValues() if FAMILY_CASES[name].fake.host_values else None
        with fake_cuda(_MODE), known or nullcontext():
            accelerated = accelerate(transformer, family, layout, mesh, cache_class)
            try:
                run_steps(name, family, config, layout, rank, accelerated, arguments, known)
            finally:
                accelerated.remove()
    return accelerated.masks


def run_steps(
    name: str,
    family: Family,
    config: dict[str, Any],
    layout: Layout,
    rank: int,
    accelerated: Accelerated,
    arguments: Arguments | None = None,
    known: KnownValues | None = None,
) -> None:
    # Batched CFG: both branches in one call; CFG in two calls: two calls per step, one per half.
    batch = 2 if family.cfg == "batch" and layout.cfg > 1 else 1
    calls = 2 if family.cfg == "calls" and layout.cfg > 1 else 1
    mine = rank // layout.degrees.sequence if calls == 2 else 0
    caches = kv_caches(name, config, calls)  # the first step of each branch fills them, whole on every rank
    prefill = 1 if caches else 0
    steps = (2 if layout.cache else 1) + prefill
    accelerated.events.scheduler.set_timesteps(steps)
    for step in range(steps):
        outputs = []
        for call in range(calls):
            call_arguments = (
                arguments(config, layout.grid, batch) if arguments else inputs(name, config, layout.grid, batch)
            )
            if caches:
                call_arguments |= dict(kv_cache=caches[call], kv_cache_mode="extract" if step < prefill else "cached")
            seen = len(accelerated.masks)
            # The cache's scalar read is scripted "no change", so the second step skips.
            output, probe = run_probed(lambda: accelerated.transformer(**call_arguments), scalars=[0.0], known=known)
            masked = any(mask is not None for mask in accelerated.masks[seen:])
            sample = sample_of(output)
            outputs.append(
                torch.stack(sample) if isinstance(sample, list) else sample
            )  # Z-Image: one tensor per sample
            if call == mine and step < prefill:  # not cut: no attention routed, no token exchanged (TP's sums and
                # the CFG halves' gather after the second call are the only collectives)
                gathers = 1 if calls == 2 and call == 1 else 0
                exchanged = Counter(name for name, _ in probe.collectives if name != "allreduce_")
                assert exchanged == Counter(allgather_=gathers), probe.collectives
            elif call == mine:
                compared = layout.cache and step == steps - 1
                check_call(name, family, config, layout, probe, batch, compared, rank, masked)
                if compared:
                    assert accelerated.cache is not None and accelerated.cache.stats.records[-1].cached
        accelerated.events.scheduler.step()
        for sample in outputs:  # the other half's output too, filled in place by now
            assert sample.shape == expected_shape(name, config, layout.grid, batch, prefill=step < prefill), (
                f"shape {tuple(sample.shape)}"
            )
            assert sample.dtype == DTYPE and sample.device.type == "cuda", f"{sample.dtype} on {sample.device}"


def check_call(
    name: str,
    family: Family,
    config: dict[str, Any],
    layout: Layout,
    probe: Probe,
    batch: int,
    compared: bool,
    rank: int = 0,
    masked: bool = False,
) -> None:
    """Kernels, collectives and syncs of one transformer call this rank computed (`compared`: the
    cache compared this call with the last and, as scripted, skipped the later blocks; `masked`: the
    model handed the engine an attention mask in it)."""
    local_batch = batch // layout.cfg if family.cfg == "batch" else batch
    if layout.degrees.sequence > 1:
        calls = attention_calls(name, config, local_batch, compared)
        expected = expected_kernels(family, layout.grid, layout.degrees, calls, masked)
        expected += whole_query_kernels(family, layout.grid, layout.degrees, rank, calls)
        shared = FAMILY_CASES[name].fake.shared_keys
        if shared:  # the shared stretch: one unmasked block per call, on every rank's own queries
            cut = replace(
                family.parallel,
                attention_keys=tuple(k for k in family.parallel.attention_keys if k != shared),
            )
            expected = expected_kernels(
                family.with_acceleration(parallel=cut), layout.grid, layout.degrees, calls, masked
            )
            expected[Kernel("flash", False)] += calls
        assert probe.fused() == expected, f"attention kernels {dict(probe.fused())}, expected {dict(expected)}"
    assert not probe.non_cuda_collectives(), f"collectives off the GPU: {probe.non_cuda_collectives()}"
    if layout.tp > 1:  # the row-wise layers' sums ran, on the GPU
        assert any(name.startswith("allreduce") for name, _ in probe.collectives), probe.collectives
    cache_syncs = [s for s in probe.syncs if s.where.startswith("accel/cache/")]
    model = [s for s in probe.syncs if s.where.startswith("diffusers/")]
    other = [s for s in probe.syncs if s not in cache_syncs and s not in model]
    assert not other, "host sync in the forward: " + "; ".join(map(str, other))
    assert len(model) == model_syncs(name, config, local_batch, compared), "model syncs: " + "; ".join(map(str, model))
    assert len(cache_syncs) == (1 if compared else 0), "cache syncs: " + "; ".join(map(str, cache_syncs))


# -- the matrix -----------------------------------------------------------------------------------------
# For every family: Ulysses, Ring and USP; world sizes 2, 3, 4 and 8; token counts that divide and
# that do not; the cache on and off; CFG parallel in the family's own style (batched or two calls).
LAYOUTS = [
    Layout(world=2, ulysses=2, cache=True),
    Layout(world=3, ring=3, grid=UNEVEN),
    Layout(world=4, ulysses=2, ring=2, cache=True, grid=UNEVEN),
    Layout(world=8, ulysses=2, ring=2, cfg=2, cache=True),
    # Tensor parallelism inside the others: each TP rank's own heads through Ulysses; CFG halves x Ring.
    Layout(world=4, ulysses=2, tp=2, cache=True),
    Layout(world=8, ring=2, cfg=2, tp=2, cache=True, grid=UNEVEN),
]


def alternating(names: list[str], settings: list[Any]) -> list[Any]:
    """(name, setting, rank) cases, the rank alternately the first and the last: each family runs as
    both over its settings, and each setting as both over the families, at half the cases of running
    every one as both (a rank's share of the tokens, padding and collectives is the same code for
    every family)."""
    cases = []
    for i, name in enumerate(names):
        for j, setting in enumerate(settings):
            rank = ("first", "last")[(i + j) % 2]
            cases.append(pytest.param(name, setting, rank, id=f"{name}-{setting}-{rank}"))
    return cases


@pytest.mark.parametrize("name, layout, rank_of", alternating(list(FAMILIES), LAYOUTS))
def test_family_on_fake_cuda(name: str, layout: Layout, rank_of: str, tiny_configs: Any) -> None:
    """Device, dtype, shape, kernel, collective and sync checks of the module docstring, on each call
    of one or two steps; syncs allowed: the cache's one decision on its comparing call, Mochi's own."""
    if not splits_sequence(name):  # Ulysses and Ring refused up front: the layout's CFG and TP degrees alone, once each
        if layout.cfg == layout.tp == 1:
            pytest.skip(f"{FAMILIES[name].title}'s sequence is not cut, and this layout has no CFG or TP degree")
        layout = replace(layout, world=layout.cfg * layout.tp, ulysses=1, ring=1)
    cls, config, _, _ = tiny_configs[name]
    if layout.cfg > 1 and FAMILIES[name].cfg is None:  # no CFG branches (FLUX.2-dev): every rank splits tokens
        layout = replace(layout, ulysses=layout.ulysses * layout.cfg, cfg=1)
    masks = run_layout(name, cls, config, layout, 0 if rank_of == "first" else layout.world - 1)
    if layout.degrees.sequence > 1:
        assert any(masks) == FAMILY_CASES[name].fake.masking, masks


# -- real widths ------------------------------------------------------------------------------------------
# Each family's transformer at its real model's width and the layout it runs as there (its case's fake.real_*).
REAL = {
    name: (case.fake.real_config, case.fake.real_layout)
    for name, case in FAMILY_CASES.items()
    if case.fake.real_config is not None and case.fake.real_layout is not None
}


@pytest.mark.parametrize("name", list(REAL))
def test_real_width_on_fake_cuda(name: str, tiny_configs: Any) -> None:
    """The same checks at the real models' widths and token counts (one or two blocks of each kind),
    as the last rank: the one that holds the end of every stream."""
    config, layout = REAL[name]
    cls = tiny_configs[name][0]
    run_layout(name, cls, config, layout, layout.world - 1, overrides={})


# Tensor parallelism at real widths: FLUX.1-dev's 24 heads as 12 per TP rank through Ulysses 4;
# FLUX.2-dev's fused QKV + MLP projection split over tp 4; Wan 14B's across-heads norms over CFG
# halves x tp 2 x Ulysses 2; LTX-2's per-head ("split") rotary tables and audio stream over tp 2 x Ulysses 4;
# Cosmos 3's grouped key/value heads over CFG halves x tp 4.
REAL_TP = {
    "flux-tp2-ulysses4": (
        "flux",
        REAL["flux"][0],
        Layout(world=8, ulysses=4, tp=2, cache=True, grid=Grid(1, 64, 64, 512)),
    ),
    "flux2-tp4-ulysses2": (
        "flux2",
        REAL["flux2"][0],
        Layout(world=8, ulysses=2, tp=4, cache=True, grid=Grid(1, 64, 64, 512)),
    ),
    "wan-cfg2-tp2-ulysses2": (
        "wan",
        REAL["wan"][0],
        Layout(world=8, ulysses=2, cfg=2, tp=2, cache=True, grid=Grid(21, 30, 52, 512)),
    ),
    "ltx2-tp2-ulysses4": ("ltx2", REAL["ltx2"][0], Layout(world=8, ulysses=4, tp=2, grid=Grid(16, 16, 24, 1024))),
    # Cosmos 3's grouped key/value heads over tp 4 (8 query and 2 key/value heads a rank), its two calls on CFG halves.
    "cosmos3-cfg2-tp4": (
        "cosmos3",
        REAL["cosmos3"][0],
        Layout(world=8, cfg=2, tp=4, cache=True, grid=Grid(48, 23, 40, 300)),
    ),
}


@pytest.mark.parametrize("rank_of", ["first", "last"])
@pytest.mark.parametrize("case", list(REAL_TP))
def test_tensor_parallel_at_real_width_on_fake_cuda(case: str, rank_of: str, tiny_configs: Any) -> None:
    name, config, layout = REAL_TP[case]
    run_layout(name, tiny_configs[name][0], config, layout, 0 if rank_of == "first" else layout.world - 1, overrides={})


# Ulysses degrees that do not divide the heads (padded to a multiple in the all-to-all), as the first
# and the last rank: FLUX.1's 24 heads over 16 ranks (32 slots), Wan 14B's 40 heads over 16 (48 slots).
UNEVEN_HEADS = {
    "flux-ulysses16": ("flux", REAL["flux"][0], Layout(world=16, ulysses=16, grid=Grid(1, 64, 64, 512))),
    "wan-ulysses16": ("wan", REAL["wan"][0], Layout(world=16, ulysses=16, cache=True, grid=Grid(21, 30, 52, 512))),
}


@pytest.mark.parametrize("rank_of", ["first", "last"])
@pytest.mark.parametrize("case", list(UNEVEN_HEADS))
def test_heads_the_ulysses_degree_does_not_divide_on_fake_cuda(case: str, rank_of: str, tiny_configs: Any) -> None:
    name, config, layout = UNEVEN_HEADS[case]
    assert config["num_attention_heads"] % layout.ulysses
    run_layout(name, tiny_configs[name][0], config, layout, 0 if rank_of == "first" else layout.world - 1, overrides={})


@pytest.mark.parametrize("rank_of", ["first", "last"])
def test_token_replace_first_frame_count_on_fake_cuda(rank_of: str, tiny_configs: Any) -> None:
    """HunyuanVideo-I2V's token-replace transformer: each rank's blocks get the count of first-frame
    tokens its own shard holds (LeadingCount, host arithmetic), with no sync: 2 latent frames of 5x7 on
    Ring 3 put 24, 11 and 0 of the first frame's 35 tokens on the three ranks."""
    cls, config, _, _ = tiny_configs["hunyuan"]
    layout = Layout(world=3, ring=3, grid=Grid(frames=2, rows=5, cols=7, text=37))
    run_layout(
        "hunyuan",
        cls,
        {**config, "image_condition_type": "token_replace"},
        layout,
        0 if rank_of == "first" else layout.world - 1,
    )


# -- plan features one rank at a time: grouped tokens, whole-sequence pair masks ----------------------------
@pytest.fixture(scope="session")
def animate_config() -> dict[str, Any]:
    """Wan Animate's tiny transformer config (build_tiny_animate), built once on the CPU."""
    from accel.models.wan import build_tiny_animate

    return dict(build_tiny_animate().transformer.config)


def animate_inputs(config: dict[str, Any], grid: Grid, batch: int) -> dict[str, Any]:
    """What WanAnimatePipeline hands its transformer: the reference frame and `grid.frames` - 1 latent
    frames (noise, condition latents and mask: 2C + 4 channels), the pose latents, the CLIP picture
    features and 4 (F - 1) - 3 face crops, which the face encoder turns into one motion item per frame
    after the reference's (the transformer prepends a zero item for it)."""
    f, h, w = grid.frames, 2 * grid.rows, 2 * grid.cols
    latent = config["latent_channels"]
    return dict(
        hidden_states=randn(batch, 2 * latent + 4, f, h, w),
        pose_hidden_states=randn(batch, latent, f - 1, h, w),
        timestep=torch.full((batch,), 500.0, device="cuda", dtype=DTYPE),
        encoder_hidden_states=randn(batch, grid.text, config["text_dim"]),
        encoder_hidden_states_image=randn(batch, 5, config["image_dim"]),
        face_pixel_values=randn(
            batch, 3, 4 * (f - 1) - 3, config["motion_encoder_size"], config["motion_encoder_size"]
        ),
        return_dict=False,
    )


# 5 latent frames of 3x5 patches, 75 tokens: Ulysses 2's shards of 38 end mid-frame 2, Ring 3's of 25 mid-frames 1 and
# 3.
ANIMATE_GRID = Grid(frames=5, rows=3, cols=5, text=37)


@pytest.mark.parametrize("rank_of", ["first", "last"])
@pytest.mark.parametrize(
    "layout", [Layout(world=2, ulysses=2, grid=ANIMATE_GRID), Layout(world=3, ring=3, grid=ANIMATE_GRID)], ids=str
)
def test_grouped_tokens_on_fake_cuda(layout: Layout, rank_of: str, animate_config: dict[str, Any]) -> None:
    """Wan Animate's face adapter (GroupedTokens) on each rank's own frames, a frame the ranks cut run
    as a frame of its own: the runs are host arithmetic on the layout, so no sync; every slice, the
    padding it appends and the adapter's local attention stay on the device; the blocks' attention
    runs flash (padding only at the end of the last shard, cut on the host)."""
    from diffusers import WanAnimateTransformer3DModel

    from accel.models.variants import variant_of

    wan = FAMILIES["wan"]
    family = wan.with_acceleration(parallel=variant_of(wan, "WanAnimatePipeline").parallel)
    rank = 0 if rank_of == "first" else layout.world - 1
    runs: list[int] = []  # tokens of each face adapter call
    adapters = fake_transformer(WanAnimateTransformer3DModel, animate_config).face_adapter
    hooks = [
        adapter.to_q.register_forward_pre_hook(lambda _m, args: runs.append(args[0].shape[1])) for adapter in adapters
    ]
    try:
        masks = run_layout(
            "wan",
            WanAnimateTransformer3DModel,
            animate_config,
            layout,
            rank,
            overrides={},
            family=family,
            arguments=animate_inputs,
        )
    finally:
        for hook in hooks:
            hook.remove()
    assert masks and not any(masks)
    own = [
        run.tokens for run in group_runs(SequenceLayout(ANIMATE_GRID.tokens, layout.world), rank, ANIMATE_GRID.frames)
    ]
    assert len(own) == 2 and runs == own * len(adapters)  # a part of a cut frame and whole frames, per adapter


# SkyReels-V2 diffusion forcing with causal blocks of 2 latent frames: 4 frames of 5x7 (140 tokens) on Ring 3,
# 6 of them (210) on CFG-free USP 2x2 with the cache; neither divides.
CAUSAL_BLOCKS = [
    Layout(world=3, ring=3, grid=Grid(frames=4, rows=5, cols=7, text=37)),
    Layout(world=4, ulysses=2, ring=2, cache=True, grid=Grid(frames=6, rows=5, cols=7, text=37)),
]


@pytest.mark.parametrize("rank_of", ["first", "last"])
@pytest.mark.parametrize("layout", CAUSAL_BLOCKS, ids=str)
def test_block_causal_pair_mask_on_fake_cuda(layout: Layout, rank_of: str, tiny_configs: Any) -> None:
    """The (1, 1, L, L) bool mask SkyReels-V2's forward builds when `num_frame_per_block` > 1 reaches
    the engine whole; each rank pads it once, slices its rows and each key block's columns on the
    device (no sync), and every ring block runs the masked efficient kernel."""
    cls, config, _, _ = tiny_configs["skyreels2"]
    tokens = layout.grid.tokens
    # As the pipeline's causal_block_size sets it; out of _use_default_values, which from_config would reset.
    config = {**{key: value for key, value in config.items() if key != "_use_default_values"}, "num_frame_per_block": 2}
    masks = run_layout("skyreels2", cls, config, layout, 0 if rank_of == "first" else layout.world - 1)
    assert set(masks) == {((1, 1, tokens, tokens), torch.bool)}


def ltx2_reference_mask_inputs(config: dict[str, Any], grid: Grid, batch: int) -> dict[str, Any]:
    """LTX-2's inputs with LTX2InContextPipeline's (B, L, L) float self-attention mask over the video
    tokens (multiplicative strengths in [0, 1], made an additive bias by the transformer)."""
    return dict(
        inputs("ltx2", config, grid, batch),
        video_self_attention_mask=torch.rand(batch, grid.tokens, grid.tokens, device="cuda"),
    )


@pytest.mark.parametrize("rank_of", ["first", "last"])
@pytest.mark.parametrize(
    "layout",
    [Layout(world=3, ring=3, grid=UNEVEN), Layout(world=8, ulysses=2, ring=2, cfg=2, cache=True, grid=UNEVEN)],
    ids=str,
)
def test_additive_pair_mask_on_fake_cuda(layout: Layout, rank_of: str, tiny_configs: Any) -> None:
    """LTX-2 IC-LoRA's reference-strength mask: diffusers' attention pads it with the cut key count and
    repeats it per head, (B, H, L, L + keys); the engine drops those columns, takes its rows, Ulysses
    heads and key blocks, excludes padded keys, all on the device with no sync; CFG halves take their
    batch of it; every ring block of the video self-attention runs the masked efficient kernel (the
    audio's attention to the video stays flash)."""
    cls, config, _, _ = tiny_configs["ltx2"]
    rank = 0 if rank_of == "first" else layout.world - 1
    masks = run_layout("ltx2", cls, config, layout, rank, arguments=ltx2_reference_mask_inputs)
    heads = tiny_overrides("ltx2", config)[
        "num_attention_heads"
    ]  # a CFG half's batch of 1, its padding columns dropped
    assert set(masks) == {None, ((1, heads, UNEVEN.tokens, UNEVEN.tokens), torch.bfloat16)}


@pytest.mark.parametrize("rank_of", ["first", "last"])
def test_dfr_keyframe_marker_on_fake_cuda(rank_of: str, tiny_configs: Any) -> None:
    """LTX-2.5 DFR's transformer on Ring 3 at 7 latent frames of 5x7 (a DFR canvas with an appended
    keyframe and a slot, 245 tokens): its keyframe marker and per-token timesteps are cut with the
    tokens, on the device, with no host sync."""
    cls, config, _, _ = tiny_configs["ltx2"]
    layout = Layout(world=3, ring=3, grid=Grid(frames=7, rows=5, cols=7, text=37))
    run_layout(
        "ltx2",
        cls,
        {**config, "use_keyframes_abs_pos_embedding": True},
        layout,
        0 if rank_of == "first" else layout.world - 1,
    )


def test_cudnn_where_the_gpu_is_hopper(monkeypatch: pytest.MonkeyPatch, tiny_configs: Any) -> None:
    """With the capability known to be 9.0 the unmasked blocks run cuDNN (flash where it is unknown)."""
    import accel.parallel.kernels as kernels

    monkeypatch.setattr(kernels, "cuda_capability", lambda index: (9, 0))
    layout = Layout(world=2, ring=2)
    with fake_rank(1, 2):
        mesh = fake_mesh(layout.degrees)
        cls, config, _, _ = tiny_configs["wan"]
        config = {**config, **tiny_overrides("wan", config)}
        transformer = fake_transformer(cls, config)
        with fake_cuda(_MODE):
            accelerated = accelerate(transformer, FAMILIES["wan"], layout, mesh)
            try:
                _, probe = run_probed(lambda: transformer(**inputs("wan", config, DIVIDING, 1)))
            finally:
                accelerated.remove()
    assert probe.fused() == Counter({Kernel("cudnn", False): 2 * 2})  # two blocks, two ring blocks each


# -- the tier catches the defects it exists for -------------------------------------------------------------
class CpuMaskCache(FirstBlockCache):
    """Defect 1 reintroduced: the pad-token mask built on the CPU (as `SequenceLayout.valid()` built
    it) and multiplied into the residual, which lives on the GPU."""

    def _relative_change(self, residual: torch.Tensor, previous: torch.Tensor) -> float:
        real = self.real_tokens() if self.real_tokens is not None else None
        if real is not None:
            weights = (torch.arange(residual.shape[-2]) < real).to(residual.dtype).view(-1, 1)
            residual, previous = residual * weights, previous * weights
        return super()._relative_change(residual, previous)


def test_tier_catches_a_cpu_token_mask(tiny_configs: Any) -> None:
    cls, config, _, _ = tiny_configs["flux"]
    layout = Layout(world=4, ulysses=2, ring=2, cache=True, grid=UNEVEN)
    with pytest.raises(RuntimeError, match="devices"):
        run_layout("flux", cls, config, layout, 3, cache_class=CpuMaskCache)


def test_tier_catches_a_host_sync_in_the_ring(monkeypatch: pytest.MonkeyPatch, tiny_configs: Any) -> None:
    """Defect 3 reintroduced: the ring's block function asks the GPU whether every key is real."""
    import accel.parallel.attention as attention

    block = attention._block

    def syncing_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: Any, scale: float | None) -> Any:
        valid = getattr(keys, "valid", keys)
        if valid is not None:
            bool(valid.all())
        return block(q, k, v, keys, scale)

    monkeypatch.setattr(attention, "_block", syncing_block)
    cls, config, _, _ = tiny_configs["wan"]
    with pytest.raises(
        AssertionError, match="host sync in the forward: _local_scalar_dense at tests/test_fake_cuda.py"
    ):
        run_layout("wan", cls, config, Layout(world=3, ring=3, grid=UNEVEN), 2)


# -- parallel VAE decode ----------------------------------------------------------------------------------------
def vae_latents(vae_config: dict[str, Any], video: bool) -> torch.Tensor:
    channels = int(vae_config.get("latent_channels") or vae_config["z_dim"])
    if video or "z_dim" in vae_config:  # Wan-style causal 3D VAEs take a frame dim for images too (Qwen-Image)
        return randn(1, channels, 2 if video else 1, 8, 8)
    shape = (1, channels, 8, 8)
    return randn(*shape)


_VAES: dict[str, tuple[Any, torch.Tensor, tuple[int, ...]]] = {}  # the VAE, its latents, the whole decode's shape


@pytest.mark.parametrize("name, ranks, rank_of", alternating(list(FAMILIES), [4]))
def test_vae_decode_on_fake_cuda(
    name: str, ranks: int, rank_of: str, tiny_configs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each family's VAE split over 4 ranks: same shape as the whole decode, bf16 on cuda (zeros on
    the ranks the pixels do not go to), cuda collectives, no host sync. LTX's decoder agrees on the
    CUDA random state first, which needs a CUDA runtime: that step is stubbed out here."""
    from accel.vae import ParallelDecode, plan_for

    _, _, vae_cls, vae_config = tiny_configs[name]
    monkeypatch.setattr(ParallelDecode, "_agree_on_random_state", lambda self, device: None)
    rank = 0 if rank_of == "first" else ranks - 1
    with fake_rank(rank, ranks), fake_cuda(_MODE):
        if name not in _VAES:
            vae = on_fake_cuda(vae_cls, vae_config)
            latents = vae_latents(vae_config, FAMILIES[name].output == "video")
            whole, _ = run_probed(lambda: vae.decode(latents, return_dict=False)[0])
            _VAES[name] = (vae, latents, tuple(whole.shape))
        vae, latents, whole_shape = _VAES[name]
        engine = ParallelDecode(vae, plan_for(vae))
        try:
            split, probe = run_probed(lambda: vae.decode(latents, return_dict=False)[0])
        finally:
            engine.remove()
    assert engine.calls >= 1
    assert tuple(split.shape) == whole_shape and split.dtype == DTYPE and split.device.type == "cuda"
    assert probe.collectives and not probe.non_cuda_collectives(), probe.non_cuda_collectives()
    assert not probe.syncs, "host sync in the decode: " + "; ".join(map(str, probe.syncs))


def test_dbcache_with_taylorseer_on_fake_cuda(tiny_configs: Any) -> None:
    """DBCache on FLUX's 2 + 2 blocks, head two (the double list), tail one (the last single block),
    TaylorSeer of order 2, on Ulysses 2 at an uneven token count: a cached call runs the head and
    the tail and not the middle; the extrapolation from three computed calls stays on the device,
    so the cache's decision is still the only host sync of a call."""
    from accel.cache.blocks import BlockCache

    cls, config, _, _ = tiny_configs["flux"]
    config = {**config, **tiny_overrides("flux", config), "num_layers": 2, "num_single_layers": 2}
    transformer = fake_transformer(cls, config)
    family, layout = FAMILIES["flux"], Layout(world=2, ulysses=2, cache=True, grid=UNEVEN)
    assert family.parallel is not None
    blocks = [block for spec in family.blocks for block in getattr(transformer, spec.attr)]
    ran: Counter[int] = Counter()
    hooks = [
        block.attn.register_forward_pre_hook(lambda *_, index=index: ran.update([index]))
        for index, block in enumerate(blocks)
    ]
    try:
        with fake_rank(1, 2):
            mesh = fake_mesh(layout.degrees)
            with fake_cuda(_MODE):
                engine = ContextParallel(transformer, resolve_plan(family.parallel, transformer), mesh)
                cache = BlockCache(
                    transformer,
                    family.blocks,
                    threshold=0.1,
                    first_blocks=2,
                    last_blocks=1,
                    calibrator="taylorseer",
                    taylor_order=2,
                    primary_stream=family.primary_stream,
                    group=mesh.sequence_group,
                    real_tokens=_real_tokens(engine, family.primary_stream),
                )
                try:
                    # Call 0 has nothing to compare with; calls 1 and 2 are scripted "changed", call 3 "unchanged".
                    for call, answer in enumerate((None, 1.0, 1.0, 0.0)):
                        ran.clear()
                        output, probe = run_probed(
                            lambda: transformer(**inputs("flux", config, UNEVEN, 1)),
                            scalars=[] if answer is None else [answer],
                        )
                        sample = sample_of(output)
                        assert (
                            sample.shape == expected_shape("flux", config, UNEVEN, 1) and sample.device.type == "cuda"
                        )
                        syncs = [s for s in probe.syncs if not s.where.startswith("diffusers/")]
                        assert [s.where.startswith("accel/cache/") for s in syncs] == (
                            [] if answer is None else [True]
                        ), syncs
                        assert not probe.non_cuda_collectives()
                        assert sorted(ran) == ([0, 1, 3] if call == 3 else [0, 1, 2, 3])
                finally:
                    cache.remove()
                    engine.remove()
    finally:
        for hook in hooks:
            hook.remove()
    assert [record.cached for record in cache.stats.records] == [False, False, False, True]


def test_taylorseer_inside_the_blocks_on_fake_cuda(tiny_configs: Any) -> None:
    """method = "taylorseer" on Wan (two-call CFG halves on separate ranks, Ulysses 2 in each, as
    the last rank): the extrapolated call runs no attention kernel and none of attention's
    collectives (what is left is the output's gather), and neither kind of call makes a host sync
    (the schedule is host arithmetic on the step)."""
    from accel.cache.taylorseer import TaylorSeerCache

    cls, config, _, _ = tiny_configs["wan"]
    config = {**config, **tiny_overrides("wan", config)}
    transformer = fake_transformer(cls, config)
    family, layout = FAMILIES["wan"], Layout(world=4, ulysses=2, cfg=2, grid=UNEVEN)
    with fake_rank(3, 4):
        mesh = fake_mesh(layout.degrees)
        with fake_cuda(_MODE):
            accelerated = accelerate(transformer, family, layout, mesh)
            cache = TaylorSeerCache(transformer, family.blocks, interval=3, events=accelerated.events)
            collectives = {}
            try:
                accelerated.events.scheduler.set_timesteps(4)
                for step in range(4):  # computed, computed (a second point), extrapolated, computed (step 3)
                    for half in range(2):
                        output, probe = run_probed(lambda: transformer(**inputs("wan", config, UNEVEN, 1)))
                        if half == 1:  # this rank's half
                            extrapolated = step == 2
                            assert cache.stats.records[-1].cached == extrapolated
                            assert bool(probe.fused()) != extrapolated
                            collectives[step] = len(probe.collectives)
                            assert not probe.non_cuda_collectives()
                            assert not [s for s in probe.syncs if not s.where.startswith("diffusers/")], probe.syncs
                            assert sample_of(output).device.type == "cuda"
                    accelerated.events.scheduler.step()
                assert collectives[2] < collectives[1] == collectives[3]
            finally:
                cache.remove()
                accelerated.remove()
    assert [(record.step, record.branch) for record in cache.stats.records] == [(step, 1) for step in range(4)]


def test_magcache_on_fake_cuda(tiny_configs: Any) -> None:
    """MagCache on FLUX, Ulysses 2 at an uneven token count, as the last rank: a skipped call runs no
    block (no attention kernel), and no call makes a host sync (the rule reads the curve only)."""
    from accel.cache.magcache import MagCache

    cls, config, _, _ = tiny_configs["flux"]
    config = {**config, **tiny_overrides("flux", config)}
    transformer = fake_transformer(cls, config)
    family, layout = FAMILIES["flux"], Layout(world=2, ulysses=2, cache=True, grid=UNEVEN)
    assert family.parallel is not None
    with fake_rank(1, 2):
        mesh = fake_mesh(layout.degrees)
        with fake_cuda(_MODE):
            engine = ContextParallel(transformer, resolve_plan(family.parallel, transformer), mesh)
            cache = MagCache(
                transformer,
                family.blocks,
                threshold=0.5,
                mag_ratios=[[1.0, 0.9, 0.9, 0.9]],
                primary_stream=family.primary_stream,
                group=mesh.sequence_group,
                real_tokens=_real_tokens(engine, family.primary_stream),
            )
            try:
                for call in range(4):  # accumulated errors 0, 0.1, 0.29, 0.561: computed, skipped, skipped, computed
                    output, probe = run_probed(lambda: transformer(**inputs("flux", config, UNEVEN, 1)))
                    assert (
                        sample_of(output).shape == expected_shape("flux", config, UNEVEN, 1)
                        and sample_of(output).device.type == "cuda"
                    )
                    assert not [s for s in probe.syncs if not s.where.startswith("diffusers/")], probe.syncs
                    assert bool(probe.fused()) == (call in (0, 3))
            finally:
                cache.remove()
                engine.remove()
    assert [record.cached for record in cache.stats.records] == [False, True, True, False]


# -- the automatic plan --------------------------------------------------------------------------------
# The plan accel learns from each tiny transformer (accel/parallel/automatic.py, verified on simulated
# ranks on the CPU) in place of the family's hand plan, at the real widths and token counts: the same
# checks of placement, dtypes, kernels, collectives and syncs. FLUX: joint attention with the text whole
# on every rank and a rotary table over text and image (whole_streams); Wan: cross-attention run locally,
# CFG halves; HunyuanVideo 1.5: its pair masks read as key masks; all gathered before the first module
# after the blocks (output_before).
@pytest.mark.parametrize("name", ["flux", "wan", "hunyuan15"])
def test_automatic_plan_at_real_width_on_fake_cuda(
    name: str, tiny_configs: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import parallel_cases as cases
    from accel.parallel.choose import automatic_plan, probe_calls

    monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path))
    family = FAMILIES[name]
    pipe = cases.tiny_pipeline(f"tiny-{name}")
    call, other = probe_calls(pipe, pipe.transformer)
    plan = automatic_plan(pipe.transformer, call, other, family.blocks, family.primary_stream, 2, 1, "[parallel]")
    assert plan.output_before
    config, layout = REAL[name]
    run_layout(
        name,
        tiny_configs[name][0],
        config,
        layout,
        layout.world - 1,
        overrides={},
        family=family.with_acceleration(parallel=plan),
    )
