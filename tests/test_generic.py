"""Pipelines no accel family describes, accelerated through the generic path (accel/models/generic.py,
issue 34): the record learned from the model (blocks, what they return, where streams are joined,
call defaults from the signature), the cache and compile on it equal to what they must be, accel run
on a saved folder, and context parallelism from the automatic plan, verified on simulated ranks or refused.

Six pipelines are built tiny here from their diffusers classes, with the tiny T5 / UMT5 and VAEs accel's
families use: Chroma and AuraFlow (joint blocks, then single blocks on text and image concatenated),
PixArt-Sigma and CogView3-Plus (one list), Latte (spatial and temporal blocks in turn: the caches are
refused) and Allegro (video).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the suite may reach a model hub

from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import diffusers  # noqa: E402
import pytest  # noqa: E402
import commands
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

import accel  # noqa: E402
from accel.cli import app  # noqa: E402
from accel.errors import NotAvailableError, UserError  # noqa: E402
from accel.models.tiny.seeding import finish, seeded  # noqa: E402
from accel.models.tiny.t5 import T5_HIDDEN, t5_encoder, t5_tokenizer, umt5_encoder  # noqa: E402
from accel.models.tiny.vaes import flux1_vae  # noqa: E402
from accel.models.base import BlockList, GenerationDefaults  # noqa: E402
from accel.models.registry import family_of  # noqa: E402
from accel.parallel.plan_format import AutomaticPlan  # noqa: E402
from accel.models.pipeline_probe import first_transformer_call, other_transformer_call  # noqa: E402
from accel.parallel import verify  # noqa: E402
from accel.parallel.plan import plan_of, untaught_message  # noqa: E402
from accel.parallel.choose import automatic_plan  # noqa: E402
from accel.quality import psnr  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

STEPS = 4


def small_vae() -> Any:
    """A two-level AutoencoderKL (2x downsampling, 4 latent channels), for the SD-style latents these take."""
    return diffusers.AutoencoderKL(
        block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=4,
        layers_per_block=1,
        sample_size=32,
    )


def t5_pipeline(
    cls: str,
    scheduler: Any,
    transformer: Callable[[], Any],
    vae: Callable[[], Any] = small_vae,
    encoder: Callable[..., Any] = t5_encoder,
) -> Any:
    """A pipeline of diffusers' `cls` with the tiny T5 tokenizer and `encoder`, a seeded VAE and transformer."""
    tokenizer = t5_tokenizer()
    text_encoder = encoder(tokenizer, 1)
    with seeded(2):
        parts_vae, model = finish(vae()), finish(transformer())
    return getattr(diffusers, cls)(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=parts_vae, transformer=model, scheduler=scheduler
    )


def tiny_chroma() -> Any:
    return t5_pipeline(
        "ChromaPipeline",
        diffusers.FlowMatchEulerDiscreteScheduler(),
        lambda: diffusers.ChromaTransformer2DModel(
            in_channels=64,
            num_layers=2,
            num_single_layers=3,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=T5_HIDDEN,
            axes_dims_rope=(4, 6, 6),
            approximator_num_channels=16,
            approximator_hidden_dim=32,
            approximator_layers=2,
        ),
        vae=flux1_vae,
    )


def tiny_pixart_sigma() -> Any:
    return t5_pipeline(
        "PixArtSigmaPipeline",
        diffusers.DPMSolverMultistepScheduler(),
        lambda: diffusers.PixArtTransformer2DModel(
            num_attention_heads=2,
            attention_head_dim=8,
            in_channels=4,
            out_channels=8,
            num_layers=3,
            cross_attention_dim=16,
            caption_channels=T5_HIDDEN,
            sample_size=32,
            norm_num_groups=4,
        ),
    )


def tiny_auraflow() -> Any:
    # pos_embed_max_size: positions for the 128 px probe call over this 2x VAE (a real one holds 1024 for 8x).
    return t5_pipeline(
        "AuraFlowPipeline",
        diffusers.FlowMatchEulerDiscreteScheduler(),
        lambda: diffusers.AuraFlowTransformer2DModel(
            sample_size=16,
            patch_size=2,
            in_channels=4,
            num_mmdit_layers=2,
            num_single_dit_layers=3,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=T5_HIDDEN,
            caption_projection_dim=16,
            out_channels=4,
            pos_embed_max_size=1024,
        ),
        encoder=umt5_encoder,
    )


def tiny_latte() -> Any:
    # Learned temporal positions for 16 frames, the pipeline's default frame count.
    return t5_pipeline(
        "LattePipeline",
        diffusers.DDIMScheduler(),
        lambda: diffusers.LatteTransformer3DModel(
            num_attention_heads=2,
            attention_head_dim=8,
            in_channels=4,
            out_channels=8,
            num_layers=2,
            cross_attention_dim=16,
            sample_size=8,
            patch_size=2,
            num_embeds_ada_norm=1000,
            norm_type="ada_norm_single",
            norm_elementwise_affine=False,
            norm_eps=1e-6,
            caption_channels=T5_HIDDEN,
            video_length=16,
        ),
    )


def tiny_cogview3() -> Any:
    return t5_pipeline(
        "CogView3PlusPipeline",
        diffusers.CogVideoXDDIMScheduler(),
        lambda: diffusers.CogView3PlusTransformer2DModel(
            patch_size=2,
            in_channels=4,
            num_layers=3,
            attention_head_dim=8,
            num_attention_heads=2,
            out_channels=4,
            text_embed_dim=T5_HIDDEN,
            time_embed_dim=16,
            condition_dim=4,
            pos_embed_max_size=32,
            sample_size=16,
        ),
    )


def tiny_allegro() -> Any:
    # attention_head_dim 12: Allegro's rotary splits each head over three axes, in pairs.
    return t5_pipeline(
        "AllegroPipeline",
        diffusers.EulerAncestralDiscreteScheduler(),
        lambda: diffusers.AllegroTransformer3DModel(
            patch_size=2,
            patch_size_t=1,
            num_attention_heads=2,
            attention_head_dim=12,
            in_channels=4,
            out_channels=4,
            num_layers=3,
            cross_attention_dim=24,
            caption_channels=T5_HIDDEN,
            sample_height=16,
            sample_width=16,
            sample_frames=8,
        ),
        vae=lambda: diffusers.AutoencoderKLAllegro(
            block_out_channels=(8, 16, 16, 16), norm_num_groups=4, layers_per_block=1, latent_channels=4, sample_size=32
        ),
    )


BUILDERS = {
    "chroma": tiny_chroma,
    "pixart": tiny_pixart_sigma,
    "auraflow": tiny_auraflow,
    "latte": tiny_latte,
    "cogview3": tiny_cogview3,
    "allegro": tiny_allegro,
}
# What the generic path learns for each: the block lists (joins where the probe saw streams joined),
# and for Latte, whose spatial and temporal blocks take turns, why the caches are refused.
LISTS = {
    "chroma": (
        BlockList("transformer_blocks", returns=("encoder_hidden_states", "hidden_states")),
        BlockList(
            "single_transformer_blocks", returns=("hidden_states",), joins=("encoder_hidden_states", "hidden_states")
        ),
    ),
    "pixart": (BlockList("transformer_blocks", returns=("hidden_states",)),),
    "auraflow": (
        BlockList("joint_transformer_blocks", returns=("encoder_hidden_states", "hidden_states")),
        BlockList(
            "single_transformer_blocks", returns=("hidden_states",), joins=("encoder_hidden_states", "hidden_states")
        ),
    ),
    "latte": (
        BlockList("transformer_blocks", returns=("hidden_states",)),
        BlockList("temporal_transformer_blocks", returns=("hidden_states",)),
    ),
    "cogview3": (BlockList("transformer_blocks", returns=("hidden_states", "encoder_hidden_states")),),
    "allegro": (BlockList("transformer_blocks", returns=("hidden_states",)),),
}
LATTE_REFUSED = (
    "LatteTransformer3DModel runs transformer_blocks and temporal_transformer_blocks interleaved (one block of each "
    "in turn), and accel's step caches need lists that run one after another; quantization and compile apply"
)
_PIPES: dict[str, Any] = {}


def pipeline(name: str) -> Any:
    if name not in _PIPES:
        pipe = BUILDERS[name]()
        pipe.set_progress_bar_config(disable=True)
        _PIPES[name] = pipe
    return _PIPES[name]


def generate(pipe: Any, output_type: str = "latent") -> Any:
    """The latents a short call makes (the VAE is not what these tests are about), or its pictures."""
    extra: dict[str, Any] = {"use_resolution_binning": False} if isinstance(pipe, diffusers.PixArtSigmaPipeline) else {}
    family = family_of(pipe)
    if family.frames_arg:
        extra[family.frames_arg] = 16 if isinstance(pipe, diffusers.LattePipeline) else 5
    output = pipe(
        prompt="a red fox",
        num_inference_steps=STEPS,
        height=64,
        width=64,
        output_type=output_type,
        generator=torch.Generator().manual_seed(0),
        **extra,
    )
    return output.frames if hasattr(output, "frames") else output.images


def test_the_record_is_learned_from_the_model() -> None:
    chroma = family_of(pipeline("chroma"))
    assert (chroma.learned, chroma.title, chroma.transformer_class, chroma.output) == (
        True,
        "ChromaPipeline",
        "ChromaTransformer2DModel",
        "image",
    )
    # The single blocks run on text then image in one tensor: seen in the probe call, not declared anywhere.
    assert chroma.blocks == (
        BlockList("transformer_blocks", returns=("encoder_hidden_states", "hidden_states")),
        BlockList(
            "single_transformer_blocks", returns=("hidden_states",), joins=("encoder_hidden_states", "hidden_states")
        ),
    )
    assert chroma.primary_stream == "hidden_states" and chroma.heads == 2 and chroma.vae == "AutoencoderKL"
    # ChromaPipeline.__call__'s own defaults (35 steps, guidance 5.0); no size in its signature: 1024².
    assert chroma.defaults == GenerationDefaults(steps=35, height=1024, width=1024, guidance_scale=5.0)
    pixart = family_of(pipeline("pixart"))
    assert (pixart.defaults.steps, pixart.defaults.guidance_scale, pixart.name) == (20, 4.5, "pix-art-sigma")
    latte = family_of(pipeline("latte"))  # a video pipeline that calls its frame count video_length
    assert (latte.output, latte.frames_arg, latte.defaults.frames, latte.cache_refused) == (
        "video",
        "video_length",
        16,
        LATTE_REFUSED,
    )
    assert family_of(pipeline("chroma")) is chroma  # learned once per process


@pytest.mark.parametrize("name", list(BUILDERS))
def test_the_block_lists_are_learned(name: str) -> None:
    family = family_of(pipeline(name))
    assert family.learned and family.blocks == LISTS[name]
    assert family.cache_refused == (LATTE_REFUSED if name == "latte" else None)


@pytest.mark.parametrize("name", [name for name in BUILDERS if name != "latte"])
def test_the_cache_skips_after_warmup_and_off_is_the_reference(name: str) -> None:
    pipe = pipeline(name)
    reference = generate(pipe)
    handle = accel.apply(pipe, {"cache": {"threshold": 1e9, "warmup_steps": 1}})
    try:
        cached = generate(pipe)
        records = [record.cached for record in handle.cache_stats.records]
    finally:
        handle.remove()
    calls = len(records) // STEPS  # Chroma runs guidance as two transformer calls a step, the rest as one batch
    assert records == [False] * calls + [True] * (len(records) - calls)
    assert not torch.equal(cached, reference), "skipping blocks must change the output"
    torch.testing.assert_close(generate(pipe), reference, atol=0, rtol=0)  # remove() restores the eager blocks


def test_the_cache_is_refused_where_lists_take_turns() -> None:
    with pytest.raises(UserError) as refused:
        accel.apply(pipeline("latte"), {"cache": {"threshold": 0.1}})
    assert str(refused.value) == f"[cache] method = 'fbcache': {LATTE_REFUSED}"


@pytest.mark.parametrize(
    "name, blocks", [("chroma", 5), ("pixart", 3), ("auraflow", 5), ("latte", 4), ("cogview3", 3), ("allegro", 3)]
)
def test_regional_compile_equals_eager(name: str, blocks: int) -> None:
    """Every block list of a pipeline accel learned compiles; Chroma's through inductor's kernels, the
    others' through dynamo and AOT autograd alone (aot_eager), where graph breaks would show."""
    pipe = pipeline(name)
    reference = generate(pipe)
    backend = "inductor" if name == "chroma" else "aot_eager"
    handle = accel.apply(pipe, {"compile": {"enabled": True, "backend": backend}})
    try:
        compiled = generate(pipe)
        assert len(handle.compiled[0].modules) == blocks  # every list's blocks
    finally:
        handle.remove()
    # Inductor reorders float32 sums (compounded over the steps): equal to eager within 1e-4 of the latents' scale.
    torch.testing.assert_close(compiled, reference, atol=1e-4 * float(reference.abs().max()), rtol=0)


def test_quantization_applies_to_the_blocks() -> None:
    pipe = BUILDERS["pixart"]()  # quantization replaces weights for good: a pipeline of its own
    pipe.set_progress_bar_config(disable=True)
    reference = generate(pipe, "np")
    handle = accel.apply(pipe, {"quant": {"type": "int8wo"}})
    assert handle.quant.quantized
    quantized = generate(pipe, "np")
    assert 40.0 <= psnr(quantized, reference) < float("inf")  # changed, and within the floor


def test_cfg_parallelism_is_refused_in_one_line() -> None:
    assert isinstance(
        plan_of(family_of(pipeline("pixart")), "--ulysses"), AutomaticPlan
    )  # context parallelism: automatic
    assert untaught_message("[parallel] cfg = 2", "PixArtSigmaPipeline", "CFG parallelism") == (
        "[parallel] cfg = 2: PixArtSigmaPipeline is not a family accel was taught, and CFG parallelism needs one (its "
        "context parallelism is planned automatically and verified before use); use ulysses / ring alone, or one "
        "process"
    )
    assert family_of(pipeline("pixart")).cfg_off({"guidance_scale": 4.5}) == (
        "accel has not learned how PixArtSigmaPipeline runs classifier-free guidance (no family describes it)"
    )


# The automatic plan on simulated ranks: exact for three, refused by the verification for the other three
# (Chroma's additive mask over text and image together, Latte's and Allegro's tokens regrouped by frame
# inside the blocks), never run wrong.
VERIFIED = {"pixart": True, "auraflow": True, "cogview3": True, "chroma": False, "latte": False, "allegro": False}


@pytest.mark.parametrize("name", list(BUILDERS))
def test_context_parallelism_is_the_verified_automatic_plan_or_refused(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path))
    pipe = pipeline(name)
    family, transformer = family_of(pipe), pipe.transformer
    call, other = first_transformer_call(pipe, transformer), other_transformer_call(pipe, transformer)
    if not VERIFIED[name]:
        with pytest.raises(NotAvailableError) as refused:
            automatic_plan(transformer, call, other, family.blocks, family.primary_stream, 2, 1, "[parallel]")
        assert str(refused.value).startswith(
            f"[parallel]: the automatic context-parallel plan for {type(transformer).__name__} is refused: "
        )
        assert "2 simulated ranks" in str(refused.value)
        assert str(refused.value).endswith("; run it on one process (cache, quantization and compile apply)")
        return
    for ulysses, ring in ((2, 1), (1, 3)):
        plan = automatic_plan(
            transformer, call, other, family.blocks, family.primary_stream, ulysses, ring, "[parallel]"
        )
        args, kwargs = call.fresh()
        with torch.no_grad():
            expected = transformer(*args, **kwargs)[0]
        for output in verify._split_run(transformer, plan, call, ulysses, ring):
            assert (output[0] - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.fixture(scope="module")
def chroma_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("generic") / "chroma"
    pipeline("chroma").save_pretrained(folder)
    return folder


def cli(*args: str) -> Any:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"}, catch_exceptions=False)


def test_accel_run_takes_a_saved_folder_of_an_unknown_pipeline(chroma_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "fox.png"
    result = cli(
        "run",
        str(chroma_folder),
        "--steps",
        "3",
        "--height",
        "64",
        "--width",
        "64",
        "--cache",
        "0.1",
        "--dtype",
        "float32",
        "--out",
        str(out),
    )
    assert result.exit_code == 0, result.output
    with Image.open(out) as image:
        assert image.size == (64, 64)


def test_accel_bench_takes_a_recipe_naming_such_a_folder(chroma_folder: Path, tmp_path: Path) -> None:
    recipe = tmp_path / "chroma.toml"
    recipe.write_text(
        f'[model]\nname = "{chroma_folder}"\ndtype = "float32"\ndevice = "cpu"\n'
        "[generate]\nsteps = 3\nheight = 64\nwidth = 64\n[cache]\nthreshold = 1e9\n[bench]\nrepeats = 1\n"
    )
    result = cli("bench", str(recipe), "--out", str(tmp_path / "bench"))
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "bench" / "bench.json").read_text())
    rows = {row["name"]: row for row in report["variants"]}
    assert set(rows) == {"baseline", "recipe"} and report["family"] == "chroma"
    assert rows["recipe"]["status"] == "ran" and rows["recipe"]["cache_hit_rate"] > 0  # the learned blocks are skipped


def accel_command(*args: str) -> subprocess.CompletedProcess[str]:
    """accel in a process of its own: a layout of several ranks relaunches the command line."""
    return commands.run(
        [sys.executable, "-m", "accel.cli", *args],
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, "COLUMNS": "200", "OMP_NUM_THREADS": "1"},
    )


def test_cfg_parallelism_is_refused_before_any_rank_starts(chroma_folder: Path) -> None:
    result = cli("run", str(chroma_folder), "--gpus", "2", "--cfg-parallel", "--steps", "2")
    assert result.exit_code == 2
    assert result.stderr == (
        "error: --gpus / [parallel]: ChromaPipeline is not a family accel was taught, and CFG parallelism needs one "
        "(its "
        "context parallelism is planned automatically and verified before use); use ulysses / ring alone, or one "
        "process\n"
    )
    assert "loading" not in result.stdout  # refused from model_index.json, before any rank or load


def test_two_ranks_run_a_saved_unknown_pipeline_on_its_verified_plan(tmp_path: Path) -> None:
    folder = tmp_path / "pixart"
    pipeline("pixart").save_pretrained(folder)
    report = tmp_path / "run.json"
    result = accel_command(
        "run",
        str(folder),
        "--ulysses",
        "2",
        "--steps",
        "2",
        "--height",
        "64",
        "--width",
        "64",
        "--dtype",
        "float32",
        "--compare",
        "--out",
        str(tmp_path / "fox.png"),
        "--json",
        str(report),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    metrics = json.loads(report.read_text())
    assert metrics["parallel"]["plan"] == "automatic" and metrics["parallel"]["ulysses"] == 2
    assert "ulysses 2 on 2 processes, automatic plan (verified)" in result.stdout
    psnr_db = metrics["psnr_db"]  # JSON writes a bit-equal output's infinite PSNR as "inf"
    assert psnr_db == "inf" or psnr_db >= 60.0, psnr_db  # the split run equals one process
    found = json.loads(cli("inspect", str(folder), "--json").stdout)  # the verdict the ranks kept
    assert found["parallel"]["plan"] == "automatic"
    assert found["parallel"]["verdicts"] == [
        {"ulysses": 2, "ring": 1, "exact": True, "reason": None, "source": "automatic"}
    ]


def test_the_report_names_where_a_learned_plan_came_from() -> None:
    from accel.report import _parallel

    layout = {"ulysses": 2, "ring": 1, "cfg": 1, "tp": 1, "chosen": False, "world_size": 2}
    assert (
        _parallel({**layout, "plan": "diffusers _cp_plan"}) == "ulysses 2 on 2 processes, diffusers _cp_plan (verified)"
    )
    assert _parallel({**layout, "plan": "automatic"}) == "ulysses 2 on 2 processes, automatic plan (verified)"
    assert _parallel({**layout, "plan": "family"}) == "ulysses 2 on 2 processes"


def test_two_ranks_of_a_pipeline_the_verification_refuses_stop_with_its_line(chroma_folder: Path) -> None:
    result = accel_command(
        "run",
        str(chroma_folder),
        "--ulysses",
        "2",
        "--steps",
        "2",
        "--height",
        "64",
        "--width",
        "64",
        "--dtype",
        "float32",
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "the automatic context-parallel plan for ChromaTransformer2DModel is refused: " in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    parallel = json.loads(cli("inspect", str(chroma_folder), "--json").stdout)[
        "parallel"
    ]  # the refusal is kept, and told
    [verdict] = parallel["verdicts"]
    assert (verdict["ulysses"], verdict["ring"], verdict["exact"]) == (2, 1, False)
    assert verdict["reason"] in result.stderr and not parallel["modes"]["ulysses"]
    assert parallel["refused"]["ring"] == f"the automatic plan was refused on this model: {verdict['reason']}"
    again = cli("run", str(chroma_folder), "--ulysses", "2", "--steps", "2")  # the kept refusal: before any rank starts
    assert again.exit_code == 2
    assert again.stderr == (
        f"error: --gpus / [parallel]: the automatic context-parallel plan for ChromaTransformer2DModel is "
        f"refused: {verdict['reason']}; run it on one process (cache, quantization and compile apply)\n"
    )


def test_inspect_verifies_the_automatic_plan_on_simulated_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "cogview3"
    pipeline("cogview3").save_pretrained(folder)
    before = json.loads(cli("inspect", str(folder), "--json").stdout)["parallel"]
    assert before["plan"] == "automatic" and before["verdicts"] == []
    found = json.loads(
        cli(
            "inspect",
            str(folder),
            "--json",
            "--verify",
            "--ring",
            "3",
            "--ulysses",
            "1",
            "--dtype",
            "float32",
            "--device",
            "cpu",
        ).stdout
    )
    assert found["parallel"]["verdicts"] == [
        {"ulysses": 1, "ring": 3, "exact": True, "reason": None, "source": "automatic"}
    ]
    table = cli("inspect", str(folder)).stdout
    assert "ulysses 1 × ring 3" in table and "verified exact (automatic)" in table


def test_the_probe_shows_no_progress_bar_and_leaves_the_users_setting(capsys: pytest.CaptureFixture[str]) -> None:
    from accel.models import generic

    pipe = BUILDERS["cogview3"]()
    pipe.set_progress_bar_config(leave=False)
    generic._LEARNED.clear()  # learn again: the record of this class and config may be kept already
    family_of(pipe)
    assert "it/s]" not in capsys.readouterr().err and pipe._progress_bar_config == {"leave": False}


class HelperRunPipeline:
    """A pipeline whose transformer runs its two lists from a helper method, in the other order than it
    defines them (test_discover's HelperRun): the run order is known only from a call."""

    def __init__(self) -> None:
        from test_discover import HelperRun

        self.transformer = HelperRun()
        self.calls = 0

    def __call__(self, prompt: str = "", num_inference_steps: int = 4, output_type: str = "pil") -> Any:
        self.calls += 1
        return self.transformer(torch.ones(1, 4))


def test_the_run_order_comes_from_the_same_single_probe_call() -> None:
    pipe = HelperRunPipeline()
    family = family_of(pipe)
    assert family.blocks == (BlockList("early", returns=("x",)), BlockList("late", returns=("x",)))
    assert family.primary_stream == "x" and pipe.calls == 1


def test_an_edit_pipeline_no_family_describes_takes_its_picture(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call that requires a picture: the probe gives it a grey one, --image fills it, and its automatic
    plan is verified (cross-attention local, the rotary table cut with the video).

    ChronoEdit is a family now (accel/models/chronoedit.py); here its family is taken out of the registry
    for this test only, so its pipeline is one no family describes. diffusers' other pipelines whose call
    requires a picture and that no family names are no cheaper: Sana-Video's image-to-video (tried) bins
    the asked size to 624 or 960 px, refuses 624 for not dividing by 32, and names its frame count
    `frames`, so its probes took 90 s; HunyuanVideo FramePack (LLaMA, CLIP and SigLIP encoders, a clip
    made in sections) and Motif-Video (a T5Gemma2 encoder whose vision tower reads the picture, a guider)
    were not tried."""
    from accel.media import read_video
    from accel.models import chronoedit, registry

    monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path / "cache"))
    # A copy without it (deleting the key would put it back last, reordering the registry for later tests).
    monkeypatch.setattr(
        registry, "FAMILIES", {name: family for name, family in registry.FAMILIES.items() if name != "chronoedit"}
    )
    pipe = chronoedit.build_tiny()
    pipe.set_progress_bar_config(disable=True)
    family = family_of(pipe)
    assert family.blocks == (BlockList("blocks", returns=("hidden_states",)),) and family.frames_arg == "num_frames"
    [own] = family.variants
    assert (own.pipeline_class, own.image, own.optional) == ("ChronoEditPipeline", "image", ())
    call, other = first_transformer_call(pipe, pipe.transformer), other_transformer_call(pipe, pipe.transformer)
    plan = automatic_plan(pipe.transformer, call, other, family.blocks, family.primary_stream, 2, 1, "[parallel]")
    assert plan.local_attention == ("blocks.*.attn2",)
    args, kwargs = call.fresh()
    with torch.no_grad():
        expected = pipe.transformer(*args, **kwargs)[0]
    for output in verify._split_run(pipe.transformer, plan, call, 2, 1):
        assert (output[0] - expected).abs().max() <= 1e-5 * expected.abs().max()
    folder, picture, out = tmp_path / "chronoedit", tmp_path / "in.png", tmp_path / "edit.mp4"
    pipe.save_pretrained(folder)
    Image.new("RGB", (64, 64), (200, 120, 40)).save(picture)
    result = cli(
        "run",
        str(folder),
        "--image",
        str(picture),
        "--steps",
        "2",
        "--height",
        "64",
        "--width",
        "64",
        "--frames",
        "5",
        "--cache",
        "0.1",
        "--dtype",
        "float32",
        "--out",
        str(out),
    )
    assert result.exit_code == 0, result.output
    assert read_video(out).shape == (5, 64, 64, 3)
    missing = cli(
        "run", str(folder), "--steps", "2", "--height", "64", "--width", "64", "--frames", "5", "--dtype", "float32"
    )
    assert missing.exit_code == 2
    assert (
        missing.stderr.splitlines()[-1]
        == "error: ChronoEditPipeline needs an input image: pass --image PATH ([generate] image)"
    )
    assert "Traceback" not in missing.stderr
