"""The README is part of the product: its quick start, recipe reference and CLI table stay true."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import click
import typer.main

from accel.cli import app
from accel.recipe.sections import SECTIONS

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_quick_start_is_two_make_commands_and_ci_runs_the_test_one() -> None:
    quick = README.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in quick.strip().splitlines()]
    assert commands == ["make demo", "make test"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert [line for line in ci.splitlines() if line and not line.startswith(("#", "set ", "cd "))] == ["make test"]


def test_every_recipe_key_is_documented_under_its_section() -> None:
    for name, cls in SECTIONS.items():
        section = README.split(f"**`[{name}]`**", 1)[1].split("**`[", 1)[0]
        for field in dataclasses.fields(cls):
            assert re.search(rf"^\| `{field.name}` \|", section, re.M), f"[{name}] {field.name} is not in the README"


def test_every_run_and_bench_option_is_documented() -> None:
    for name, marker in (("run", "| `accel run` option |"), ("bench", "| `accel bench` option |")):
        table = README.split(marker, 1)[1].split("\n\n", 1)[0]
        command = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
        for param in command.params:
            if isinstance(param, click.Option):
                assert any(f"`{opt}" in table for opt in param.opts), f"accel {name} {param.opts} is not in the README"


def test_supported_models_table_lists_every_family() -> None:
    from accel.models.registry import FAMILIES

    for family in FAMILIES.values():
        assert f"| `{family.name}` |" in README
        if family.tiny_alias:
            assert f"`{family.tiny_alias}`" in README
