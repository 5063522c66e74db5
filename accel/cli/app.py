"""The `accel` Typer app: its command class (help without placeholders, unknown options named with
their real neighbours), the one-line failure every command ends with, and `main`, the console script."""

from __future__ import annotations

import difflib
import sys
from typing import Annotated, Any

import typer
from rich.console import Console
from typer.core import TyperCommand, TyperGroup

try:  # typer >= 0.26 carries its own click
    from typer._click.exceptions import NoSuchOption
except ImportError:
    from click.exceptions import NoSuchOption


class _Quiet:
    """Help without a `<bool>` placeholder on -h/--help (typer shows one for every flag)."""

    def get_help_option(self, ctx: typer.Context) -> Any:
        option = super().get_help_option(ctx)  # type: ignore[misc]
        if option is not None:
            option.metavar = ""
        return option


class _Group(_Quiet, TyperGroup):
    pass


class Command(_Quiet, TyperCommand):
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


def fail(message: str, exit_code: int = 2, lost: bool = False) -> None:
    """One line on stderr and a non-zero exit; a rank of a job `accel` launched hands the line to
    the launcher instead, which prints it once for all ranks (`lost`: it only follows another
    rank's failure)."""
    from accel.launch.environment import rank, world_size
    from accel.launch.reports import report_failure

    if not report_failure(message, exit_code, lost=lost):
        where = f"rank {rank()}: " if world_size() > 1 else ""
        errors.print("[bold red]error:[/]", end=" ")
        errors.print(where + message, markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(exit_code)


def main(argv: list[str] | None = None) -> None:
    from accel import interrupts, watchdog
    from accel.launch.environment import world_size
    from accel.launch.reports import exit_code, is_peer_loss
    from accel.rank_exit import Verdict, end_process

    argv = sys.argv[1:] if argv is None else argv
    on_rank = watchdog.start()  # a rank of a job `accel` launched: heartbeat, and exit if the launcher dies
    if not on_rank:  # a rank is stopped by its launcher, at once; a lone process unwinds and cleans up
        interrupts.install()
    code = 0
    verdict = False
    try:
        app(args=argv, obj={"argv": argv})
    except Verdict as exit:
        code, verdict = exit_code(exit), True
    except SystemExit as exit:
        code = exit_code(exit)
    except interrupts.Interrupted as interruption:
        errors.print("interrupted")
        code = 128 + interruption.signum
    except Exception as error:  # noqa: BLE001 - only in a multi-rank job: the failing rank must be named
        if world_size() == 1:
            raise
        try:
            fail(f"{type(error).__name__}: {error}", exit_code=1, lost=is_peer_loss(error))
        except typer.Exit as exit:
            code = exit.exit_code
    end_process(code, on_rank, verdict)
