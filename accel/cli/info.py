"""The commands that look rather than generate: `accel plan`, `models`, `inspect` and `env`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from rich.markup import escape
import typer

from accel.cli.app import console, fail
from accel.cli.options import FLAG, Opt, Overrides, RecipeOptions, build_recipe, with_recipe_options
from accel.errors import UserError


@with_recipe_options(
    RecipeOptions(
        ("generate.width", "generate.height", "generate.frames"),
        before="recipe",
        shown=dict.fromkeys(("generate.width", "generate.height", "generate.frames"), "the checkpoint's"),
    ),
    RecipeOptions(
        ("quant.type",),
        before="json_out",
        help={
            "quant.type": "none, int8wo, int8dq, fp8dq, fp8wo or int4wo: the blocks' weights counted as torchao "
            "stores them."
        },
    ),
)
def plan(
    overrides: Overrides,
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
        settings = build_recipe(recipe, overrides)
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
        fail(str(error))
        return
    if json_out:
        print(json.dumps(plan_report.as_json(result), indent=2))
        return
    console.print(plan_report.table(result))
    console.print(plan_report.headline(result), highlight=False)


def models() -> None:
    """List the model families accel knows and what it can do for each."""
    from accel import report
    from accel.models.registry import FAMILIES

    console.print(report.models_table(list(FAMILIES.values())))


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
    from accel.models.inspect import inspect_model
    from accel.models.inspect_json import as_json

    try:
        if verify:
            from accel.parallel.verify_ahead import verify_pipeline

            verify_pipeline(model, ulysses, ring, dtype, device)
        found = as_json(inspect_model(model))
    except UserError as error:
        fail(str(error))
        return
    if json_out:
        print(json.dumps(found, indent=2))
    else:
        console.print(inspect_view(found))


def env(json_out: Annotated[bool, Opt("--json", help="Print JSON instead of a table.", **FLAG)] = False) -> None:
    """Versions, devices and attention kernels available here."""
    from accel import report

    info = report.environment()
    if json_out:
        import json

        print(json.dumps(info, indent=2))
    else:
        console.print(report.environment_table(info))
