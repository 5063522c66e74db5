"""`accel plan`: the estimate on fake CUDA against the same tracker on real CPU tensors, per-rank
weight bytes against a real TP split, the plan's verdicts on the flagships, and its refusals."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from fakecuda import needs_cuda_build
from typer.testing import CliRunner

from accel.cli import app
from accel.memory.build import build
from accel.memory.candidates import RESERVED
from accel.memory.plan import make_plan
from accel.memory.weights import transformer_weights, weight_bytes
from accel.memory.working import transformer_working, vae_working
from accel.memory.tracker import tracked_peak
from accel.models.flagships import FLAGSHIPS, Component, Size
from accel.models.registry import FAMILIES
from accel.parallel.mesh import Degrees
from accel.parallel.tensor import resolve_tensor_plan, split_module

# FLUX.1-dev's widths of its inputs (4096-wide T5 features) into a mid-size transformer: 4 heads of 64,
# two blocks of each kind; small enough to run for real on the CPU.
MID_FLUX = dict(
    guidance_embeds=True,
    num_attention_heads=4,
    attention_head_dim=64,
    num_layers=2,
    num_single_layers=2,
    axes_dims_rope=(8, 28, 28),
)
SMALL_VAE = dict(FLAGSHIPS["flux"].components[3].config, block_out_channels=(32, 64, 64, 64), norm_num_groups=32)


def run_cli(argv: list[str]) -> object:
    return CliRunner().invoke(app, argv, catch_exceptions=False)


def mid_flagship(transformer: dict, vae: dict | None = None) -> object:
    flux = FLAGSHIPS["flux"]
    return dataclasses.replace(
        flux,
        components=(
            Component("transformer", "diffusers", "FluxTransformer2DModel", transformer),
            Component("vae", "diffusers", "AutoencoderKL", vae or SMALL_VAE),
        ),
    )


@pytest.mark.parametrize("degrees", [Degrees(), Degrees(ulysses=2), Degrees(tp=2)], ids=lambda d: d.describe())
@pytest.mark.parametrize("side", [256, 512])
@needs_cuda_build
def test_fake_cuda_estimate_equals_the_real_cpu_peak(side: int, degrees: Degrees) -> None:
    """The working memory measured on fake CUDA within 10 % of the same forward on real CPU tensors."""
    flagship = mid_flagship(MID_FLUX)
    size = Size(side, side)
    estimate = transformer_working(FAMILIES["flux"], flagship, size, degrees, "cuda")
    real = transformer_working(FAMILIES["flux"], flagship, size, degrees, "cpu")
    assert real > 1_000_000
    assert abs(estimate - real) <= 0.10 * real, (estimate, real)


@needs_cuda_build
def test_vae_decode_estimate_equals_the_real_cpu_peak() -> None:
    flagship = mid_flagship(MID_FLUX)
    estimate = vae_working(flagship, Size(128, 128), "cuda")
    real = vae_working(flagship, Size(128, 128), "cpu")
    assert real > 2_500_000
    assert abs(estimate - real) <= 0.10 * real, (estimate, real)


@needs_cuda_build
def test_a_tiled_vae_decode_estimate_equals_the_real_cpu_peak_and_is_smaller() -> None:
    """[vae] tiling: diffusers' tiled decode (64-pixel tiles here) measured on fake CUDA as on real tensors."""
    flagship = mid_flagship(MID_FLUX, dict(SMALL_VAE, sample_size=64))
    estimate = vae_working(flagship, Size(128, 128), "cuda", tiling=True)
    real = vae_working(flagship, Size(128, 128), "cpu", tiling=True)
    assert abs(estimate - real) <= 0.10 * real, (estimate, real)
    assert real < 0.5 * vae_working(flagship, Size(128, 128), "cuda")


@needs_cuda_build
def test_a_vae_decode_split_over_two_ranks_estimate_equals_rank_0s_real_cpu_peak_and_is_smaller() -> None:
    """[vae] parallel: accel's row split over 2 ranks, rank 0 on fake CUDA and on real CPU tensors (the
    process group is torch's `fake` one either way: rank 0 allocates every buffer a gloo run does)."""
    flagship = mid_flagship(MID_FLUX)
    estimate = vae_working(flagship, Size(128, 128), "cuda", ranks=2)
    real = vae_working(flagship, Size(128, 128), "cpu", ranks=2)
    assert abs(estimate - real) <= 0.10 * real, (estimate, real)
    assert real < 0.9 * vae_working(flagship, Size(128, 128), "cuda")  # rank 0 still gathers the whole image


def test_tracker_sees_what_a_forward_holds() -> None:
    """On real tensors: weights are the parameters' bytes; the working peak at least the widest activation."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    x = torch.randn(128, 256)
    peak = tracked_peak(lambda: model(x), model)
    assert peak is not None
    assert peak.weights == sum(p.numel() * 4 for p in model.parameters())
    assert peak.working >= 128 * 1024 * 4 * 2  # the hidden layer and its GELU live together


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_weight_bytes_equal_a_real_split(tp: int) -> None:
    """Per-rank transformer bytes counted on meta equal those of a real transformer split by the engine."""
    family = FAMILIES["flux"]
    component = Component("transformer", "diffusers", "FluxTransformer2DModel", MID_FLUX)
    real = build(component, "cpu")
    whole = weight_bytes(real)
    split_module(real, resolve_tensor_plan(family.tensor, real), tp, 0)
    assert transformer_weights(family, build(component), tp) == weight_bytes(real) < whole
    assert transformer_weights(family, build(component), 1) == whole


def _stored_bytes(tensor: torch.Tensor) -> int:
    """What a tensor holds, through torchao's tensor subclasses (their inner tensors)."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) and hasattr(tensor, "__tensor_flatten__"):
        return sum(_stored_bytes(getattr(tensor, name)) for name in tensor.__tensor_flatten__()[0])
    return tensor.numel() * tensor.element_size()


@pytest.mark.parametrize("scheme, scope", [("int8wo", "blocks"), ("int8dq", "transformer"), ("fp8wo", "blocks")])
@pytest.mark.parametrize("tp", [1, 2])
def test_quantized_weight_bytes_equal_torchaos_storage(scheme: str, scope: str, tp: int) -> None:
    """The plan's count of a quantized rank's bytes (split, then quantized) against torchao's own storage
    of a real mid-size transformer on the CPU."""
    from accel.optimize.quantize import QuantSummary, quantize_transformer
    from accel.recipe.sections import QuantSection

    family = FAMILIES["flux"]
    component = Component("transformer", "diffusers", "FluxTransformer2DModel", MID_FLUX)
    real = build(component, "cpu")
    if tp > 1:
        split_module(real, resolve_tensor_plan(family.tensor, real), tp, 0)
    quantize_transformer(real, QuantSummary(scheme), family.blocks, scope, ())
    stored = sum(_stored_bytes(t) for t in [*real.parameters(), *real.buffers()])
    quant = QuantSection(type=scheme, scope=scope)
    assert (
        transformer_weights(family, build(component), tp, quant)
        == stored
        < transformer_weights(family, build(component), tp)
    )


def test_flagship_weights_are_the_published_sizes() -> None:
    """Counts from the configs: FLUX.1-dev's 11.9 B transformer, T5-XXL's 4.76 B encoder, CLIP-L's 123 M."""
    flux = {c.attr: sum(p.numel() for p in build(c).parameters()) for c in FLAGSHIPS["flux"].components}
    assert round(flux["transformer"] / 1e9, 1) == 11.9
    assert round(flux["text_encoder_2"] / 1e9, 2) == 4.76
    assert round(flux["text_encoder"] / 1e6) == 123


# The published sizes of the flagships' transformers, in billions of parameters, to their precision.
PUBLISHED_BILLIONS = {
    "flux": (12, 0),
    "flux2": (32, 0),
    "wan": (14, 0),
    "qwenimage": (20, 0),
    "ltx2": (19, 0),
    "sd3": (8.1, 1),
    "hunyuan15": (8.3, 1),
    "kandinsky5": (19, 0),
    "zimage": (6, 0),
    "hunyuan": (13, 0),
    "skyreels2": (14, 0),
    # ChronoEdit-14B: Wan2.1-I2V-14B's transformer, whose picture cross-attention (image embedder, added
    # keys and values) takes the 14 B of Wan's text-to-video blocks to 16.4 B
    "chronoedit": (16.4, 1),
    "mochi": (10, 0),
    "cogvideox": (5.57, 2),
    "ltx": (13, 0),
    "hunyuanimage": (17, 0),
    "helios": (14, 0),
    "qwenimage21": (7.1, 1),  # counted from the class defaults; no published figure to check it against
    "cosmos3": (15.2, 1),
    # Kandinsky 6.0 Pro's released widths count 30.1 B (its model card says 29 B)
    "kandinsky6": (30.1, 1),
}  # the class defaults too (two 36-layer stacks of Qwen3-8B's width, a 152 k vocabulary)


@pytest.mark.parametrize("name", sorted(FLAGSHIPS))
@needs_cuda_build
def test_every_flagship_builds_and_measures_at_a_small_size(name: str) -> None:
    """Each flagship's transformer has its published size; its forward and VAE decode measure on fake
    CUDA at half its default side (9 frames for video), single process and Ulysses 2."""
    flagship, family = FLAGSHIPS[name], FAMILIES[name]
    billions, digits = PUBLISHED_BILLIONS[name]
    transformer = flagship.of_kind("transformer")[0]
    assert round(sum(p.numel() for p in build(transformer).parameters()) / 1e9, digits) == billions
    base = flagship.size
    # HunyuanVideo 1.5 at full side: at half, its text stream and token refiner (whole on every rank)
    # outweigh the video's share, and Ulysses 2 saves nothing (188 MiB either way; 578 / 435 at full)
    side = 1 if name == "hunyuan15" else 2
    size = Size(base.width // side, base.height // side, 9 if base.frames else None)
    single = transformer_working(family, flagship, size, Degrees())
    # Ulysses, but tensor parallelism for Qwen-Image 2.1: the call measured is its first (the prompt's
    # prefill), which runs whole on every rank; only the cached calls after it are cut.
    halved = transformer_working(family, flagship, size, Degrees(ulysses=2) if name != "qwenimage21" else Degrees(tp=2))
    assert 0 < halved < single
    assert vae_working(flagship, size) > 0


@needs_cuda_build
def test_flux2_dev_fits_one_80_gb_gpu_under_model_offload_or_with_its_encoder_on_the_cpu_and_four_with_it_split() -> (
    None
):
    one = make_plan("flux2", 1, 80)
    layouts = {(c.offload, c.text_encoder): c for c in one.candidates}
    assert not layouts["none", "replicated"].fits  # 60 GiB of transformer + 43 GiB of Mistral
    on_cpu = layouts["none", "cpu"]
    assert on_cpu.fits and on_cpu.estimate.weights["text_encoder"] == 0
    # Model offload holds one component at a time: Mistral while encoding, the transformer while denoising.
    offloaded = layouts["model", "replicated"]
    mistral = weight_bytes(build(FLAGSHIPS["flux2"].of_kind("text_encoder")[0]))
    assert sum(offloaded.estimate.weights.values()) == 0 and offloaded.estimate.working["text encode"] == mistral
    assert offloaded.estimate.peak == offloaded.estimate.working["transformer forward"] > mistral
    # Equal step speed; Mistral crossing PCIe once per job beats encoding 24 B parameters on the CPU.
    assert one.chosen is offloaded and offloaded.speedup == on_cpu.speedup == 1.0
    four = make_plan("flux2", 4, 80)
    assert four.chosen is not None and four.chosen.estimate.peak + RESERVED <= 80 * 2**30
    on_gpus = [c for c in four.candidates if c.text_encoder == "replicated" and c.fits]
    assert [c.degrees.tp for c in on_gpus] == [2, 4]  # with Mistral on the GPUs too, the transformer must be split
    assert {c.degrees.tp for c in four.candidates} == {1, 2, 4}
    assert {c.offload for c in four.candidates} == {"none"}  # offload runs one process


def test_a_sharded_encoders_bytes_on_meta_equal_a_real_two_rank_split() -> None:
    """The plan splits an encoder on meta by the run's own code. tiny Qwen-Image's Qwen2.5-VL split over 2
    gloo ranks holds 213,760 float32 bytes of parameters per rank (test_placement measures it): 106,880
    in bfloat16, beside its rotary tables' 48 bytes of float32 buffers."""
    from parallel_cases import tiny_pipeline

    from accel.memory.weights import sharded_encoder_bytes

    encoder = tiny_pipeline("tiny-qwenimage").text_encoder
    config = {
        k: v
        for k, v in encoder.config.to_dict().items()
        if k not in ("model_type", "transformers_version", "architectures", "dtype")
    }
    component = Component("text_encoder", "transformers", type(encoder).__name__, config, encoder.config.model_type)
    buffers = sum(b.numel() * b.element_size() for b in encoder.buffers())
    assert buffers == 48 and sharded_encoder_bytes(component, 2) == 213760 // 2 + buffers


@needs_cuda_build
def test_four_80_gb_gpus_run_flux2_with_mistral_sharded() -> None:
    """Mistral split four ways (11.5 GiB a rank) fits beside FLUX.2-dev's whole transformer: Ulysses 4 with
    the encoders on the GPUs, which at equal speed beats encoding 24 B parameters on the CPU."""
    plan = make_plan("flux2", 4, 80)
    chosen = plan.chosen
    assert chosen is not None and chosen.describe() == "ulysses 4, text encoders sharded"
    mistral = weight_bytes(build(FLAGSHIPS["flux2"].of_kind("text_encoder")[0]))
    assert (
        mistral / 4 < chosen.estimate.weights["text_encoder"] < mistral / 4 + 2**30
    )  # the unsplit norms, vision tower
    assert {c.text_encoder for c in make_plan("qwenimage", 8, 80).candidates} == {
        "replicated",
        "cpu",
    }  # 4 KV heads, 8 ranks
    from accel.memory.weights import sharded_encoder_bytes

    gemma = FLAGSHIPS["ltx2"].of_kind("text_encoder")[0]  # its LM head is its embedding: the split keeps them one
    assert weight_bytes(build(gemma)) / 2 < sharded_encoder_bytes(gemma, 2) < weight_bytes(build(gemma)) * 0.55


@needs_cuda_build
def test_one_24_gb_gpu_runs_qwen_image_under_group_offload() -> None:
    plan = make_plan("qwenimage", 1, 24)
    assert [c.describe() for c in plan.candidates if c.fits] == [
        "single process, group offload",
        "single process, group offload, text encoders on the CPU",
    ]
    chosen = plan.chosen
    assert chosen is not None and chosen.offload == "group" and chosen.text_encoder == "replicated"
    assert 0 < chosen.speedup <= 1


def test_group_offload_holds_what_diffusers_groups_hold() -> None:
    """The plan's model of block-level group offload against diffusers' own grouping of a transformer:
    one group of everything outside the block lists, one group per block."""
    from diffusers.hooks import apply_group_offloading

    from accel.memory.weights import offload_groups

    transformer = build(dataclasses.replace(FLAGSHIPS["flux"].components[0], config=MID_FLUX), "cpu")
    outside, largest = offload_groups(transformer)
    apply_group_offloading(transformer, onload_device="cpu", offload_type="block_level", num_blocks_per_group=1)
    groups = {}
    for module in transformer.modules():
        registry = getattr(module, "_diffusers_hook", None)
        hook = registry.get_hook("group_offloading") if registry is not None else None
        if hook is not None:
            groups[id(hook.group)] = hook.group

    def held(group) -> int:  # a group moves its modules' tensors and any it lists besides, each once
        tensors = {
            id(t): t
            for t in [
                *(t for m in group.modules for t in [*m.parameters(), *m.buffers()]),
                *group.parameters,
                *group.buffers,
            ]
        }
        return sum(t.numel() * t.element_size() for t in tensors.values())

    sizes = [held(group) for group in groups.values()]
    blocks = MID_FLUX["num_layers"] + MID_FLUX["num_single_layers"]
    assert len(sizes) == blocks + 1
    assert sorted(sizes)[-1] == max(outside, largest) and outside in sizes and largest in sizes
    assert sum(sizes) == weight_bytes(transformer)


@needs_cuda_build
def test_the_counted_flops_of_a_cut_transformer_scale_to_the_whole_one() -> None:
    """One block of each kind is counted and scaled to the full depth: equal to counting every block."""
    from torch.utils.flop_counter import FlopCounterMode

    from accel.memory.build import on_device
    from accel.memory.fake_cuda import fake_or_real
    from accel.memory.flops import transformer_flops

    flagship = mid_flagship(MID_FLUX)
    size = Size(256, 256)
    with fake_or_real("cuda"):
        whole = build(flagship.of_kind("transformer")[0], "cuda")
        with torch.device("cuda"):
            inputs = on_device(flagship.inputs(size), "cuda")
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            whole(**inputs)
    assert MID_FLUX["num_layers"] > 1 and MID_FLUX["num_single_layers"] > 1
    assert transformer_flops(flagship, size) == counter.get_total_flops()


@needs_cuda_build
def test_plan_json_and_table(tmp_path) -> None:
    result = run_cli(
        ["plan", "flux", "--gpus", "2", "--gpu-memory", "32", "--width", "512", "--height", "512", "--json"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["size"] == "512x512" and data["gpus"] == 2 and data["gpu_memory_bytes"] == 32 * 2**30
    # FLUX.1-dev runs no CFG by default: no CFG ranks offered. 22 GiB of transformer and 9 of T5 need
    # either the split or T5 in host memory; Ulysses is expected faster than TP, so it wins.
    verdicts = {(c["tp"], c["ulysses"], c["text_encoder"]): c["fits"] for c in data["candidates"]}
    assert verdicts == {
        (1, 2, "replicated"): False,
        (1, 2, "cpu"): True,
        (2, 1, "replicated"): True,
        (2, 1, "cpu"): True,
    }
    chosen = data["chosen"]
    assert (chosen["tp"], chosen["ulysses"], chosen["text_encoder"]) == (1, 2, "cpu") and chosen[
        "peak_bytes"
    ] <= 32 * 2**30
    text = run_cli(["plan", "flux", "--gpus", "2", "--gpu-memory", "32", "--width", "512", "--height", "512"])
    assert (
        text.exit_code == 0
        and "FLUX.1-dev at 512x512 on 2 GPUs of 32 GiB: ulysses 2, text encoders on the CPU (--ulysses 2 "
        "--text-encoder cpu)"
        in " ".join(text.output.split())
    )


@needs_cuda_build
def test_plan_measures_a_recipes_quantization_and_size(tmp_path) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text('[quant]\ntype = "int8wo"\n[generate]\nwidth = 512\nheight = 768\n')
    result = run_cli(["plan", "flux", "--gpu-memory", "80", "--recipe", str(recipe), "--height", "512", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert (data["quant"], data["size"]) == ("int8wo", "512x512")  # the flag over the recipe
    plain = make_plan("flux", 1, 80, Size(512, 512)).candidates[0]
    counted = data["candidates"][0]["weights_bytes"]["transformer"]
    assert counted < 0.6 * plain.estimate.weights["transformer"]


@pytest.mark.parametrize(
    "argv, line",
    [
        (["plan", "flux", "--gpu-memory", "0"], "accel plan: --gpu-memory must be a positive number of GiB, got 0"),
        (["plan", "flux", "--gpu-memory", "-3"], "accel plan: --gpu-memory must be a positive number of GiB, got -3"),
        (
            ["plan", "nosuch"],
            "accel plan: no flagship config for 'nosuch'; plan knows: chronoedit, cogvideox, cosmos3, flux, flux2, "
            "helios, hunyuan, hunyuan15, hunyuanimage, kandinsky5, kandinsky6, ltx, ltx2, mochi, qwenimage, "
            "qwenimage21, sd3, skyreels2, wan, zimage",
        ),
        (["plan", "flux", "--gpus", "0"], "accel plan: --gpus must be at least 1, got 0"),
        (
            ["plan", "flux", "--quant", "int3"],
            "command line: [quant] type must be one of none, int8wo, int8dq, fp8dq, fp8wo, int4wo, got 'int3'",
        ),
    ],
)
def test_refusals_are_one_line(argv: list[str], line: str) -> None:
    result = run_cli(argv)
    assert result.exit_code == 2
    assert " ".join(result.stderr.split()) == f"error: {line}" and not result.stdout


def test_a_cpu_only_torch_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU-only build cannot index a tensor on fake `cuda`: the plan says so instead of torch's traceback."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    result = run_cli(["plan", "flux", "--gpus", "1"])
    assert result.exit_code == 2 and not result.stdout
    assert " ".join(result.stderr.split()) == (
        "error: accel's memory plan measures on fake CUDA, which needs torch's CUDA build (PyPI's default wheel; no "
        f"GPU needed): torch {torch.__version__} is CPU-only"
    )


@needs_cuda_build
def test_sdpa_on_fake_cuda_is_counted_as_a_fused_kernel() -> None:
    """No GPU here, so torch's SDPA on fake `cuda` would take the math path and count an (L, L)
    score matrix; the estimate counts the fused kernel a GPU runs (output and log-sum-exp only)."""
    from accel.memory.fake_cuda import fake_or_real

    heads, tokens, dim = 8, 4096, 64
    with fake_or_real("cuda"):
        q = torch.randn(1, heads, tokens, dim, device="cuda", dtype=torch.bfloat16)
        mask = torch.ones(1, 1, 1, tokens, device="cuda", dtype=torch.bool)
        plain = tracked_peak(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q))
        masked = tracked_peak(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask))
    scores = heads * tokens * tokens * 2
    for peak in (plain, masked):
        assert peak is not None and peak.working < scores / 8, peak


@needs_cuda_build
def test_fake_cuda_answers_data_dependent_ops_on_small_known_tensors() -> None:
    """Boolean-mask gathers and branches on small tensors of known values run on fake CUDA at their
    real size (HunyuanVideo 1.5 gathers its text tokens so); on values it cannot know, it still refuses."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    from accel.memory.fake_cuda import fake_or_real

    with fake_or_real("cuda"):
        x = torch.randn(6, 4, device="cuda")
        mask = torch.tensor([1, 0, 1, 1, 0, 0], device="cuda").bool()
        ones = torch.ones(1, 5, dtype=torch.long, device="cuda").bool()[0]
        assert x[mask].shape == (3, 4) and x[~mask].shape == (3, 4) and x[:5][ones].shape == (5, 4)
        assert x[:5][~ones].shape == (0, 4) and torch.cat([x[mask], x[~mask]]).shape == (6, 4)
        assert bool(torch.all(torch.zeros(3, 2, device="cuda") == 0)) and torch.count_nonzero(mask).item() == 3
        mask.copy_(torch.randn(6, device="cuda") > 0)  # written from values no one knows: forgotten
        with pytest.raises(DynamicOutputShapeException):
            x[mask]


# -- accel run on a flagship: the plan's layout, or a refusal before loading ------------------------------


def recipe_for(model: str, **parallel: int) -> object:
    from accel.apply_recipe import as_recipe

    return as_recipe({"model": {"name": model, "device": "cpu"}, "parallel": parallel})


@needs_cuda_build
def test_run_with_gpus_alone_takes_the_plans_layout() -> None:
    from accel.memory.fit import fitted

    planned = fitted(recipe_for("black-forest-labs/FLUX.2-dev", gpus=4), 80)
    expected = make_plan("flux2", 4, 80).chosen
    assert planned.peak == expected.estimate.peak + RESERVED
    settings = planned.recipe.parallel
    assert (settings.tp, settings.ulysses, settings.ring, settings.cfg) == (
        expected.degrees.tp,
        expected.degrees.ulysses,
        expected.degrees.ring,
        expected.degrees.cfg,
    )
    assert planned.recipe.memory.text_encoder == expected.text_encoder
    assert planned.flags == ("--ulysses", "4", "--text-encoder", "sharded")  # what the ranks are relaunched with


@needs_cuda_build
def test_one_gpu_takes_offload_from_the_plan_unless_compiled() -> None:
    from accel.apply_recipe import as_recipe
    from accel.memory.fit import fitted

    planned = fitted(recipe_for("flux2"), 80)
    assert planned.flags == ("--offload", "model") and planned.recipe.memory.offload == "model"
    compiled = as_recipe({"model": {"name": "flux2", "device": "cpu"}, "compile": {"enabled": True}})
    planned = fitted(compiled, 80)  # offload does not compose with compile: Mistral goes to host memory instead
    assert planned.flags == ("--text-encoder", "cpu") and planned.recipe.memory.offload == "none"


@needs_cuda_build
def test_the_plan_counts_the_recipes_quantization() -> None:
    """FLUX.2-dev's blocks in fp8 take its transformer from 60 to 31 GiB: Mistral then fits beside it on one
    H100, so nothing moves to host memory."""
    from accel.apply_recipe import as_recipe
    from accel.memory.fit import fitted

    recipe = as_recipe({"model": {"name": "flux2", "device": "cpu"}, "quant": {"type": "fp8dq"}})
    planned = fitted(recipe, 80)
    assert (
        planned.flags == ()
        and planned.recipe.memory.offload == "none"
        and planned.recipe.memory.text_encoder == "replicated"
    )
    quantized = make_plan("flux2", 1, 80, quant=recipe.quant).chosen
    assert planned.peak == quantized.estimate.peak + RESERVED
    assert (
        quantized.estimate.weights["transformer"]
        < 0.55 * make_plan("flux2", 1, 80).chosen.estimate.working["transformer forward"]
    )
    result = run_cli(["plan", "flux2", "--gpu-memory", "80", "--quant", "fp8dq", "--json"])
    assert result.exit_code == 0 and json.loads(result.output)["chosen"]["peak_bytes"] == planned.peak


@needs_cuda_build
def test_an_offload_that_does_not_fit_is_refused_with_one_that_does() -> None:
    from accel.apply_recipe import as_recipe
    from accel.memory.fit import fitted

    recipe = as_recipe({"model": {"name": "qwenimage", "device": "cpu"}, "memory": {"offload": "group"}})
    assert fitted(recipe, 24).peak == make_plan("qwenimage", 1, 24).chosen.estimate.peak + RESERVED
    result = run_cli(["run", "qwenimage", "--offload", "model", "--gpu-memory", "24"])
    assert result.exit_code == 2
    line = " ".join(result.stderr.split())
    assert line.startswith("error: Qwen-Image at 1328x1328 needs ") and line.endswith(
        " GiB per GPU as laid out (single process, model offload), more than the 24 GiB of each GPU; a layout that "
        "fits: --offload group"
    )


def test_a_model_the_plan_does_not_know_runs_as_asked() -> None:
    from accel.memory.fit import fitted

    recipe = recipe_for("tiny-flux", gpus=2)
    planned = fitted(recipe, 80)
    assert planned.recipe is recipe and planned.peak is None and planned.flags == ()


@needs_cuda_build
def test_run_refuses_a_layout_that_does_not_fit_before_loading() -> None:
    """Nothing is downloaded here (no network): the refusal comes before any load is tried. (--oversubscribe:
    without it this 2-core machine refuses 4 processes first, which is checked before the plan.)"""
    result = run_cli(
        [
            "run",
            "black-forest-labs/FLUX.2-dev",
            "--gpus",
            "4",
            "--ulysses",
            "4",
            "--gpu-memory",
            "80",
            "--oversubscribe",
        ]
    )
    assert result.exit_code == 2
    assert " ".join(result.stderr.split()) == (
        "error: FLUX.2-dev at 1024x1024 needs 108.4 GiB per GPU as laid out (ulysses 4), more than the 80 GiB of each "
        "GPU; "
        "a layout that fits: --ulysses 4 --text-encoder sharded"
    )


def test_run_refuses_a_gpu_memory_that_is_not_positive() -> None:
    result = run_cli(["run", "tiny-flux", "--gpu-memory", "0"])
    assert (
        result.exit_code == 2
        and " ".join(result.stderr.split()) == "error: --gpu-memory must be a positive number of GiB, got 0"
    )


def test_the_run_table_and_json_show_the_plans_estimate_beside_the_measured_peak() -> None:
    from accel import report
    from accel.apply_recipe import as_recipe
    from accel.runner import run

    metrics = run(as_recipe({"model": {"name": "tiny-flux"}, "generate": {"steps": 2}}), planned_peak=3 * 2**30)
    assert metrics.planned_peak_bytes == 3 * 2**30
    assert report.run_document(metrics, [])["planned_peak_bytes"] == 3 * 2**30
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(report.run_table(metrics))
    text = console.export_text()
    assert "peak memory (accel plan's estimate)" in text and "3.0 GiB" in text


def test_the_visible_gpus_memory_comes_from_nvidia_smi_not_a_cuda_context(tmp_path, monkeypatch) -> None:
    """The launcher must not create a CUDA context (it would hold memory on rank 0's GPU all job long)."""
    from accel.memory.fit import visible_gpu_gib

    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\necho 81559\necho 81559\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert visible_gpu_gib("auto") == pytest.approx(81559 / 1024)
    assert (tmp_path / "args").read_text().split() == [
        "--query-gpu=memory.total",
        "--format=csv,noheader,nounits",
        "--id=3",
    ]
    assert visible_gpu_gib("cpu") is None
    smi.unlink()
    assert visible_gpu_gib("cuda") is None  # no nvidia-smi: no plan rather than a guess


# -- accel bench and accel serve on a flagship: the same plan, per variant and per replica ----------------


def flux2_bench(**variant_parallel: int) -> object:
    from accel.recipe import Recipe

    return Recipe.from_dict(
        {
            "model": {"name": "flux2", "device": "cpu"},
            "bench": {"variants": [{"name": "baseline"}, {"name": "planned", "parallel": variant_parallel}]},
        },
        source="flux2-bench.toml",
    )


@needs_cuda_build
def test_bench_variants_left_to_accel_take_the_plans_layout_and_the_ranks_get_the_same(monkeypatch) -> None:
    from accel.bench.plan import fit_bench, plan_bench
    from accel.memory.fit import PLANNED_RECIPES

    monkeypatch.delenv(PLANNED_RECIPES, raising=False)
    recipe = flux2_bench(gpus=2)
    fitted_plan = fit_bench(plan_bench(recipe, 2), 80)
    baseline, planned = fitted_plan.variants
    one, two = make_plan("flux2", 1, 80).chosen, make_plan("flux2", 2, 80).chosen
    assert (baseline.recipe.memory.text_encoder, baseline.planned_peak) == (
        one.text_encoder,
        one.estimate.peak + RESERVED,
    )
    assert (
        (planned.recipe.parallel.ulysses, planned.recipe.memory.text_encoder)
        == (two.degrees.ulysses, two.text_encoder)
        == (2, "cpu")
    )
    assert planned.planned_peak == two.estimate.peak + RESERVED
    # A rank the launcher started plans nothing: it takes each variant's layout and peak from the launcher.
    for name, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)
    on_rank = fit_bench(plan_bench(recipe, 2), None)
    assert [(v.recipe, v.planned_peak) for v in on_rank.variants] == [
        (v.recipe, v.planned_peak) for v in fitted_plan.variants
    ]


@needs_cuda_build
def test_bench_refuses_a_variant_whose_layout_does_not_fit_before_loading(tmp_path) -> None:
    recipe = tmp_path / "flux2-bench.toml"
    recipe.write_text(
        '[model]\nname = "flux2"\n\n[bench]\nvariants = [{ name = "baseline" }, { name = "ulysses2", parallel = { '
        "ulysses = 2 } }]\n"
    )
    result = run_cli(["bench", str(recipe), "--gpus", "2", "--gpu-memory", "80", "--oversubscribe"])
    assert result.exit_code == 2
    assert " ".join(result.stderr.split()) == (
        f"error: {recipe}: [bench] variant 'ulysses2': FLUX.2-dev at 1024x1024 needs 108.4 GiB per GPU as laid out "
        "(ulysses 2), "
        "more than the 80 GiB of each GPU; a layout that fits: parallel = { ulysses = 2 }, memory = { text_encoder = "
        '"cpu" }'
    )


def test_the_bench_table_and_json_show_the_plans_estimate_beside_the_measured_peak() -> None:
    from accel.bench import report
    from accel.bench.results import BenchResult, VariantResult

    row = VariantResult(
        "baseline", {}, 1, "1 process", times_s=[1.0], steps=2, peak_memory_bytes=2**30, planned_peak_bytes=3 * 2**30
    )
    result = BenchResult(
        "r.toml",
        "flux2",
        "flux2",
        "image",
        "cuda",
        "bfloat16",
        1,
        1,
        0,
        {},
        "torch.cuda.max_memory_allocated",
        "baseline",
        [row],
    )
    assert result.as_dict()["variants"][0]["planned_peak_bytes"] == 3 * 2**30
    assert report.bench_rows(result)[0][report.BENCH_COLUMNS.index("peak memory")] == "1.0 GiB (plan 3.0 GiB)"


@needs_cuda_build
def test_serve_with_gpus_alone_relaunches_each_replica_with_the_plans_layout(monkeypatch) -> None:
    """Two replicas of 2 GPUs each: the plan is made for 2 GPUs and its flags (per replica, as serve's are) reach every
    rank."""
    import accel.launch.supervisor
    from accel.memory.fit import PLANNED_PEAK

    monkeypatch.delenv(PLANNED_PEAK, raising=False)
    launched: list[list[str]] = []
    monkeypatch.setattr(
        accel.launch.supervisor,
        "launch",
        lambda spec, module, argv, fork=False: launched.append([str(spec.nproc), *argv]) or 0,
    )
    argv = ["serve", "flux2", "--gpus", "4", "--replicas", "2", "--gpu-memory", "80", "--oversubscribe"]
    result = CliRunner().invoke(app, argv, obj={"argv": argv}, catch_exceptions=False)
    assert result.exit_code == 0, result.stderr
    chosen = make_plan("flux2", 2, 80).chosen
    assert launched == [["4", *argv, "--ulysses", "2", "--text-encoder", "cpu"]]
    assert os.environ[PLANNED_PEAK] == str(chosen.estimate.peak + RESERVED)  # the ranks' estimate


@needs_cuda_build
def test_serve_refuses_a_replica_layout_that_does_not_fit_before_loading() -> None:
    result = run_cli(
        ["serve", "flux2", "--gpus", "4", "--replicas", "2", "--ulysses", "2", "--gpu-memory", "80", "--oversubscribe"]
    )
    assert result.exit_code == 2
    assert " ".join(result.stderr.split()) == (
        "error: FLUX.2-dev at 1024x1024 needs 108.4 GiB per GPU as laid out (ulysses 2), more than the 80 GiB of each "
        "GPU; "
        "a layout that fits: --ulysses 2 --text-encoder cpu"
    )


@pytest.mark.parametrize("command", [["serve", "tiny-flux"], ["bench", "recipes/tiny-flux.toml"]])
def test_serve_and_bench_refuse_a_gpu_memory_that_is_not_positive(command: list[str]) -> None:
    result = run_cli([*command, "--gpu-memory", "0"])
    assert (
        result.exit_code == 2
        and " ".join(result.stderr.split()) == "error: --gpu-memory must be a positive number of GiB, got 0"
    )


# -- accel run's checks before start-up: the checkpoint's own heads, where its config is readable ------------


KANDINSKY5_LITE = dict(
    FLAGSHIPS["kandinsky5"].components[0].config,
    model_dim=1792,
    ff_dim=7168,
    num_visual_blocks=32,
    axes_dims=(16, 24, 24),
)  # 1792 wide over heads of 64: the family default's 28 heads


def saved_transformer_config(folder, config: dict) -> None:
    """What the checks before start-up read of a saved Kandinsky 5 pipeline: its model_index.json and
    transformer/config.json (no weights: the refusal comes before any load)."""
    (folder / "transformer").mkdir(parents=True)
    (folder / "model_index.json").write_text(
        json.dumps(
            {"_class_name": "Kandinsky5T2VPipeline", "transformer": ["diffusers", "Kandinsky5Transformer3DModel"]}
        )
    )
    (folder / "transformer" / "config.json").write_text(
        json.dumps({"_class_name": "Kandinsky5Transformer3DModel", **config})
    )


def test_run_checks_degrees_against_a_local_checkpoints_own_heads(tmp_path) -> None:
    """Kandinsky 5's family default (Lite) has 28 heads, which tp 7 divides; a saved Pro (32 heads) is
    refused tp 7 before any rank starts, naming 32's divisors."""
    from accel.models.refs import heads_before_start, resolve_model

    saved_transformer_config(tmp_path / "pro", FLAGSHIPS["kandinsky5"].components[0].config)
    saved_transformer_config(tmp_path / "lite", KANDINSKY5_LITE)
    assert FAMILIES["kandinsky5"].heads == 28
    assert heads_before_start(resolve_model(str(tmp_path / "pro"))) == 32
    assert heads_before_start(resolve_model(str(tmp_path / "lite"))) == 28
    result = run_cli(["run", str(tmp_path / "pro"), "--gpus", "7", "--tp", "7", "--oversubscribe"])
    assert result.exit_code == 2
    assert " ".join(result.stderr.split()) == (
        f"error: [parallel] tp = 7 does not divide the 32 attention heads of {tmp_path / 'pro'}; use tp = 2, 4, 8, 16 "
        "or 32"
    )


def test_run_checks_a_hub_ids_heads_from_its_cached_config_or_the_flagships(tmp_path, monkeypatch) -> None:
    """A hub id: its transformer config in the local Hugging Face cache (no network), else the family's
    default repo's count or accel plan's bundled config for a flagship repo; unknown: None (the ranks check)."""
    import huggingface_hub.constants

    from accel.models.refs import heads_before_start, resolve_model

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--someone--k5-pro"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    saved_transformer_config(repo / "snapshots" / ("0" * 40), FLAGSHIPS["kandinsky5"].components[0].config)
    assert heads_before_start(resolve_model("someone/k5-pro")) == 32
    result = run_cli(["run", "someone/k5-pro", "--gpus", "7", "--tp", "7", "--oversubscribe"])
    assert result.exit_code == 2
    assert " ".join(result.stderr.split()) == (
        "error: [parallel] tp = 7 does not divide the 32 attention heads of someone/k5-pro; use tp = 2, 4, 8, 16 or 32"
    )
    assert heads_before_start(resolve_model(FLAGSHIPS["kandinsky5"].repo)) == 32  # not cached: the flagship's config
    assert heads_before_start(resolve_model(FAMILIES["kandinsky5"].repo)) == 28  # the family's default repo
    assert heads_before_start(resolve_model("kandinsky5")) == 28  # the alias loads the family's default repo
    assert heads_before_start(resolve_model("someone/unknown")) is None


def test_the_trackers_device_peak_is_torchs_own_without_the_per_module_peaks() -> None:
    """tracked_peak keeps only the device peaks (accel/memory/tracker.py); torch's whole tracker agrees."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model = torch.nn.Sequential(
        torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Linear(512, 64), torch.nn.Softmax(-1)
    )
    x = torch.randn(96, 64)
    ours = tracked_peak(lambda: model(x), model, device="cpu")
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker, torch.no_grad():
        model(x)
    theirs = {str(device): counts for device, counts in tracker.get_tracker_snapshot("peak").items()}["cpu"]
    assert ours is not None and ours.total == theirs["Total"] > 0


# HunyuanVideo 1.5 at a size where its VAE tiles (wider than its 256-pixel tiles), small enough to measure.
HV15_SIZE = Size(640, 368, 9)


@needs_cuda_build
def test_a_layout_whose_whole_vae_decode_does_not_fit_gets_a_tiled_twin_that_the_plan_takes() -> None:
    vae_weights = weight_bytes(build(FLAGSHIPS["hunyuan15"].of_kind("vae")[0]))
    whole, tiled = (
        vae_working(FLAGSHIPS["hunyuan15"], HV15_SIZE),
        vae_working(FLAGSHIPS["hunyuan15"], HV15_SIZE, tiling=True),
    )
    assert tiled < whole
    limit = (RESERVED + vae_weights + (whole + tiled) // 2) / 2**30  # the whole decode does not fit, the tiled one does
    plan = make_plan("hunyuan15", 1, limit, HV15_SIZE)
    twins = [c for c in plan.candidates if c.vae_tiling]
    assert twins and all(not c.fits for c in plan.candidates if not c.vae_tiling)
    # Only a layout that only its whole decode keeps from fitting gets a twin: without offload the weights
    # alone are too many, and group offload with Qwen2.5-VL on the GPU peaks while encoding (13 GiB).
    assert [(c.offload, c.text_encoder) for c in twins] == [("group", "cpu")]
    assert not any(c.vae_parallel for c in plan.candidates)  # one GPU: nothing to split the decode over
    chosen = plan.chosen
    assert (
        chosen is twins[0]
        and chosen.describe() == "single process, group offload, text encoders on the CPU, VAE in tiles"
    )
    assert chosen.estimate.working["VAE decode"] == vae_weights + tiled
    from accel.memory.fit import fitted, layout_keys

    recipe = recipe_for(FLAGSHIPS["hunyuan15"].repo)
    recipe = dataclasses.replace(recipe, generate=dataclasses.replace(recipe.generate, width=640, height=368, frames=9))
    planned = fitted(recipe, limit)
    assert (
        planned.flags == ("--text-encoder", "cpu", "--offload", "group", "--vae-tiling") and planned.recipe.vae.tiling
    )
    assert layout_keys(chosen) == 'memory = { text_encoder = "cpu", offload = "group" }, vae = { tiling = true }'


def test_an_alias_is_planned_only_where_it_loads_the_flagship_checkpoint() -> None:
    from accel.memory.fit import flagship_key

    assert flagship_key("flux2") == "flux2" and flagship_key("black-forest-labs/FLUX.2-dev") == "flux2"
    assert flagship_key("kandinsky5") is None  # loads Lite; the flagship is Pro
    assert flagship_key(FLAGSHIPS["kandinsky5"].repo) == "kandinsky5"
    assert flagship_key("wan") is None and flagship_key("ltx") is None and flagship_key("tiny-flux") is None


@needs_cuda_build
def test_on_two_gpus_the_plan_splits_a_decode_that_does_not_fit_whole_over_the_ranks_before_tiling_it() -> None:
    vae_weights = weight_bytes(build(FLAGSHIPS["hunyuan15"].of_kind("vae")[0]))
    transformer = weight_bytes(build(FLAGSHIPS["hunyuan15"].of_kind("transformer")[0]))
    whole, split = (
        vae_working(FLAGSHIPS["hunyuan15"], HV15_SIZE),
        vae_working(FLAGSHIPS["hunyuan15"], HV15_SIZE, ranks=2),
    )
    assert split < whole
    limit = (RESERVED + transformer + vae_weights + (whole + split) // 2) / 2**30  # encoders in host memory
    plan = make_plan("hunyuan15", 2, limit, HV15_SIZE)
    chosen = plan.chosen
    assert chosen is not None and chosen.vae_parallel and not chosen.vae_tiling and chosen.text_encoder == "cpu"
    assert chosen.estimate.working["VAE decode"] == split
    assert not any(
        c.vae_tiling for c in plan.candidates if c.degrees == chosen.degrees
    )  # the split fitted: no tiles tried
    from accel.memory.fit import fitted

    recipe = recipe_for(FLAGSHIPS["hunyuan15"].repo, gpus=2)
    recipe = dataclasses.replace(recipe, generate=dataclasses.replace(recipe.generate, width=640, height=368, frames=9))
    planned = fitted(recipe, limit)
    assert "--parallel-vae" in planned.flags and planned.recipe.vae.parallel and not planned.recipe.vae.tiling
