"""Options shared by the commands: those that set a recipe key are built from the key's metadata in
accel/recipe/sections.py (type, default, help, `Flag`), so `run`, `serve`, `bench` and `plan` spell them alike,
and one place turns the given ones into recipe overrides. CLI-only options stay in each command."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer

from accel.cli.app import fail
from accel.launch.environment import DEFAULT_PORT

if TYPE_CHECKING:
    from accel.recipe.keys import Flag

Opt = typer.Option
_OVERSUBSCRIBE_HELP = "Allow more processes than CPU cores on a machine without GPUs (slow; for testing)."
# A flag takes no value: no `<bool>` placeholder, and off unless given.
FLAG: dict[str, Any] = {"metavar": "", "show_default": "off"}
_MASTER_PORT_DEFAULT = f"a free port on one node, else {DEFAULT_PORT}"

# CLI-only options several commands take alike (the parameter's default is each command's `= ...`).
Oversubscribe = Annotated[bool, Opt("--oversubscribe", help=_OVERSUBSCRIBE_HELP, **FLAG)]
Nodes = Annotated[int, Opt("--nnodes", help="Nodes of a multi-node job (each runs the same command).")]
NodeRank = Annotated[int, Opt("--node-rank", help="This node's index in a multi-node job.")]
MasterAddr = Annotated[
    str | None, Opt("--master-addr", help="Address of node 0 (multi-node).", show_default="127.0.0.1 on one node")
]
MasterPort = Annotated[
    int | None, Opt("--master-port", help="Port on node 0 (multi-node).", show_default=_MASTER_PORT_DEFAULT)
]

# MODEL of the commands that keep a pipeline loaded for many generations (serve, batch).
ModelArgument = Annotated[
    str | None,
    typer.Argument(
        help="Registry alias (flux, tiny-flux, …), hub repo id or local folder; or give --recipe.",
        show_default="the recipe's [model] name",
    ),
]

# The LoRAs requests choose by name (accel/serve/loras.py), in the commands that keep a pipeline loaded.
LoraNames = Annotated[
    list[str] | None,
    Opt(
        "--lora",
        metavar="NAME=PATH",
        help="A LoRA .safetensors file requests may choose by name (their lora field, with a scale); repeatable.",
        show_default="none",
    ),
]
LoraDir = Annotated[
    Path | None,
    Opt(
        "--lora-dir",
        metavar="DIR",
        help="Register each .safetensors file in DIR as a LoRA named by its stem.",
        show_default="none",
    ),
]
MaxLoras = Annotated[
    int, Opt("--max-loras", help="LoRA adapters kept loaded at once; past it the least recently used is dropped.")
]
MaxBatch = Annotated[
    int,
    Opt(
        "--max-batch",
        help="Outputs one pipeline call may make for waiting requests that differ only in prompt and seed "
        "(same size, frames, steps, guidance, negative prompt, LoRAs); 1 runs each alone. Not with the cache.",
    ),
]

Overrides = dict[str, dict[str, Any]]


def _recipe_default(section: str, key: str) -> str:
    """What `--help` shows for a flag that overrides a recipe key: the recipe's value, else the
    key's default there (unset there: the model family's own default)."""
    from accel.recipe.sections import SECTIONS

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


@dataclass(frozen=True)
class RecipeOption:
    """One recipe key as a command-line option: what its metadata says, read once."""

    section: str
    key: str
    hint: Any  # the key's type, None removed
    help: str
    flag: Flag

    @classmethod
    def of(cls, path: str) -> RecipeOption:
        from accel.recipe.keys import Flag
        from accel.recipe.sections import SECTIONS

        section, key = path.split(".")
        found = {f.name: f for f in dataclasses.fields(SECTIONS[section])}[key]
        hint = typing.get_type_hints(SECTIONS[section])[key]
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
        flag = found.metadata.get("flag") or Flag()
        if hint is bool and flag.switch is None:
            flag = dataclasses.replace(flag, switch=True)
        return cls(section, key, hint, flag.help or found.metadata["help"], flag)

    @property
    def name(self) -> str:
        return self.flag.name or "--" + self.key.replace("_", "-")

    @property
    def parameter_name(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    @property
    def is_table(self) -> bool:
        return typing.get_origin(self.hint) is Mapping

    @property
    def value_type(self) -> Any:
        """The type the option parses: a Literal's members' (the recipe names the choices when it
        refuses one), a list for repeatable keys, a bool for a switch."""
        if self.flag.switch is not None:
            return bool
        if self.is_table or typing.get_origin(self.hint) is tuple:
            return list[str]
        if typing.get_origin(self.hint) is Literal:
            return type(typing.get_args(self.hint)[0])
        return self.hint

    def shown_default(self) -> str:
        if self.flag.shown:
            return self.flag.shown.format(recipe=_recipe_default(self.section, self.key))
        if self.value_type == list[str]:
            return "none"
        return _recipe_default(self.section, self.key)

    def parameter(self, help: str | None, shown: str | None) -> inspect.Parameter:
        names = (self.name, self.flag.alias) if self.flag.alias else (self.name,)
        switch = self.flag.switch is not None
        metavar = "" if switch else (self.flag.metavar or None)
        option = Opt(*names, help=help or self.help, metavar=metavar, show_default=shown or self.shown_default())
        annotation = Annotated[bool if switch else self.value_type | None, option]  # type: ignore[operator]
        return inspect.Parameter(
            self.parameter_name,
            inspect.Parameter.KEYWORD_ONLY,
            default=False if switch else None,
            annotation=annotation,
        )

    def override(self, given: Any) -> Any:
        """The key's value from the option's, None where the option was not given."""
        if given is None or given is False or given == []:
            return None
        if self.flag.switch is not None:
            return self.flag.switch
        if self.is_table:
            return pairs(self.name, given, self.flag.example, parse=self.flag.parse)
        return given


@dataclass(frozen=True)
class RecipeOptions:
    """Recipe keys ("section.key") a command takes as options, shown just before its parameter
    `before` (None: after all of them); `help` and `shown` reword a key's line for this command."""

    keys: tuple[str, ...]
    before: str | None = None
    help: Mapping[str, str] = field(default_factory=dict)
    shown: Mapping[str, str] = field(default_factory=dict)


def with_recipe_options(*groups: RecipeOptions) -> Callable[[Callable[..., Any]], WithRecipeOptions]:
    """Adds the groups' options to a command's signature (Typer reads `inspect.signature`); the
    command gets what they set as one `overrides` argument ({section: {key: value}}, given ones only)."""
    return lambda command: WithRecipeOptions(command, groups)


class WithRecipeOptions:
    """A command with recipe options. Its signature is built when Typer first asks for it, so that
    `import accel.cli` leaves accel.recipe to the command line that needs it (as hand-written
    annotations did, which Typer evaluated then)."""

    def __init__(self, command: Callable[..., Any], groups: tuple[RecipeOptions, ...]) -> None:
        self.command = command
        self.groups = groups
        self.__name__ = command.__name__
        self.__qualname__ = command.__qualname__
        self.__module__ = command.__module__
        self.__doc__ = command.__doc__
        self.__annotations__: dict[str, Any] = {}  # Typer reads each option from the signature's Annotated

    @functools.cached_property
    def options(self) -> dict[str, RecipeOption]:
        """By parameter name, in the recipe's section order (as before the options were generated: it
        decides which of two malformed tables is refused)."""
        from accel.recipe.sections import SECTIONS

        found = [RecipeOption.of(key) for group in self.groups for key in group.keys]
        found.sort(key=lambda option: list(SECTIONS).index(option.section))
        return {option.parameter_name: option for option in found}

    @functools.cached_property
    def __signature__(self) -> inspect.Signature:
        signature = inspect.signature(self.command, eval_str=True)
        by_key = {f"{option.section}.{option.key}": option for option in self.options.values()}
        generated: dict[str | None, list[inspect.Parameter]] = {}
        for group in self.groups:
            generated.setdefault(group.before, []).extend(
                by_key[key].parameter(group.help.get(key), group.shown.get(key)) for key in group.keys
            )
        parameters: list[inspect.Parameter] = []
        for parameter in signature.parameters.values():
            if parameter.name == "overrides":
                continue
            parameters += generated.pop(parameter.name, [])
            parameters.append(parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY))
        parameters += generated.pop(None, [])
        assert not generated, f"{self.__name__} has no parameter {sorted(map(str, generated))}"
        return signature.replace(parameters=parameters)

    def __call__(self, **given: Any) -> Any:
        overrides: Overrides = {}
        for name, option in self.options.items():
            value = option.override(given.pop(name))
            if value is not None:
                overrides.setdefault(option.section, {})[option.key] = value
        return self.command(**given, overrides=overrides)


def pairs(flag: str, given: list[str] | None, example: str, parse: bool) -> dict[str, Any] | None:
    """`KEYWORD=VALUE` flags as a table; with `parse`, a value TOML reads (17, true, [1, 2], "x") is
    that value, anything else the string itself (mode=replace). Malformed is one line, exit 2."""
    import tomllib

    if not given:
        return None
    table: dict[str, Any] = {}
    for item in given:
        keyword, equals, value = item.partition("=")
        if not equals or not keyword.strip().isidentifier():
            fail(f"{flag} {item}: write KEYWORD=VALUE, e.g. {flag} {example}")
        if parse:
            try:
                value = tomllib.loads(f"value = {value}")["value"]
            except (tomllib.TOMLDecodeError, ValueError, RecursionError):  # ValueError: an integer of 4300+ digits
                pass
        table[keyword.strip()] = value
    return table


def build_recipe(recipe_path: Path | None, *overrides: Mapping[str, Mapping[str, Any]]) -> Any:
    """The recipe file (or defaults) with the flags given on top (a None value: not given)."""
    from accel.recipe import Recipe, load_recipe

    base = load_recipe(recipe_path) if recipe_path is not None else Recipe.from_dict({})
    given: Overrides = {}
    for layer in overrides:
        for section, keys in layer.items():
            given.setdefault(section, {}).update({k: v for k, v in keys.items() if v is not None})
    return base.with_overrides({section: keys for section, keys in given.items() if keys}, source="command line")
