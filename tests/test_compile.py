"""torch.compile (inductor on CPU): equal to eager within tolerance, no recompiles across steps or
calls, the context-parallel attention compiles whole (fullgraph) on 2 gloo ranks, and compile
composes with quantization, First Block Cache, context parallelism and the parallel VAE."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from conftest import FLUX_CALL, generate

import accel
from accel.errors import RecipeError
from accel.hooks import wrappers
import parallel_cases as cases
from accel.models.registry import FAMILIES
from accel.measure import measure
from families import FAMILY_CASES

# float32 inductor kernels reorder sums: compiled vs eager pixel differences seen ≤ 2.1e-6.
TOLERANCE = 1e-4


def test_compiled_blocks_equal_eager_and_never_recompile(tiny_flux: Any, flux_reference: np.ndarray) -> None:
    handle = accel.apply(tiny_flux, {"compile": {"enabled": True}})
    blocks = [block for spec in FAMILIES["flux"].blocks for block in getattr(tiny_flux.transformer, spec.attr)]
    try:
        assert all("forward" in vars(block) for block in blocks)  # compiled on the instance only
        call = {k: v for k, v in FLUX_CALL.items()}
        measured = measure(tiny_flux, call, 0, warmup=1)
        # 2 block classes -> a handful of graphs, however many blocks; none built by the timed call.
        assert 0 < measured.graphs_warmup <= 4 and measured.graphs_timed == 0
        with torch._dynamo.config.patch(error_on_recompile=True):
            again = generate(tiny_flux, FLUX_CALL)
    finally:
        handle.remove()
    assert not any("forward" in vars(block) for block in blocks)
    assert np.abs(again - flux_reference).max() <= TOLERANCE
    assert np.abs(measured.output - flux_reference[0]).max() <= TOLERANCE
    np.testing.assert_array_equal(generate(tiny_flux, FLUX_CALL), flux_reference)  # eager again after remove()


def test_whole_transformer_scope_equals_eager(tiny_flux: Any, flux_reference: np.ndarray) -> None:
    handle = accel.apply(tiny_flux, {"compile": {"enabled": True, "scope": "transformer"}})
    try:
        assert wrappers(tiny_flux.transformer, "forward") == ["accel.compile"]
        output = generate(tiny_flux, FLUX_CALL)
    finally:
        handle.remove()
    # accel's wrapper gone (an earlier test's accelerate offload, removed, may leave its own forward attribute)
    assert wrappers(tiny_flux.transformer, "forward") == []
    assert np.abs(output - flux_reference).max() <= TOLERANCE


@pytest.mark.parametrize(
    "ulysses, ring, keys, heads, pairs",
    [
        (2, 1, 16, 4, False),
        (1, 2, 16, 4, False),
        (2, 1, 15, 4, False),
        (1, 2, 13, 4, False),
        (2, 1, 15, 3, False),
        (2, 1, 15, 3, True),
        (1, 2, 13, 4, True),
    ],
)
def test_attention_functions_compile_fullgraph_on_two_ranks(
    rank_pools, ulysses: int, ring: int, keys: int, heads: int, pairs: bool
) -> None:
    """fullgraph=True raises on any graph break: Ulysses' all-to-all, the ring's shift, the pad-key
    mask, the zero heads padding 3 heads to 4 and a per-head additive pair mask (its heads padded
    likewise, a ring block all -inf for some queries) all stay inside one graph, which a second call reuses."""
    for error, graphs in rank_pools(2).run(cases.compiled_attention, ulysses, ring, keys, heads, pairs):
        assert error <= 1e-5
        assert graphs == 0


# First Block Cache, and DBCache with its head in FLUX's double blocks, its tail in the single ones
# and the TaylorSeer calibrator: the cache wraps the compiled blocks from outside, so neither
# recompiles. TaylorSeer inside the blocks: its modules run outside the compiled graphs (a graph
# break each), so the step schedule is never a guard either.
@pytest.mark.parametrize(
    "cache",
    [
        {"threshold": 0.5},
        {"threshold": 0.5, "method": "dbcache", "first_blocks": 2, "last_blocks": 1, "calibrator": "taylorseer"},
        {"method": "taylorseer", "interval": 2},
        {"method": "magcache", "threshold": 0.1, "mag_ratios": [[1.0, 0.95, 1.05, 1.0, 0.97, 1.02]]},
    ],
    ids=["fbcache", "dbcache-taylorseer", "taylorseer", "magcache"],
)
def test_compile_cache_ulysses_equals_eager_cache_ulysses(rank_pools, cache: dict[str, Any]) -> None:
    eager_recipe = {"parallel": {"ulysses": 2}, "cache": cache}
    compiled_recipe = dict(eager_recipe, compile={"enabled": True})
    call = dict(FLUX_CALL, num_inference_steps=6)
    eager = rank_pools(2).run(cases.counted_run, "tiny-flux", eager_recipe, call)
    compiled = rank_pools(2).run(cases.counted_run, "tiny-flux", compiled_recipe, call)
    for (eager_out, eager_calls, _), (out, calls, graphs) in zip(eager, compiled):
        assert np.abs(out - eager_out).max() <= TOLERANCE
        assert calls == eager_calls and any(cached for *_, cached in calls)  # same decisions, some cached
        # Not again in the second call (the first compiles, unless an earlier case here built the
        # same block classes' graphs: the pool's processes keep them).
        assert graphs[1] == 0 and (graphs[0] > 0 or cache.get("method") is not None)


def test_quant_compile_cache_ulysses_parallel_vae_together(rank_pools) -> None:
    """All five in their documented order on 2 ranks equal one process with quantization and the cache."""
    builder = "accel.models.flux:build_tiny"
    quant_cache = {"quant": {"type": "int8wo"}, "cache": {"threshold": 0.5}}
    everything = dict(quant_cache, compile={"enabled": True}, parallel={"ulysses": 2}, vae={"parallel": True})
    call = dict(FLUX_CALL, num_inference_steps=6)
    reference, reference_calls, _ = cases.counted_run(builder, quant_cache, call, fresh=True)
    (lead, calls, graphs), (other, _, _) = rank_pools(2).run(cases.counted_run, builder, everything, call, True)
    assert np.abs(lead - reference).max() <= TOLERANCE
    assert calls == reference_calls and any(cached for *_, cached in calls)
    assert graphs[1] == 0
    assert (other == 0.5).all()  # the split decode hands pixels to rank 0 only: the others decode zeros


# Inductor's kernels for a dual-stream block and Z-Image's per-sample lists beyond FLUX's (tested
# above). The others trace the same way through dynamo and AOT autograd (aot_eager: graph breaks and
# recompiles are theirs, not the backend's) without compiling C++ kernels no GPU user runs, about 20 s
# a family on 2 cores; LTX-2's audio-video pair alone is 60 kernels, 70 s of CPU, run on one process
# where its attention is plain (its cut video under compile: test_attention_functions_compile_fullgraph).
INDUCTOR_FAMILIES = ("qwenimage", "zimage")


@pytest.mark.parametrize(
    "family",
    [
        "qwenimage",
        "flux2-klein",
        "flux2",
        "sd3",
        "zimage",
        "hunyuan15",
        "skyreels2",
        "ltx2",
        "hunyuanimage",
        "helios",
        "cosmos3",
        "kandinsky6",
        "chronoedit",
        "qwenimage21",
    ],
)
def test_regional_compile_equals_eager_on_the_newer_families(family: str) -> None:
    """Each family's own block classes (Qwen-Image's dual-stream block, FLUX.2's single blocks on
    joined streams, SD 3.5's image-only attention, Z-Image's per-sample lists, LTX-2's two-stream blocks) trace and
    compile,
    equal eager, and a second generation builds no graph; HunyuanVideo 1.5's blocks take the (B, L, L) mask they build
    (Kandinsky 5: tests/test_family_kandinsky5.py). Qwen-Image 2.1's blocks build three graphs, all in the first
    generation: the call that fills the K/V cache, the cached call, and that call again once dynamo stops
    specializing on its sliced input's storage offset; one branch, as true CFG's second only recompiles for its
    negative prompt's length (twice the time, nothing more tested)."""
    call = dict(FAMILY_CASES[family].call, num_inference_steps=2, **FAMILY_CASES[family].compile_call)
    eager, _, _ = cases.tiny_run(f"tiny-{family}", {}, call)
    backend = "inductor" if family in INDUCTOR_FAMILIES else "aot_eager"
    compile_recipe = {"compile": {"enabled": True, "backend": backend}}
    compiled, _, graphs = cases.counted_run(f"tiny-{family}", compile_recipe, call)
    assert np.abs(compiled - eager).max() <= TOLERANCE
    assert graphs[1] == 0


def test_the_backend_reaches_torch_compile_and_a_mode_needs_inductor() -> None:
    """backend = "eager" runs dynamo's graphs with torch's own kernels: the output is eager's to the
    bit, and the graphs are built once. A mode with another backend than inductor is refused."""
    call = dict(FLUX_CALL, num_inference_steps=2)
    eager, _, _ = cases.tiny_run("tiny-flux", {}, call)
    traced, _, graphs = cases.counted_run("tiny-flux", {"compile": {"enabled": True, "backend": "eager"}}, call)
    assert np.array_equal(traced, eager) and graphs[0] > 0 and graphs[1] == 0
    with pytest.raises(RecipeError) as refused:
        accel.Recipe.from_dict({"compile": {"enabled": True, "backend": "aot_eager", "mode": "max-autotune"}})
    assert str(refused.value) == (
        "<dict>: [compile] mode = 'max-autotune' tunes inductor's kernels, and backend = 'aot_eager' makes none; "
        "set mode = 'default' or backend = 'inductor'"
    )


@pytest.mark.parametrize("mode, autotune", [("default", False), ("max-autotune-no-cudagraphs", True)])
def test_mode_reaches_torch_compile(tiny_flux: Any, mode: str, autotune: bool) -> None:
    handle = accel.apply(tiny_flux, {"compile": {"enabled": True, "mode": mode}})
    try:
        blocks = [block for spec in FAMILIES["flux"].blocks for block in getattr(tiny_flux.transformer, spec.attr)]
        (regions,) = handle.compiled
        assert len(regions.functions) == len(blocks)  # one compiled function per block, made at apply
        assert {fn.get_compiler_config()["max_autotune"] for fn in regions.functions} == {autotune}
    finally:
        handle.remove()
