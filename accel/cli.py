"""The `accel` command: parses flags into a Recipe and hands it to the runner. Nothing else."""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from typer.core import TyperCommand, TyperGroup

try:  # typer >= 0.26 carries its own click
    from typer._click.exceptions import NoSuchOption
except ImportError:
    from click.exceptions import NoSuchOption

from accel.errors import NotAvailableError, UserError
from accel.launch import DEFAULT_PORT
from accel.serve.limits import Limits


class _Quiet:
    """Help without a `<bool>` placeholder on -h/--help (typer shows one for every flag)."""

    def get_help_option(self, ctx: typer.Context) -> Any:
        option = super().get_help_option(ctx)  # type: ignore[misc]
        if option is not None:
            option.metavar = ""
        return option


class _Group(_Quiet, TyperGroup):
    pass


class _Command(_Quiet, TyperCommand):
    """A command whose unknown-option error names its real neighbours: click compares with the
    dashes, so `--model` would suggest `--help` and `--nnodes`."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except NoSuchOption as error:
            if error.possibilities is None:  # a short option: nothing to compare with
                raise
            raise NoSuchOption(error.option_name, _unknown_option(self, error.option_name), ctx=ctx) from None


def _unknown_option(command: Any, given: str) -> str:
    """'No such option: --x' and what the user may have meant: an argument of that name, a flag
    for the recipe key they typed, or the options closest by name without their dashes."""
    bare = given.lstrip("-")
    if any(p.param_type_name == "argument" and p.name == bare.replace("-", "_") for p in command.params):
        return f"No such option: {given}; the {bare} is the first argument: accel {command.name} {bare.upper()}"
    names = [name for p in command.params if p.param_type_name == "option" for name in p.opts if name.startswith("--")]
    by_bare = {name.lstrip("-"): name for name in names}
    close = [by_bare[name] for name in difflib.get_close_matches(bare, by_bare, n=3, cutoff=0.6)]
    close += [name for key, name in by_bare.items() if bare and (key.startswith(bare) or bare.startswith(key))]
    flag = _FLAG_OF_KEY.get(bare.replace("_", "-"))
    close = list(dict.fromkeys(([flag] if flag in names else []) + close))[:3]
    return f"No such option: {given}" + (f"; did you mean {' or '.join(close)}?" if close else "")


# Recipe keys (and diffusers' call arguments) users type as flags, and the flag that sets them.
_FLAG_OF_KEY = {
    "threshold": "--cache",
    "guidance-scale": "--guidance",
    "num-inference-steps": "--steps",
    "num-frames": "--frames",
    "true-cfg-scale": "--true-cfg",
    "output": "--out",
    "cfg": "--cfg-parallel",
    "method": "--cache-method",
}


app = typer.Typer(
    name="accel",
    cls=_Group,
    help="Fast diffusion-transformer inference: First Block Cache, context parallelism, "
    "parallel VAE, quantization and compile on diffusers pipelines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
console = Console()
errors = Console(stderr=True)


def _version(shown: bool) -> None:
    if shown:
        console.print(f"accel {_installed_version()}", markup=False, highlight=False)
        raise typer.Exit()


def _installed_version() -> str:
    """The installed distribution's version; a source checkout on PYTHONPATH has only the package's."""
    import importlib.metadata

    try:
        return importlib.metadata.version("accel")
    except importlib.metadata.PackageNotFoundError:
        from accel import __version__

        return __version__


@app.callback()
def _accel(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_version,
            is_eager=True,
            metavar="",
            show_default=False,
            help="Print accel's version and exit.",
        ),
    ] = False,
) -> None:
    """Runs before every command (the app's help text is Typer's `help`): accel's own options."""
    from accel.noise import quiet_library_noise

    quiet_library_noise()  # before any command imports torch: also for `app` called in-process


def _fail(message: str, exit_code: int = 2, lost: bool = False) -> None:
    """One line on stderr and a non-zero exit; a rank of a job `accel` launched hands the line to
    the launcher instead, which prints it once for all ranks (`lost`: it only follows another
    rank's failure)."""
    from accel.launch import rank, report_failure, world_size

    if not report_failure(message, exit_code, lost=lost):
        where = f"rank {rank()}: " if world_size() > 1 else ""
        errors.print("[bold red]error:[/]", end=" ")
        errors.print(where + message, markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(exit_code)


Opt = typer.Option
OVERSUBSCRIBE_HELP = "Allow more processes than CPU cores on a machine without GPUs (slow; for testing)."
# A flag takes no value: no `<bool>` placeholder, and off unless given.
FLAG: dict[str, Any] = {"metavar": "", "show_default": "off"}
MASTER_PORT_DEFAULT = f"a free port on one node, else {DEFAULT_PORT}"


def _recipe_default(section: str, key: str) -> str:
    """What `--help` shows for a flag that overrides a recipe key: the recipe's value, else the
    key's default there (unset there: the model family's own default)."""
    from accel.recipe import SECTIONS

    default = {f.name: f.default for f in dataclasses.fields(SECTIONS[section])}[key]
    if default is None or default == "":
        shown = "the model's"
    elif isinstance(default, bool):
        shown = "on" if default else "off"
    elif isinstance(default, float):
        shown = f"{default:g}"
    else:
        shown = str(default)
    return f"recipe, else {shown}"


def _flag(section: str, key: str) -> dict[str, Any]:
    """A flag that turns on a recipe key: no placeholder, and the recipe's value unless given."""
    return {"metavar": "", "show_default": _recipe_default(section, key)}


@app.command(cls=_Command)
def run(
    ctx: typer.Context,
    model: Annotated[
        str | None,
        typer.Argument(
            help="Registry alias (flux, tiny-flux, …; accel models lists them), hub repo id or local folder.",
            show_default="the recipe's [model] name",
        ),
    ] = None,
    recipe: Annotated[
        Path | None,
        Opt(
            "--recipe",
            "-r",
            help="TOML recipe, or the JSON an accel run --json wrote (reruns it); flags override its values.",
            show_default="none",
        ),
    ] = None,
    prompt: Annotated[
        str | None, Opt("--prompt", "-p", help="Text prompt.", show_default=_recipe_default("generate", "prompt"))
    ] = None,
    negative_prompt: Annotated[
        str | None,
        Opt(
            "--negative-prompt",
            help="Negative prompt (pipelines that take one).",
            show_default=_recipe_default("generate", "negative_prompt"),
        ),
    ] = None,
    steps: Annotated[
        int | None, Opt("--steps", help="Denoising steps.", show_default=_recipe_default("generate", "steps"))
    ] = None,
    height: Annotated[
        int | None, Opt("--height", help="Output height in pixels.", show_default=_recipe_default("generate", "height"))
    ] = None,
    width: Annotated[
        int | None, Opt("--width", help="Output width in pixels.", show_default=_recipe_default("generate", "width"))
    ] = None,
    frames: Annotated[
        int | None, Opt("--frames", help="Frames (video families).", show_default=_recipe_default("generate", "frames"))
    ] = None,
    seed: Annotated[
        int | None,
        Opt("--seed", help="Random seed, so runs are comparable.", show_default=_recipe_default("generate", "seed")),
    ] = None,
    guidance: Annotated[
        float | None,
        Opt("--guidance", help="Guidance scale.", show_default=_recipe_default("generate", "guidance_scale")),
    ] = None,
    true_cfg: Annotated[
        float | None,
        Opt(
            "--true-cfg",
            help="True CFG scale (FLUX, HunyuanVideo): above 1 also runs the negative prompt.",
            show_default=_recipe_default("generate", "true_cfg_scale"),
        ),
    ] = None,
    image: Annotated[
        str | None,
        Opt(
            "--image",
            metavar="PATH",
            help="Input image (img2img, inpaint, Kontext, edit pipelines).",
            show_default="none",
        ),
    ] = None,
    mask: Annotated[
        str | None,
        Opt(
            "--mask",
            metavar="PATH",
            help="Mask image (inpaint, fill pipelines; white is repainted).",
            show_default="none",
        ),
    ] = None,
    video: Annotated[
        str | None,
        Opt(
            "--video",
            metavar="PATH",
            help="Input video (video-to-video, editing, VACE pipelines).",
            show_default="none",
        ),
    ] = None,
    conditions: Annotated[
        list[str] | None,
        Opt(
            "--condition",
            metavar="PATH@INDEX:STRENGTH",
            help="A picture or clip pinned to a position (LTX-2, LTX-Video condition pipelines); repeatable.",
            show_default="none",
        ),
    ] = None,
    references: Annotated[
        list[str] | None,
        Opt(
            "--reference",
            metavar="PATH@STRENGTH",
            help="A reference picture or clip without a position (LTX-2 IC-LoRA); repeatable.",
            show_default="none",
        ),
    ] = None,
    inputs: Annotated[
        list[str] | None,
        Opt(
            "--input",
            metavar="KEYWORD=PATH",
            help="Another input file under the pipeline's keyword, e.g. pose_video=pose.mp4 (Wan Animate); repeatable.",
            show_default="none",
        ),
    ] = None,
    arguments: Annotated[
        list[str] | None,
        Opt(
            "--arg",
            metavar="KEYWORD=VALUE",
            help="Another pipeline call argument, e.g. mode=replace or overlap_history=17 (a TOML value, else a "
            "string); repeatable.",
            show_default="none",
        ),
    ] = None,
    lora: Annotated[
        list[str] | None,
        Opt(
            "--lora",
            metavar="PATH@SCALE",
            help="LoRA weights fused into the model (a .safetensors file, folder or hub repo id; scale 1 when left "
            "out); repeatable.",
            show_default="none",
        ),
    ] = None,
    pipeline: Annotated[
        str | None,
        Opt(
            "--pipeline",
            metavar="CLASS",
            help="Pipeline class to run the model as, e.g. FluxKontextPipeline.",
            show_default=_recipe_default("model", "pipeline"),
        ),
    ] = None,
    components: Annotated[
        list[str] | None,
        Opt(
            "--component",
            metavar="NAME=FOLDER",
            help="A component the pipeline needs beyond the model's, e.g. temporal_latent_upsampler=FOLDER "
            "(LTX2DFRTemporalRefinePipeline); repeatable.",
            show_default="none",
        ),
    ] = None,
    dtype: Annotated[
        str | None,
        Opt("--dtype", help="auto, float32, float16 or bfloat16.", show_default=_recipe_default("model", "dtype")),
    ] = None,
    device: Annotated[
        str | None, Opt("--device", help="auto, cpu or cuda.", show_default=_recipe_default("model", "device"))
    ] = None,
    cache: Annotated[
        float | None,
        Opt(
            "--cache",
            metavar="THRESHOLD",
            help="Cache threshold (0 = off).",
            show_default=_recipe_default("cache", "threshold"),
        ),
    ] = None,
    cache_method: Annotated[
        str | None,
        Opt(
            "--cache-method",
            metavar="METHOD",
            help="fbcache, dbcache, taylorseer or magcache.",
            show_default=_recipe_default("cache", "method"),
        ),
    ] = None,
    first_blocks: Annotated[
        int | None,
        Opt(
            "--first-blocks",
            metavar="N",
            help="dbcache: blocks always computed first; they decide.",
            show_default=_recipe_default("cache", "first_blocks"),
        ),
    ] = None,
    last_blocks: Annotated[
        int | None,
        Opt(
            "--last-blocks",
            metavar="N",
            help="dbcache: blocks always computed last.",
            show_default=_recipe_default("cache", "last_blocks"),
        ),
    ] = None,
    calibrator: Annotated[
        str | None,
        Opt(
            "--calibrator",
            metavar="NAME",
            help="none (reuse the skipped blocks' residual) or taylorseer (extrapolate it).",
            show_default=_recipe_default("cache", "calibrator"),
        ),
    ] = None,
    taylor_order: Annotated[
        int | None,
        Opt(
            "--taylor-order",
            metavar="N",
            help="taylorseer: 1 or 2.",
            show_default=_recipe_default("cache", "taylor_order"),
        ),
    ] = None,
    max_cached_steps: Annotated[
        int | None,
        Opt(
            "--max-cached-steps",
            metavar="N",
            help="Most cached calls per generation (0 = no limit).",
            show_default=_recipe_default("cache", "max_cached_steps"),
        ),
    ] = None,
    interval: Annotated[
        int | None,
        Opt(
            "--interval",
            metavar="N",
            help="taylorseer: compute every N-th step, extrapolate between.",
            show_default=_recipe_default("cache", "interval"),
        ),
    ] = None,
    out: Annotated[
        Path | None,
        Opt(
            "--out",
            "-o",
            help="Output .png / .mp4, or for linear HDR video .npy frames / .mp4 SDR preview, or .pt: the latents a "
            "multi-pass pipeline hands on.",
            show_default="a fresh name under outputs/",
        ),
    ] = None,
    overwrite: Annotated[bool, Opt("--overwrite", help="Replace --out / --json if they exist.", **FLAG)] = False,
    json_path: Annotated[
        Path | None, Opt("--json", help="Write every measured number to this JSON file.", show_default="none")
    ] = None,
    compare: Annotated[
        bool, Opt("--compare", help="Also run the unaccelerated baseline: speedup and PSNR.", **FLAG)
    ] = False,
    warmup: Annotated[int, Opt("--warmup", help="Untimed warm-up generations before the timed one.")] = 1,
    repeats: Annotated[
        int,
        Opt(
            "--repeats",
            help="Timed generations; the table shows their median and min–max (--compare alternates baseline and "
            "accelerated runs).",
        ),
    ] = 1,
    gpus: Annotated[
        int | None,
        Opt(
            "--gpus",
            help="Processes (GPUs; gloo ranks on a CPU-only machine); relaunches under torchrun.",
            show_default="recipe, else ulysses × ring × cfg × tp",
        ),
    ] = None,
    ulysses: Annotated[
        int | None,
        Opt(
            "--ulysses",
            help="Ulysses degree.",
            show_default=_recipe_default("parallel", "ulysses") + ", or chosen for --gpus",
        ),
    ] = None,
    ring: Annotated[
        int | None,
        Opt("--ring", help="Ring degree.", show_default=_recipe_default("parallel", "ring") + ", or chosen for --gpus"),
    ] = None,
    tp: Annotated[
        int | None,
        Opt(
            "--tp",
            help="Tensor-parallel degree: each block's heads and MLP width split over tp ranks.",
            show_default=_recipe_default("parallel", "tp"),
        ),
    ] = None,
    cp_plan: Annotated[
        str | None,
        Opt(
            "--cp-plan",
            metavar="FROM",
            help="family: the family's tested context-parallel plan; automatic: learned from the model and verified "
            "on simulated ranks before use.",
            show_default=_recipe_default("parallel", "plan"),
        ),
    ] = None,
    text_encoder: Annotated[
        str | None,
        Opt(
            "--text-encoder",
            metavar="PLACE",
            help="replicated; rank0: only the first rank holds the text encoders and sends the embeddings; cpu: as "
            "rank0, in host memory; sharded: split over the ranks by transformers' TP plan.",
            show_default=_recipe_default("memory", "text_encoder"),
        ),
    ] = None,
    vae_placement: Annotated[
        str | None,
        Opt(
            "--vae-placement",
            metavar="PLACE",
            help="replicated; rank0: only the first rank, which writes the output, decodes; the others keep the VAE "
            "in host memory.",
            show_default=_recipe_default("memory", "vae"),
        ),
    ] = None,
    gpu_memory: Annotated[
        float | None,
        Opt(
            "--gpu-memory",
            help="GiB per GPU: a flagship checkpoint's layout is planned (with --gpus alone) or checked against it "
            "before loading.",
            show_default="the visible GPU's",
        ),
    ] = None,
    offload: Annotated[
        str | None,
        Opt(
            "--offload",
            metavar="MODE",
            help="none; model: each component moved to the GPU while it runs; group: the transformer's blocks "
            "streamed (diffusers' offloading).",
            show_default=_recipe_default("memory", "offload"),
        ),
    ] = None,
    cfg_parallel: Annotated[
        bool,
        Opt("--cfg-parallel", help="Run CFG halves on separate ranks.", metavar="", show_default="recipe, else off"),
    ] = False,
    parallel_vae: Annotated[
        bool, Opt("--parallel-vae", help="Split the VAE decode over the ranks.", **_flag("vae", "parallel"))
    ] = False,
    vae_tiling: Annotated[
        bool,
        Opt(
            "--vae-tiling",
            help="Decode in tiles (the VAE's own tiling) to bound the decode's memory.",
            **_flag("vae", "tiling"),
        ),
    ] = False,
    quant: Annotated[
        str | None,
        Opt(
            "--quant",
            help="none, int8wo, int8dq, fp8dq, fp8wo or int4wo.",
            show_default=_recipe_default("quant", "type"),
        ),
    ] = None,
    compile_: Annotated[
        bool, Opt("--compile", help="torch.compile the transformer blocks.", **_flag("compile", "enabled"))
    ] = False,
    nnodes: Annotated[int, Opt("--nnodes", help="Nodes of a multi-node job (each runs the same command).")] = 1,
    node_rank: Annotated[int, Opt("--node-rank", help="This node's index in a multi-node job.")] = 0,
    master_addr: Annotated[
        str | None, Opt("--master-addr", help="Address of node 0 (multi-node).", show_default="127.0.0.1 on one node")
    ] = None,
    master_port: Annotated[
        int | None, Opt("--master-port", help="Port on node 0 (multi-node).", show_default=MASTER_PORT_DEFAULT)
    ] = None,
    oversubscribe: Annotated[bool, Opt("--oversubscribe", help=OVERSUBSCRIBE_HELP, **FLAG)] = False,
    verbose: Annotated[
        bool, Opt("--verbose", "-v", help="Also show each cache decision and the bytes each rank sent.", **FLAG)
    ] = False,
) -> None:
    """Generate once with the accelerators the flags / recipe ask for, and print the timing table."""
    overrides: dict[str, dict[str, Any]] = {
        "model": {
            "name": model,
            "dtype": dtype,
            "device": device,
            "pipeline": pipeline,
            "lora": lora or None,
            "components": _pairs("--component", components, "temporal_latent_upsampler=upsampler", parse=False),
        },
        "generate": {
            "prompt": prompt,
            "negative_prompt": negative_prompt,
            "steps": steps,
            "height": height,
            "width": width,
            "frames": frames,
            "seed": seed,
            "guidance_scale": guidance,
            "true_cfg_scale": true_cfg,
            "image": image,
            "mask": mask,
            "video": video,
            "conditions": conditions or None,
            "references": references or None,
            "inputs": _pairs("--input", inputs, "pose_video=pose.mp4", parse=False),
            "arguments": _pairs("--arg", arguments, "overlap_history=17", parse=True),
        },
        "cache": {
            "threshold": cache,
            "method": cache_method,
            "first_blocks": first_blocks,
            "last_blocks": last_blocks,
            "calibrator": calibrator,
            "taylor_order": taylor_order,
            "max_cached_steps": max_cached_steps,
            "interval": interval,
        },
        "parallel": {
            "gpus": gpus,
            "ulysses": ulysses,
            "ring": ring,
            "tp": tp,
            "cfg": 2 if cfg_parallel else None,
            "plan": cp_plan,
        },
        "vae": {"parallel": True if parallel_vae else None, "tiling": True if vae_tiling else None},
        "quant": {"type": quant},
        "compile": {"enabled": True if compile_ else None},
        "memory": {"text_encoder": text_encoder, "vae": vae_placement, "offload": offload},
    }
    from accel import preflight
    from accel.launch import rank
    from accel.models.refs import resolve_model
    from accel.parallel.mesh import under_distributed_launcher

    lead = rank() == 0
    try:
        # Checks before torch loads (seconds) and before any rank starts: an alias names its family,
        # whose pipeline says which --out suffixes it is written as; any model is refused the others.
        settings = _recipe(recipe, overrides)
        resolve_model(settings.model.name)  # an unknown model: one line, before torch loads
        _check_out_for_alias(out, settings.model)
        preflight.check_out(out, overwrite or not lead)  # a rank > 0 leaves existing files to rank 0
        preflight.check_json(json_path, overwrite or not lead)
        if gpus is not None and gpus < 1:
            raise UserError(f"--gpus must be >= 1, got {gpus}")
        from accel.memory.fit import planned_here
        from accel.recipe import memory_refusal

        if (refusal := memory_refusal(settings)) is not None:
            raise UserError(refusal)
        if settings.world_size > 1 and not under_distributed_launcher():
            from accel.launch import LaunchSpec

            spec = LaunchSpec.for_world(
                settings.world_size, nnodes, node_rank, master_addr, master_port, settings.parallel.timeout
            )
            asked = f"--gpus {settings.world_size}" if gpus is not None else "the [parallel] layout"
            preflight.check_process_count(spec.nproc, settings.model.device, oversubscribe, spec.nnodes, asked)
            preflight.check_master_port(master_addr, master_port, node_rank)
            planned = planned_here(settings, gpu_memory)  # a flagship's plan: seconds, so after the checks
            raise typer.Exit(_relaunch(ctx, planned.recipe, spec, planned.flags))
        planned = planned_here(settings, gpu_memory)
        settings = _fit_to_job(planned.recipe)
        from accel.files import claim
        from accel.runner import run as run_recipe  # torch and diffusers load only for a valid recipe

        # The JSON is this run's before the long work starts: a concurrent run is refused now, not after.
        json_claim = claim(json_path) if json_path is not None and lead else None
        try:
            metrics = run_recipe(
                settings,
                out=out,
                overwrite=overwrite,
                compare=compare,
                warmup=warmup,
                repeats=repeats,
                progress=_progress(lead),
                announce=_say if lead else None,
                planned_peak=planned.peak,
            )
            if lead:
                _report_run(metrics, verbose, json_path, overwrite, (ctx.obj or {}).get("argv") or sys.argv[1:])
        finally:
            if json_claim is not None:
                json_claim.release()
    except UserError as error:
        _fail(str(error))
        return


def _check_out_for_alias(out: Path | None, model: Any) -> None:
    """--out's suffix against what the asked pipeline makes, where the model (`[model]`) is an alias
    (no torch: a folder's or repo's family is known later, and runner.run checks it then). A .pt
    name (a pass's latents, runner.LATENT_SUFFIX) is the runner's to check: it knows which variants hand latents on."""
    if out is None or out.suffix.lower() == ".pt":
        return
    from accel.models.registry import lookup
    from accel.models.variants import check_out_suffix, planned_output

    found = lookup(model.name)
    if found is not None:
        check_out_suffix(out, *planned_output(found[0], model.pipeline or None))


def _report_run(metrics: Any, verbose: bool, json_path: Path | None, overwrite: bool, argv: list[str]) -> None:
    from accel import report

    console.print(report.run_table(metrics))
    for note in metrics.notes:
        console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    if verbose and metrics.cache is not None:
        console.print(report.cache_calls_table(metrics))
    if verbose and metrics.parallel is not None:
        console.print(report.traffic_table(metrics))
    if json_path is not None:
        report.write_json(report.run_document(metrics, argv), json_path, replace=overwrite)
        console.print(f"wrote {json_path}")


def _pairs(flag: str, given: list[str] | None, example: str, parse: bool) -> dict[str, Any] | None:
    """`KEYWORD=VALUE` flags as a table; with `parse`, a value TOML reads (17, true, [1, 2], "x") is
    that value, anything else the string itself (mode=replace). Malformed is one line, exit 2."""
    import tomllib

    if not given:
        return None
    table: dict[str, Any] = {}
    for item in given:
        keyword, equals, value = item.partition("=")
        if not equals or not keyword.strip().isidentifier():
            _fail(f"{flag} {item}: write KEYWORD=VALUE, e.g. {flag} {example}")
        if parse:
            try:
                value = tomllib.loads(f"value = {value}")["value"]
            except (tomllib.TOMLDecodeError, ValueError, RecursionError):  # ValueError: an integer of 4300+ digits
                pass
        table[keyword.strip()] = value
    return table


def _recipe(recipe_path: Path | None, overrides: dict[str, dict[str, Any]]) -> Any:
    """The recipe file (or defaults) with the flags given on top."""
    from accel.recipe import Recipe, load_recipe

    base = load_recipe(recipe_path) if recipe_path is not None else Recipe.from_dict({})
    given = {section: {k: v for k, v in keys.items() if v is not None} for section, keys in overrides.items()}
    return base.with_overrides({section: keys for section, keys in given.items() if keys}, source="command line")


def _relaunch(ctx: typer.Context | None, settings: Any, spec: Any, extra: tuple[str, ...] = ()) -> int:
    """Check the layout with what is known before start-up, then rerun this command on every rank."""
    from accel.models.loading import resolve_device, resolve_dtype
    from accel.models.refs import heads_before_start, resolve_model
    from accel.models.lora import parse_loras
    from accel.optimize.quantize import check_hardware
    from accel.parallel.mesh import resolve_degrees
    from accel.parallel.plan import plan_of, refuse_untaught_before_start

    ref = resolve_model(settings.model.name)
    refuse_untaught_before_start(ref, "--gpus / [parallel]", settings.parallel)
    parse_loras(settings.model.lora)  # a missing LoRA file: one line before any rank starts
    check_hardware(settings.quant.type, resolve_device(settings.model.device), resolve_dtype(settings.model.dtype, ref))
    if ref.family is not None:
        from accel.models.call import generation_kwargs

        plan_of(ref.family, "--gpus / [parallel]")
        generation_kwargs(ref.family, ref.tiny, settings, loads_as=ref.pipeline)  # CFG on where cfg = 2
    degrees = resolve_degrees(settings.parallel, heads_before_start(ref), settings.model.name)
    if (
        ref.family is None and degrees.sequence > 1
    ):  # a refusal kept from an earlier verification: before any rank starts
        from accel.parallel.verify import refuse_kept_verdict

        refuse_kept_verdict(ref.name, degrees.ulysses, degrees.ring, "--gpus / [parallel]")
    if settings.memory.text_encoder == "sharded":
        from accel.parallel.encoders import refusal_before_start

        if (refusal := refusal_before_start(ref)) is not None:  # encoders without a TP plan: before any rank starts
            raise NotAvailableError(refusal)
    return _rerun_on_ranks(ctx, spec, extra)


def _rerun_on_ranks(ctx: typer.Context | None, spec: Any, extra: tuple[str, ...] = ()) -> int:
    """This very command line (plus `extra`) on every rank of `spec`, under torchrun."""
    from accel.launch import launch

    argv = (ctx.obj or {}).get("argv") if ctx is not None else None
    if argv is None:
        raise UserError("--gpus: relaunching needs the accel command line; run accel from a shell")
    return launch(spec, "accel.cli", [*argv, *extra])


def _fit_to_job(settings: Any) -> Any:
    """Under torchrun: no layout given means one over all the job's ranks; a layout must fit the job."""
    from accel.launch import world_size

    world = world_size()
    if world > 1 and settings.world_size == 1:
        return settings.with_overrides({"parallel": {"gpus": world}}, source="torchrun")
    if settings.world_size != world:
        raise UserError(
            f"[parallel] asks for {settings.world_size} processes, but this torchrun job has {world}; "
            f"make them match (--gpus {world}) or run without torchrun"
        )
    return settings


def _say(line: str) -> None:
    console.print(line, markup=False, highlight=False)


def _progress(lead: bool) -> Any:
    """Rank 0's step progress: a live bar where someone watches, plain lines where output is piped
    or logged (a bar's redraws would arrive there as a heap of blank lines)."""
    if not lead:
        return None
    return _step_bar if console.is_terminal else _step_lines


@contextmanager
def _step_lines(label: str) -> Iterator[Any]:
    yield _Lines(label)


class _Lines:
    """A line a block of steps, about a quarter of the generation each: 'label: step 6/12, 1.2 s'."""

    BLOCKS = 4

    def __init__(self, label: str) -> None:
        self.label = label
        self.total = 0
        self.done = 0
        self.start_s = 0.0

    def start(self, total: int) -> None:
        import time

        self.total, self.done, self.start_s = total, 0, time.perf_counter()

    def advance(self) -> None:
        import time

        self.done += 1
        block = max(1, -(-self.total // self.BLOCKS))
        if self.done % block == 0 or self.done == self.total:
            _say(f"{self.label}: step {self.done}/{self.total}, {time.perf_counter() - self.start_s:.1f} s")


@contextmanager
def _step_bar(label: str) -> Iterator[Any]:
    """A rich bar over denoising steps; the runner starts and advances it from scheduler events."""
    with Progress(
        TextColumn(f"[bold]{label}[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        yield _Bar(progress)


class _Bar:
    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.task: Any = None

    def start(self, total: int) -> None:
        if self.task is None:
            self.task = self.progress.add_task("steps", total=total)
        else:
            self.progress.reset(self.task, total=total)

    def advance(self) -> None:
        if self.task is not None:
            self.progress.advance(self.task)


@app.command(cls=_Command)
def bench(
    ctx: typer.Context,
    recipe: Annotated[
        Path, typer.Argument(help=escape("TOML recipe with [bench] variants (e.g. recipes/tiny-flux.toml)."))
    ],
    gpus: Annotated[
        int | None,
        Opt(
            "--gpus",
            help="Processes for the whole bench.",
            show_default="what the largest variant needs, at most the GPUs here, or CPU cores without one",
        ),
    ] = None,
    out: Annotated[
        Path | None,
        Opt("--out", "-o", help="Fresh folder for the outputs and reports.", show_default="a new one under outputs/"),
    ] = None,
    json_path: Annotated[
        Path | None, Opt("--json", help="Also write the JSON report here.", show_default="none")
    ] = None,
    markdown_path: Annotated[
        Path | None, Opt("--markdown", help="Also write the Markdown report here.", show_default="none")
    ] = None,
    only: Annotated[
        list[str] | None,
        Opt(
            "--only",
            metavar="NAME",
            help="Run only this variant (repeatable); the baseline always runs.",
            show_default="every variant",
        ),
    ] = None,
    repeats: Annotated[
        int | None, Opt("--repeats", help="Timed runs per variant.", show_default=_recipe_default("bench", "repeats"))
    ] = None,
    warmup: Annotated[
        int | None, Opt("--warmup", help="Warm-up runs per variant.", show_default=_recipe_default("bench", "warmup"))
    ] = None,
    gpu_memory: Annotated[
        float | None,
        Opt(
            "--gpu-memory",
            help="GiB per GPU: a flagship checkpoint's variants left to accel take the plan's layout, the others are "
            "checked against it before loading.",
            show_default="the visible GPU's",
        ),
    ] = None,
    oversubscribe: Annotated[bool, Opt("--oversubscribe", help=OVERSUBSCRIBE_HELP, **FLAG)] = False,
) -> None:
    r"""Run a recipe's \[bench] variants side by side and compare them with the first (the baseline)."""
    from accel import preflight
    from accel.launch import rank
    from accel.parallel.mesh import under_distributed_launcher

    lead = rank() == 0
    try:
        # Model-free checks first: before torch loads (plan_bench loads it) and before any rank starts.
        preflight.check_report(json_path, "--json", check_exists=lead)  # rank 0 may have written them already
        preflight.check_report(markdown_path, "--markdown", check_exists=lead)
        preflight.check_bench_folder(out, check_exists=lead)
        if gpus is not None and gpus < 1:
            raise UserError(f"--gpus must be >= 1, got {gpus}")
        from accel.models.refs import resolve_model
        from accel.recipe import load_recipe

        settings = load_recipe(recipe)
        resolve_model(settings.model.name)  # an unknown model: one line, before plan_bench loads torch
        given = {k: v for k, v in (("repeats", repeats), ("warmup", warmup)) if v is not None}
        if given:
            settings = settings.with_overrides({"bench": given}, source="command line")
        if (
            gpus is not None and gpus > 1 and not under_distributed_launcher()
        ):  # without --gpus the plan fits the machine
            preflight.check_process_count(gpus, settings.model.device, oversubscribe)
        from accel.bench.plan import fit_bench, plan_bench

        plan = fit_bench(
            plan_bench(settings, gpus, only), gpu_memory
        )  # a flagship's plan: seconds, so after the checks
        if plan.world_size > 1 and not under_distributed_launcher():
            from accel.launch import LaunchSpec

            pinned = () if gpus is not None else ("--gpus", str(plan.world_size))  # ranks plan the same job
            spec = LaunchSpec.for_world(plan.world_size, timeout_s=plan.recipe.parallel.timeout)
            raise typer.Exit(_rerun_on_ranks(ctx, spec, pinned))
        from accel.files import claim

        # The report copies are this bench's before it measures: a concurrent one is refused now.
        claims = []
        try:
            claims += [claim(path) for path in (json_path, markdown_path) if path is not None and lead]
            folder = _fresh_folder(out, recipe) if lead else None
            result = _run_bench(plan, folder, lead)
            if result is None or folder is None:
                return
            from accel.bench import report

            report.write_bench(result, folder, json_path, markdown_path)
        finally:
            for held in claims:
                held.release()
    except UserError as error:
        _fail(str(error))
        return
    # A log or pipe has no width to fit: give the table room rather than folding every number.
    (console if console.is_terminal else Console(width=max(console.width, 140))).print(report.bench_table(result))
    for note in report.bench_notes(result):
        console.print(note, markup=False, highlight=False)
    for name, path in result.files.items():
        console.print(f"wrote {name}: {path}")


def _run_bench(plan: Any, folder: Path | None, lead: bool) -> Any:
    from accel.bench.run import run_bench

    return run_bench(plan, folder, _progress(lead), _say if lead else None)


def _fresh_folder(out: Path | None, recipe: Path) -> Path:
    """--out as given (checked to be new or empty), else the first free outputs/bench-<recipe>[-N],
    created here: two benches started at once never share a folder."""
    from accel.files import fresh_folder

    return out if out is not None else fresh_folder(Path("outputs"), f"bench-{recipe.stem}")


@app.command(cls=_Command)
def tune(
    ctx: typer.Context,
    recipe: Annotated[Path, typer.Argument(help="TOML recipe of the pipeline to tune (e.g. recipes/tiny-flux.toml).")],
    target: Annotated[
        str | None,
        Opt(
            "--target",
            metavar="METRIC=VALUE",
            help="Find the fastest cache setting whose worst-prompt quality meets this: psnr=32 (dB) or ssim=0.95, "
            "against the uncached output.",
            show_default="none",
        ),
    ] = None,
    calibrate: Annotated[
        bool,
        Opt("--calibrate", help="Measure MagCache's per-step magnitude ratios and write a MagCache recipe.", **FLAG),
    ] = False,
    prompts: Annotated[
        Path | None,
        Opt(
            "--prompts",
            metavar="FILE",
            help="--target: the prompts to measure quality on, one a line.",
            show_default="2 built-in prompts of the family",
        ),
    ] = None,
    out: Annotated[
        Path | None,
        Opt(
            "--out",
            "-o",
            help="The recipe to write; never overwritten.",
            show_default="<recipe>-tuned.toml (-magcache.toml with --calibrate) beside it",
        ),
    ] = None,
    plot: Annotated[
        Path | None,
        Opt(
            "--plot",
            help="--target: the speedup / PSNR plot to write; never overwritten.",
            show_default="the written recipe's name, .png",
        ),
    ] = None,
    gpus: Annotated[
        int | None,
        Opt(
            "--gpus",
            help="--target: processes the whole search runs on (relaunches under torchrun).",
            show_default="recipe, else ulysses × ring × cfg × tp",
        ),
    ] = None,
    repeats: Annotated[
        int, Opt("--repeats", help="--target: timed generations per setting and prompt; their median counts.")
    ] = 1,
    warmup: Annotated[
        int | None,
        Opt(
            "--warmup",
            help="--target: untimed generations before each timed one.",
            show_default="1 with [compile] on, else 0",
        ),
    ] = None,
    oversubscribe: Annotated[bool, Opt("--oversubscribe", help=OVERSUBSCRIBE_HELP, **FLAG)] = False,
) -> None:
    """Tune the cache: the fastest setting that meets a quality target (--target), or MagCache's curve (--calibrate)."""
    from accel.launch import rank
    from accel.parallel.mesh import under_distributed_launcher

    lead = rank() == 0
    try:
        if (target is None) == (not calibrate):
            raise UserError(
                "accel tune: pass --target psnr=32 (or ssim=0.95) to search for the fastest cache setting that "
                "meets it, or --calibrate to measure MagCache's curve" + ("; not both" if calibrate else "")
            )
        from accel.recipe import load_recipe
        from accel.tune import fresh_recipe_path

        settings = load_recipe(recipe)
        if calibrate:
            from accel.tune import calibrate as run_calibration

            path = out if out is not None else fresh_recipe_path(recipe, "magcache")
            calibrated = run_calibration(settings, path)
            ratios = calibrated.cache.mag_ratios
            console.print(
                f'wrote {path}: [cache] method = "magcache", threshold = {calibrated.cache.threshold}, '
                f"{len(ratios[0])} ratios (one a step) for {len(ratios)} CFG branch{'es' if len(ratios) > 1 else ''}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
            return
        assert target is not None
        from accel import preflight
        from accel.tune.target import parse_target

        goal = parse_target(target)
        texts = _read_prompts(prompts) if prompts is not None else None
        if gpus is not None:
            if gpus < 1:
                raise UserError(f"--gpus must be >= 1, got {gpus}")
            settings = settings.with_overrides({"parallel": {"gpus": gpus}}, source="command line")
        if repeats < 1:
            raise UserError(f"--repeats must be >= 1, got {repeats}")
        if warmup is not None and warmup < 0:
            raise UserError(f"--warmup must be >= 0, got {warmup}")
        recipe_out = out if out is not None else fresh_recipe_path(recipe, "tuned")
        plot_out = plot if plot is not None else recipe_out.with_suffix(".png")
        for path, flag in ((recipe_out, "--out"), (plot_out, "--plot")):
            if lead and path.exists():
                raise UserError(f"{flag} {path} exists: accel tune never overwrites; pass another {flag}")
            if not path.parent.is_dir():
                raise UserError(f"{flag} {path}: no folder {path.parent}; create it or pass another {flag}")
        if settings.world_size > 1 and not under_distributed_launcher():
            from accel.launch import LaunchSpec

            spec = LaunchSpec.for_world(settings.world_size, timeout_s=settings.parallel.timeout)
            preflight.check_process_count(spec.nproc, settings.model.device, oversubscribe)
            pinned = (
                *(("--out", str(recipe_out)) if out is None else ()),
                *(("--plot", str(plot_out)) if plot is None else ()),
            )
            raise typer.Exit(_relaunch(ctx, settings, spec, pinned))
        settings = _fit_to_job(settings)
        from accel.tune.job import tune_to_target, write_outputs

        announce = (lambda line: console.print(line, markup=False, highlight=False)) if lead else (lambda _line: None)
        result = tune_to_target(settings, goal, texts, repeats, warmup, announce)
        if result is None:
            return
        from accel.tune.report import summary, tune_table

        console.print(tune_table(result))
        console.print(summary(result), markup=False, highlight=False, soft_wrap=True)
        if result.best is None:
            raise UserError(_unreachable(result))
        write_outputs(result, recipe_out, plot_out)
    except UserError as error:
        _fail(str(error))
        return
    from accel.tune.search import describe

    best = result.best
    console.print(
        f"chosen: {describe(best.cache)}: {best.final_speedup:.2f}× with worst-prompt PSNR "
        f"{best.psnr_db:.1f} dB, SSIM {best.ssim:.4f}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    if best.final_speedup < 1:
        console.print(
            f"note: even this setting is slower than the uncached run here ({best.final_speedup:.2f}×): on this "
            "machine the "
            "cache costs more than the blocks it skips",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    console.print(f"wrote {recipe_out} and {plot_out}", markup=False, highlight=False, soft_wrap=True)


def _read_prompts(path: Path) -> tuple[str, ...]:
    """One prompt a line; blank lines and lines starting with # are skipped."""
    from accel.recipe import PROMPT_CHARS_ENV, prompt_chars, read_capped

    try:
        lines = read_capped(path, f"--prompts {path}", "write one prompt a line").decode("utf-8").splitlines()
    except OSError as error:
        raise UserError(f"--prompts {path}: cannot read it ({error.strerror})") from None
    except UnicodeDecodeError:
        raise UserError(f"--prompts {path}: not UTF-8 text; write one prompt a line") from None
    found = tuple(line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#"))
    if not found:
        raise UserError(f"--prompts {path}: no prompt in it; write one prompt a line")
    limit = prompt_chars()
    for number, text in enumerate(found, 1):
        if len(text) > limit:
            raise UserError(
                f"--prompts {path}: prompt {number} has {len(text):,} characters, more than {limit:,}; "
                f"shorten it ({PROMPT_CHARS_ENV} raises the limit)"
            )
    return found


def _unreachable(result: Any) -> str:
    """Why no setting was chosen, with the best quality any caching setting reached."""
    goal = result.target
    cached = [t for t in result.trials if t.hit_rate > 0]
    if not cached:
        return (
            "accel tune: no setting tried cached any call on this pipeline, so none can be faster than the uncached run"
        )
    closest = max(cached, key=lambda t: goal.of(t.psnr_db, t.ssim))
    from accel.tune.search import describe

    reached = f"{closest.psnr_db:.1f} dB" if goal.metric == "psnr" else f"SSIM {closest.ssim:.4f}"
    return (
        f"accel tune: no cache setting reaches {goal.describe()} on every prompt; the closest, "
        f"{describe(closest.cache)}, reached {reached}; lower the target"
    )


@app.command(cls=_Command)
def serve(
    ctx: typer.Context,
    model: Annotated[
        str | None,
        typer.Argument(
            help="Registry alias (flux, tiny-flux, …), hub repo id or local folder; or give --recipe.",
            show_default="the recipe's [model] name",
        ),
    ] = None,
    recipe: Annotated[
        Path | None,
        Opt(
            "--recipe",
            "-r",
            help=escape("TOML recipe; flags override its values. Its [generate] values are the requests' defaults."),
            show_default="none",
        ),
    ] = None,
    gpus: Annotated[
        int | None,
        Opt(
            "--gpus",
            help="Processes of the whole server (GPUs; gloo ranks on a CPU-only machine), split evenly over the "
            "replicas.",
            show_default="recipe, else ulysses × ring × cfg × tp, per replica",
        ),
    ] = None,
    replicas: Annotated[
        int,
        Opt(
            "--replicas",
            help="Independent copies of the pipeline, each on --gpus / --replicas processes; "
            "requests go to a free one.",
        ),
    ] = 1,
    host: Annotated[str, Opt("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, Opt("--port", help="Port to listen on.")] = 8000,
    max_queue: Annotated[
        int, Opt("--max-queue", help="Requests that may wait for a free replica; more get HTTP 429.")
    ] = 4,
    drain: Annotated[
        float,
        Opt(
            "--drain",
            help="Seconds the accepted requests may take to finish after SIGINT / SIGTERM; then those still queued "
            "get HTTP 503 and those running stop at their next step.",
        ),
    ] = 60.0,
    request_timeout: Annotated[
        float | None,
        Opt(
            "--request-timeout",
            metavar="SECONDS",
            help="Seconds one request may run; past them it stops at its next step and gets HTTP 504, and /health "
            "reports a replica still on it.",
            show_default="no limit",
        ),
    ] = None,
    max_prompt: Annotated[
        int,
        Opt(
            "--max-prompt",
            metavar="CHARS",
            help="Longest prompt (and negative_prompt) a request may send, in characters; longer ones get HTTP 400.",
        ),
    ] = Limits.max_prompt,
    max_prompt_tokens: Annotated[
        int,
        Opt(
            "--max-prompt-tokens",
            metavar="TOKENS",
            help="Most tokens a prompt (and negative_prompt) may make in any of the pipeline's fast tokenizers, after "
            "the --max-prompt check; more get HTTP 400.",
        ),
    ] = Limits.max_prompt_tokens,
    max_body: Annotated[
        int,
        Opt("--max-body", metavar="BYTES", help="Largest request body; larger ones get HTTP 413 before they are read."),
    ] = Limits.max_body,
    max_work: Annotated[
        int,
        Opt(
            "--max-work",
            metavar="MPX_STEPS",
            help="Most work one request may ask for: width × height × frames × steps × n, in megapixel-steps; more "
            "gets HTTP 400.",
        ),
    ] = Limits.max_work,
    api_keys: Annotated[
        list[str] | None,
        Opt(
            "--api-key",
            metavar="KEY",
            help="A key clients must send as 'Authorization: Bearer KEY' (every endpoint but /health); repeatable.",
            show_default="$ACCEL_API_KEY (comma-separated), else none",
        ),
    ] = None,
    trusted_hosts: Annotated[
        list[str] | None,
        Opt(
            "--trusted-host",
            metavar="NAME",
            help="Another Host header name to answer (others get HTTP 421; * answers any); repeatable.",
            show_default="--host, localhost, 127.0.0.1, ::1",
        ),
    ] = None,
    steps: Annotated[
        int | None,
        Opt("--steps", help="Default denoising steps of a request.", show_default=_recipe_default("generate", "steps")),
    ] = None,
    dtype: Annotated[
        str | None,
        Opt("--dtype", help="auto, float32, float16 or bfloat16.", show_default=_recipe_default("model", "dtype")),
    ] = None,
    device: Annotated[
        str | None, Opt("--device", help="auto, cpu or cuda.", show_default=_recipe_default("model", "device"))
    ] = None,
    cache: Annotated[
        float | None,
        Opt(
            "--cache",
            metavar="THRESHOLD",
            help="Cache threshold (0 = off).",
            show_default=_recipe_default("cache", "threshold"),
        ),
    ] = None,
    cache_method: Annotated[
        str | None,
        Opt(
            "--cache-method",
            metavar="METHOD",
            help="fbcache, dbcache, taylorseer or magcache.",
            show_default=_recipe_default("cache", "method"),
        ),
    ] = None,
    ulysses: Annotated[
        int | None,
        Opt(
            "--ulysses",
            help="Ulysses degree of each replica.",
            show_default=_recipe_default("parallel", "ulysses") + ", or chosen for --gpus",
        ),
    ] = None,
    ring: Annotated[
        int | None,
        Opt(
            "--ring",
            help="Ring degree of each replica.",
            show_default=_recipe_default("parallel", "ring") + ", or chosen for --gpus",
        ),
    ] = None,
    tp: Annotated[
        int | None,
        Opt("--tp", help="Tensor-parallel degree of each replica.", show_default=_recipe_default("parallel", "tp")),
    ] = None,
    text_encoder: Annotated[
        str | None,
        Opt(
            "--text-encoder",
            metavar="PLACE",
            help="replicated; rank0: only each replica's first rank holds the text encoders; cpu: as rank0, in host "
            "memory; sharded: split over each replica's ranks by transformers' TP plan.",
            show_default=_recipe_default("memory", "text_encoder"),
        ),
    ] = None,
    vae_placement: Annotated[
        str | None,
        Opt(
            "--vae-placement",
            metavar="PLACE",
            help="replicated; rank0: only each replica's first rank decodes; the others keep the VAE in host memory.",
            show_default=_recipe_default("memory", "vae"),
        ),
    ] = None,
    gpu_memory: Annotated[
        float | None,
        Opt(
            "--gpu-memory",
            help="GiB per GPU: a flagship checkpoint's layout of each replica is planned (with --gpus alone) or "
            "checked against it before loading.",
            show_default="the visible GPU's",
        ),
    ] = None,
    cfg_parallel: Annotated[
        bool,
        Opt(
            "--cfg-parallel",
            help="Run CFG halves on separate ranks of each replica.",
            metavar="",
            show_default="recipe, else off",
        ),
    ] = False,
    parallel_vae: Annotated[
        bool, Opt("--parallel-vae", help="Split the VAE decode over each replica's ranks.", **_flag("vae", "parallel"))
    ] = False,
    vae_tiling: Annotated[
        bool,
        Opt(
            "--vae-tiling",
            help="Decode in tiles (the VAE's own tiling) to bound the decode's memory.",
            **_flag("vae", "tiling"),
        ),
    ] = False,
    quant: Annotated[
        str | None,
        Opt(
            "--quant",
            help="none, int8wo, int8dq, fp8dq, fp8wo or int4wo.",
            show_default=_recipe_default("quant", "type"),
        ),
    ] = None,
    compile_: Annotated[
        bool,
        Opt(
            "--compile",
            help="torch.compile the transformer blocks (compiled during the warm-up).",
            **_flag("compile", "enabled"),
        ),
    ] = False,
    oversubscribe: Annotated[bool, Opt("--oversubscribe", help=OVERSUBSCRIBE_HELP, **FLAG)] = False,
) -> None:
    """Keep the accelerated pipeline warm on N processes behind an OpenAI-style HTTP API (images, videos, metrics)."""
    from accel import preflight
    from accel.launch import rank, world_size
    from accel.parallel.mesh import under_distributed_launcher

    lead = rank() == 0
    try:
        if replicas < 1:
            raise UserError(f"--replicas must be >= 1, got {replicas}")
        if gpus is not None and (gpus < 1 or gpus % replicas):
            raise UserError(
                f"--gpus {gpus}: it must be a multiple of --replicas ({replicas}), each replica gets --gpus / "
                "--replicas"
            )
        if max_queue < 0:
            raise UserError(f"--max-queue must be >= 0, got {max_queue}")
        if drain < 0:
            raise UserError(f"--drain must be >= 0 seconds, got {drain:g}")
        if request_timeout is not None and not 0 < request_timeout < float("inf"):
            raise UserError(f"--request-timeout must be a number of seconds > 0, got {request_timeout:g}")
        if not 0 < port < 65536:
            raise UserError(f"--port must be between 1 and 65535, got {port}")
        for option, value in (
            ("--max-prompt", max_prompt),
            ("--max-prompt-tokens", max_prompt_tokens),
            ("--max-body", max_body),
            ("--max-work", max_work),
        ):
            if value < 1:
                raise UserError(f"{option} must be >= 1, got {value}")
        from accel.recipe import PROMPT_CHARS_ENV, prompt_chars

        if max_prompt > (every_run := prompt_chars()):  # each request becomes a recipe, which holds to that limit
            raise UserError(
                f"--max-prompt {max_prompt} is above the {every_run:,} characters every accel run takes; "
                f"set {PROMPT_CHARS_ENV} to raise both"
            )
        keys = _api_keys(api_keys)
        overrides: dict[str, dict[str, Any]] = {
            "model": {"name": model, "dtype": dtype, "device": device},
            "generate": {"steps": steps},
            "cache": {"threshold": cache, "method": cache_method},
            "parallel": {
                "gpus": gpus // replicas if gpus is not None else None,
                "ulysses": ulysses,
                "ring": ring,
                "tp": tp,
                "cfg": 2 if cfg_parallel else None,
            },
            "vae": {"parallel": True if parallel_vae else None, "tiling": True if vae_tiling else None},
            "quant": {"type": quant},
            "compile": {"enabled": True if compile_ else None},
            "memory": {"text_encoder": text_encoder, "vae": vae_placement},
        }
        settings = _recipe(recipe, overrides)
        from accel.memory.fit import planned_here
        from accel.recipe import memory_refusal

        if (refusal := memory_refusal(settings, replicas)) is not None:
            raise UserError(refusal)
        world = settings.world_size * replicas
        if world > 1 and not under_distributed_launcher():
            import dataclasses

            from accel.launch import LaunchSpec

            spec = dataclasses.replace(LaunchSpec.for_world(world, timeout_s=settings.parallel.timeout), drain_s=drain)
            preflight.check_process_count(world, settings.model.device, oversubscribe)
            planned = planned_here(settings, gpu_memory)  # each replica's layout; seconds, so after the checks
            raise typer.Exit(_relaunch(ctx, planned.recipe, spec, planned.flags))
        planned = planned_here(settings, gpu_memory)
        settings = planned.recipe
        if under_distributed_launcher() and world_size() != world:
            if world == 1 and replicas == 1:
                settings = _fit_to_job(settings)
            else:
                raise UserError(
                    f"{replicas} replica(s) of {settings.world_size} process(es) need {world}, but this torchrun job "
                    "has "
                    f"{world_size()}; make them match"
                )
        from accel.serve.server import ServeOptions
        from accel.serve.server import serve as run_server

        announce = (
            (lambda line: console.print(line, markup=False, highlight=False, soft_wrap=True))
            if lead
            else (lambda _line: None)
        )
        limits = Limits(max_prompt, max_body, max_work, max_prompt_tokens, request_timeout)
        run_server(
            settings,
            ServeOptions(
                host, port, replicas, max_queue, drain, planned.peak, limits, keys, tuple(trusted_hosts or ())
            ),
            announce,
        )
    except UserError as error:
        _fail(str(error))
        return


def _api_keys(given: list[str] | None) -> tuple[str, ...]:
    """--api-key's keys, else ACCEL_API_KEY's comma-separated ones (a key on the command line is
    visible to every user of the machine in `ps`; the variable is not)."""
    keys = list(given) if given else os.environ.get("ACCEL_API_KEY", "").split(",")
    keys = [key.strip() for key in keys if key.strip()]
    if any(not key.isprintable() or " " in key for key in keys):
        raise UserError("--api-key / ACCEL_API_KEY: a key is printable characters without spaces")
    return tuple(keys)


# Everything after SCRIPT is the script's, -h and --help included (torchrun's convention).
@app.command(
    cls=_Command,
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "allow_interspersed_args": False},
)
def launch(
    ctx: typer.Context,
    script: Annotated[
        Path, typer.Argument(help="Your Python script (e.g. one that calls accel.apply); its own arguments follow it.")
    ],
    gpus: Annotated[int, Opt("--gpus", help="Processes (GPUs; gloo ranks on a CPU-only machine).")] = 2,
    nnodes: Annotated[int, Opt("--nnodes", help="Nodes of a multi-node job (each runs the same command).")] = 1,
    node_rank: Annotated[int, Opt("--node-rank", help="This node's index in a multi-node job.")] = 0,
    master_addr: Annotated[
        str | None, Opt("--master-addr", help="Address of node 0 (multi-node).", show_default="127.0.0.1 on one node")
    ] = None,
    master_port: Annotated[
        int | None, Opt("--master-port", help="Port on node 0 (multi-node).", show_default=MASTER_PORT_DEFAULT)
    ] = None,
    oversubscribe: Annotated[bool, Opt("--oversubscribe", help=OVERSUBSCRIBE_HELP, **FLAG)] = False,
    timeout: Annotated[
        float,
        Opt(
            "--timeout",
            help="Seconds a rank may keep the others waiting in a collective before the job ends, naming it.",
        ),
    ] = 600.0,
) -> None:
    """Run your own script on N processes (torchrun's environment); a failing or stuck rank is named, ending the job."""
    from accel import preflight
    from accel.launch import LaunchSpec
    from accel.launch import launch as launch_job

    try:
        if gpus < 1:
            raise UserError(f"--gpus must be >= 1, got {gpus}")
        if not script.is_file():
            raise UserError(f"{script}: no such script")
        if timeout <= 0:
            raise UserError(f"--timeout must be > 0 seconds, got {timeout:g}")
        spec = LaunchSpec.for_world(gpus, nnodes, node_rank, master_addr, master_port, timeout)
        preflight.check_process_count(spec.nproc, "auto", oversubscribe, spec.nnodes)  # the script picks its device
        preflight.check_master_port(master_addr, master_port, node_rank)
    except UserError as error:
        _fail(str(error))
        return
    raise typer.Exit(launch_job(spec, "accel.launch", [str(script), *ctx.args]))


@app.command(cls=_Command)
def plan(
    model: Annotated[
        str,
        typer.Argument(
            help="Family whose flagship checkpoint to plan (chronoedit, cogvideox, cosmos3, flux, flux2, helios, "
            "hunyuan, hunyuan15, hunyuanimage, kandinsky5, kandinsky6, ltx, ltx2, mochi, qwenimage, qwenimage21, sd3, "
            "skyreels2, wan, zimage).",
            show_default=False,
        ),
    ],
    gpus: Annotated[int, Opt("--gpus", help="GPUs to lay the model over.")] = 1,
    gpu_memory: Annotated[
        float | None, Opt("--gpu-memory", help="GiB per GPU.", show_default="the visible GPU's, else 80")
    ] = None,
    width: Annotated[
        int | None, Opt("--width", help="Output width in pixels.", show_default="the checkpoint's")
    ] = None,
    height: Annotated[
        int | None, Opt("--height", help="Output height in pixels.", show_default="the checkpoint's")
    ] = None,
    frames: Annotated[
        int | None, Opt("--frames", help="Frames (video families).", show_default="the checkpoint's")
    ] = None,
    recipe: Annotated[
        Path | None,
        Opt(
            "--recipe",
            "-r",
            help=escape(
                "Recipe TOML whose [quant], [vae] tiling and [generate] size the plan measures; flags override its "
                "values."
            ),
            show_default="none",
        ),
    ] = None,
    quant: Annotated[
        str | None,
        Opt(
            "--quant",
            help="none, int8wo, int8dq, fp8dq, fp8wo or int4wo: the blocks' weights counted as torchao stores them.",
            show_default=_recipe_default("quant", "type"),
        ),
    ] = None,
    json_out: Annotated[bool, Opt("--json", help="Print JSON instead of a table.", **FLAG)] = False,
) -> None:
    """Which layouts fit your GPUs, measured on fake CUDA before any weight is read, and the fastest that does."""
    import json

    from accel.memory import report as plan_report
    from accel.memory.fit import visible_gpu_gib
    from accel.memory.plan import flagship_of, make_plan
    from accel.models.flagships import Size

    try:
        _, flagship = flagship_of(model)
        settings = _recipe(
            recipe, {"quant": {"type": quant}, "generate": {"width": width, "height": height, "frames": frames}}
        )
        if gpu_memory is None:
            gpu_memory = visible_gpu_gib("auto") or 80.0
        base, generate = flagship.size, settings.generate
        size = Size(
            generate.width or base.width,
            generate.height or base.height,
            (generate.frames or base.frames) if base.frames else None,
        )
        result = make_plan(model, gpus, gpu_memory, size, settings.quant, settings.vae.tiling)
    except UserError as error:
        _fail(str(error))
        return
    if json_out:
        print(json.dumps(plan_report.as_json(result), indent=2))
        return
    console.print(plan_report.table(result))
    console.print(plan_report.headline(result), highlight=False)


@app.command(cls=_Command)
def models() -> None:
    """List the model families accel knows and what it can do for each."""
    from accel import report
    from accel.models.registry import FAMILIES

    console.print(report.models_table(list(FAMILIES.values())))


@app.command(cls=_Command)
def inspect(
    model: Annotated[
        str,
        typer.Argument(
            help="Registry alias (flux, tiny-flux, …), hub repo id or local pipeline folder.", show_default=False
        ),
    ],
    json_out: Annotated[bool, Opt("--json", help="Print JSON instead of tables.", **FLAG)] = False,
    verify: Annotated[
        bool,
        Opt(
            "--verify",
            help="Load the pipeline and verify the automatic context-parallel plan on simulated ranks in this process "
            "(no GPU per rank needed); the verdict is kept and shown.",
            **FLAG,
        ),
    ] = False,
    ulysses: Annotated[int, Opt("--ulysses", help="--verify: the Ulysses degree simulated.", min=1)] = 2,
    ring: Annotated[int, Opt("--ring", help="--verify: the Ring degree simulated.", min=1)] = 1,
    dtype: Annotated[
        str | None,
        Opt("--dtype", help="--verify: load dtype (auto, float32, float16, bfloat16).", show_default="the model's"),
    ] = None,
    device: Annotated[
        str | None, Opt("--device", help="--verify: where to load and run (auto, cpu, cuda).", show_default="auto")
    ] = None,
) -> None:
    """What accel finds in a model: pipeline, transformers, blocks, streams, CP plan and the accelerators that apply."""
    import json

    from accel.inspect_view import inspect_view
    from accel.models.inspect import as_json, inspect_model

    try:
        if verify:
            from accel.parallel.verify import verify_pipeline

            verify_pipeline(model, ulysses, ring, dtype, device)
        found = as_json(inspect_model(model))
    except UserError as error:
        _fail(str(error))
        return
    if json_out:
        print(json.dumps(found, indent=2))
    else:
        console.print(inspect_view(found))


@app.command(cls=_Command)
def env(json_out: Annotated[bool, Opt("--json", help="Print JSON instead of a table.", **FLAG)] = False) -> None:
    """Versions, devices and attention kernels available here."""
    from accel import report

    info = report.environment()
    if json_out:
        import json

        print(json.dumps(info, indent=2))
    else:
        console.print(report.environment_table(info))


def main(argv: list[str] | None = None) -> None:
    from accel import interrupts, watchdog
    from accel.launch import exit_code, is_peer_loss, world_size
    from accel.rank_exit import end_process

    argv = sys.argv[1:] if argv is None else argv
    on_rank = watchdog.start()  # a rank of a job `accel` launched: heartbeat, and exit if the launcher dies
    if not on_rank:  # a rank is stopped by its launcher, at once; a lone process unwinds and cleans up
        interrupts.install()
    code = 0
    try:
        app(args=argv, obj={"argv": argv})
    except SystemExit as exit:
        code = exit_code(exit)
    except interrupts.Interrupted as interruption:
        errors.print("interrupted")
        code = 128 + interruption.signum
    except Exception as error:  # noqa: BLE001 - only in a multi-rank job: the failing rank must be named
        if world_size() == 1:
            raise
        try:
            _fail(f"{type(error).__name__}: {error}", exit_code=1, lost=is_peer_loss(error))
        except typer.Exit as exit:
            code = exit.exit_code
    end_process(code, on_rank)


if __name__ == "__main__":
    main()
