"""The first minutes with `accel`: help texts, -h, --version, unknown-option hints, a torch-free
`accel models`. No model is loaded here."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import commands
import typer
from typer.testing import CliRunner

from accel.cli import app

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ["run", "bench", "tune", "serve", "batch", "launch", "plan", "models", "inspect", "env"]


def _help(*args: str) -> str:
    result = runner.invoke(app, [*args], env={"COLUMNS": "400"}, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout


def _command(name: str) -> typer.core.TyperCommand:
    group = typer.main.get_command(app)
    return group.commands[name]  # type: ignore[attr-defined]


def test_every_command_is_listed_and_checked_here() -> None:
    assert set(typer.main.get_command(app).commands) == set(COMMANDS)  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_has_help_and_shows_its_default(name: str) -> None:
    command = _command(name)
    text = _help(name, "--help")
    shown = 0
    for param in command.params:
        assert param.help, f"accel {name}: {param.name} has no help text"
        # whole, on one line of a wide terminal, with its [section] names (rich takes them for tags unless escaped)
        assert param.help.replace("\\[", "[") in text, f"accel {name}: {param.name}'s help is not shown as written"
        if param.param_type_name == "argument" and param.required:
            continue
        assert isinstance(param.show_default, str) or (param.default is not None and not param.is_flag), (
            f"accel {name}: {param.name} shows no default"
        )
        shown += 1
    assert text.count("[default:") == shown
    assert "<bool>" not in text


def test_square_brackets_in_help_survive_rich_markup() -> None:
    text = _help("bench", "--help")
    assert "Run a recipe's [bench] variants side by side" in text
    assert "TOML recipe with [bench] variants" in text
    assert "Run a recipe's [bench] variants side by side" in _help("--help")


def test_plan_help_names_every_flagship() -> None:
    from accel.models.flagships import FLAGSHIPS

    listed = re.search(r"flagship checkpoint to plan \(([^)]*)\)", _help("plan", "--help"))
    assert listed is not None and listed.group(1).split(", ") == sorted(FLAGSHIPS)


@pytest.mark.parametrize("args", [[], *([name] for name in COMMANDS)])
def test_dash_h_is_help(args: list[str]) -> None:
    assert _help(*args, "-h") == _help(*args, "--help")


def test_launch_leaves_everything_after_the_script_to_it(tmp_path: Path) -> None:
    script = tmp_path / "echo.py"
    script.write_text("import sys\nprint('args', sys.argv[1:])\n")
    result = commands.run(
        [sys.executable, "-m", "accel.cli", "launch", "--gpus", "1", str(script), "-h", "--gpus", "3"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "args ['-h', '--gpus', '3']"


def test_version_prints_the_installed_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout == f"accel {importlib.metadata.version('accel')}\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["run", "tiny-flux", "--model", "flux"],
            "No such option: --model; the model is the first argument: accel run MODEL",
        ),
        (
            ["bench", "--recipe", "x.toml"],
            "No such option: --recipe; the recipe is the first argument: accel bench RECIPE",
        ),
        (["run", "--gpu", "2"], "No such option: --gpu; did you mean --gpus or --gpu-memory?"),
        (["run", "--threshold", "0.2"], "No such option: --threshold; did you mean --cache?"),
        (["run", "--guidance-scale", "3"], "No such option: --guidance-scale; did you mean --guidance?"),
        (["run", "--cfg"], "No such option: --cfg; did you mean --cfg-parallel?"),
        (["run", "--prompts", "x"], "No such option: --prompts; did you mean --prompt?"),
        (["bench", "--repeat", "2", "r.toml"], "No such option: --repeat; did you mean --repeats?"),
        (["run", "--zzz"], "No such option: --zzz"),
    ],
)
def test_unknown_option_suggests_real_neighbours(args: list[str], message: str) -> None:
    result = runner.invoke(app, args, env={"COLUMNS": "400"})
    assert result.exit_code == 2
    assert f"│ {message} " in result.output, result.output  # the whole message, nothing after it


def test_models_help_and_refusals_do_not_import_torch() -> None:
    """`accel models`, `--help` and the refusal of a bad flag or model name answer from the registry's
    data and the recipe: torch (seconds) never loads."""
    probe = (
        "import sys\n"
        "from accel.cli import main\n"
        "for args in (['models'], ['run', '--help'], ['bench', '--help'], ['run', 'tiny-flux', '--cache', '-2'], "
        "['run', 'tiny-flx'],\n"
        "             ['run', 'tiny-flux', '-o', 'x.mp4'], ['inspect', 'tiny-fluxx']):\n"
        "    try:\n"
        "        main(args)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(sorted(m for m in ('torch', 'diffusers', 'transformers', 'accel.runner') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="200"),
    )
    assert "tiny-flux" in result.stdout
    assert "error: unknown model 'tiny-flx' (did you mean 'tiny-flux'?)" in result.stderr
    assert "error: --out x.mp4: FLUX.1 makes images, so the name must end in .png" in result.stderr
    assert "error: unknown model 'tiny-fluxx' (did you mean 'tiny-flux'?)" in result.stderr
    assert result.stdout.splitlines()[-1] == "[]"


def test_importing_the_cli_leaves_the_recipe_for_the_command_line() -> None:
    """The options built from the recipe's keys are built when a command line is parsed, not when
    accel.cli is imported (what the console script's start-up pays before it knows the command)."""
    probe = "import sys, accel.cli\nprint(sorted(m for m in ('accel.recipe', 'torch') if m in sys.modules))\n"
    result = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]"


NOISE = (
    "import enum, sys, warnings\n"
    "if sys.argv[1] == 'quiet':\n"
    "    from accel.noise import quiet_known_warnings\n"
    "    quiet_known_warnings()\n"
    "import torch.utils._pytree as pytree\n"
    "class Mode(str, enum.Enum):  # as torchao registers its own\n"
    "    A = 'a'\n"
    "pytree.register_constant(Mode)\n"
    "warnings.warn_explicit('In CPU autocast, but the target dtype is not supported. Disabling autocast.', "
    "UserWarning,\n"
    "                       'transformer_mochi.py', 286, module='diffusers.models.transformers.transformer_mochi')\n"
    "warnings.warn_explicit('In CPU autocast, but the target dtype is not supported.', UserWarning, 'mine.py', 1, "
    "module='mine')\n"
)


def test_known_library_noise_is_quiet_in_accel_commands_only() -> None:
    """Torch's pytree deprecation notice and Mochi's autocast warning are silenced where the CLI asks,
    and nothing else: the same warning from another module still shows."""

    def stderr(mode: str) -> str:
        result = subprocess.run(
            [sys.executable, "-c", NOISE, mode],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )
        assert result.returncode == 0, result.stderr
        return result.stderr

    loud, quiet = stderr("loud"), stderr("quiet")
    assert "is an Enum subclass" in loud and "transformer_mochi.py:286" in loud
    assert "is an Enum subclass" not in quiet and "transformer_mochi.py" not in quiet
    assert "mine.py:1: UserWarning: In CPU autocast" in quiet


def test_piped_run_says_loading_and_prints_a_line_a_block_of_steps(tmp_path: Path) -> None:
    """Output to a pipe (CliRunner is one) gets plain lines: the load with its time, then a line per
    quarter of the steps (8 steps: every 2nd), never a bar's redraws."""
    result = runner.invoke(
        app,
        ["run", "tiny-flux", "--steps", "8", "--warmup", "0", "-o", str(tmp_path / "x.png")],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == "loading tiny-flux…"
    assert re.fullmatch(r"loaded tiny-flux in \d+\.\d s", lines[1])
    assert [re.sub(r", \d+\.\d s$", "", line) for line in lines[2:6]] == [
        f"generating: step {n}/8" for n in (2, 4, 6, 8)
    ]
    assert "accel run tiny-flux" in lines[6]
