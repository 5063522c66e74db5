"""`accel inspect MODEL`: what accel finds, as tables and as JSON, and its three refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from accel.cli import app
from accel.parallel.plan_format import AutomaticPlan, FromDiffusers, ParallelPlan
from accel.models.registry import FAMILIES, known_names
from accel.models.vaes import vae_plan
from family_parallel import splits_sequence
from variant_cases import has_text_encoders

runner = CliRunner()


def invoke(*args: str) -> Any:
    return runner.invoke(app, list(args), env={"COLUMNS": "200"}, catch_exceptions=False)


@pytest.mark.parametrize("name", ["flux", "wan"])
def test_the_tables_name_the_tiny_pipelines_real_classes_and_blocks(name: str) -> None:
    family = FAMILIES[name]
    pipe = family.tiny()  # type: ignore[misc]
    result = invoke("inspect", f"tiny-{name}")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert f"accel inspect tiny-{name}" in out
    assert type(pipe).__name__ in out and type(pipe.transformer).__name__ in out
    assert f"{family.title} ({name}), tested family" in out
    assert type(pipe.vae).__name__ in out
    for block in family.blocks:
        modules = getattr(pipe.transformer, block.attr)
        row = next(line for line in out.splitlines() if f" {block.attr} " in line)
        cells = [cell.strip() for cell in row.strip("│ ").split("│")]
        assert cells == [
            "transformer",
            block.attr,
            str(len(modules)),
            type(modules[0]).__name__,
            ", ".join(block.returns),
            "family",
        ]
    assert ("diffusers _cp_plan" if isinstance(family.parallel, FromDiffusers) else "accel family plan") in out
    assert "fbcache, dbcache, taylorseer, magcache" in out


@pytest.mark.parametrize("name", ["flux", "wan"])
def test_the_json_counts_are_the_tiny_pipelines_modules(name: str) -> None:
    family = FAMILIES[name]
    transformer = family.tiny().transformer  # type: ignore[misc]
    found = json.loads(invoke("inspect", f"tiny-{name}", "--json").stdout)
    assert [(b["attr"], b["count"], b["class"]) for b in found["transformers"][0]["blocks"]] == [
        (b.attr, len(getattr(transformer, b.attr)), type(getattr(transformer, b.attr)[0]).__name__)
        for b in family.blocks
    ]


def _streams(plan: ParallelPlan | FromDiffusers | AutomaticPlan | None) -> list[str]:
    if plan is None or isinstance(plan, AutomaticPlan):  # learned when applied: no streams before
        return []
    if isinstance(plan, ParallelPlan):
        cut = [s for split in plan.splits for s in split.streams]
    else:
        cut = [stream for _key, stream in plan.streams] + [s for split in plan.extra_splits for s in split.streams]
    return list(dict.fromkeys([*cut, *plan.attention_keys, plan.output_stream]))


@pytest.mark.parametrize("alias", [name for name in known_names() if name.startswith("tiny-")])
def test_the_json_of_every_tiny_alias_is_the_familys_data(alias: str) -> None:
    result = invoke("inspect", alias, "--json")
    assert result.exit_code == 0, result.output
    found = json.loads(result.stdout)  # stdout holds the JSON alone
    family = FAMILIES[alias.removeprefix("tiny-")]
    assert set(found) == {
        "model",
        "source",
        "pipeline",
        "family",
        "refused",
        "generic",
        "transformers",
        "streams",
        "primary_stream",
        "parallel",
        "accelerators",
    }
    assert (found["refused"], found["generic"]) == (None, None)
    assert (found["model"], found["source"], found["refused"]) == (alias, "tiny", None)
    assert found["pipeline"] in family.pipeline_classes
    assert found["family"] == {"name": family.name, "title": family.title, "tested": True}
    [transformer] = found["transformers"]
    assert transformer["attr"] == "transformer" and transformer["class"] in family.transformer_classes
    assert transformer["heads"] == family.tiny_heads
    assert [(b["attr"], tuple(b["returns"])) for b in transformer["blocks"]] == [
        (b.attr, b.returns) for b in family.blocks
    ]
    assert all(isinstance(b["count"], int) and b["count"] > 0 and b["class"] for b in transformer["blocks"])
    assert found["streams"] == _streams(family.parallel)
    assert found["primary_stream"] == family.primary_stream
    parallel = found["parallel"]
    source = {ParallelPlan: "accel family plan", FromDiffusers: "diffusers _cp_plan", AutomaticPlan: "automatic"}[
        type(family.parallel)
    ]  # type: ignore[index]
    assert parallel["plan"] == source and parallel["heads"] == family.tiny_heads and parallel["cfg_style"] == family.cfg
    split = splits_sequence(family.name)  # Qwen-Image 2.1's sequence is not cut
    assert parallel["modes"] == {
        "ulysses": split,
        "ring": split,
        "cfg": family.cfg is not None,
        "tp": family.tensor is not None,
    }
    assert set(parallel["refused"]) == {mode for mode, on in parallel["modes"].items() if not on}
    accel = found["accelerators"]
    assert accel["cache"] == ["fbcache", "dbcache", "taylorseer", "magcache"]
    assert accel["quant"] == ["int8wo", "int8dq", "fp8dq", "fp8wo", "int4wo"]
    assert accel["compile"] == "regional" and accel["vae_tiling"] is True
    assert accel["vae"] == {"class": family.vae, "parallel": True, "method": vae_plan(family.vae).method}  # type: ignore[arg-type,union-attr]
    assert accel["placement"] == {
        "text_encoder": ["replicated", "rank0", "cpu", "sharded"],
        "vae": ["replicated", "rank0"],
    }
    assert bool(accel["text_encoders"]) == has_text_encoders(family.name)  # Cosmos 3's transformer embeds its token ids
    assert all(name.startswith("text_encoder") for name in accel["text_encoders"])


def test_a_registry_alias_is_read_from_its_flagship_config_without_weights() -> None:
    found = json.loads(invoke("inspect", "flux", "--json").stdout)
    assert (found["source"], found["pipeline"]) == ("registry", "FluxPipeline")
    [transformer] = found["transformers"]
    assert (transformer["class"], transformer["heads"]) == ("FluxTransformer2DModel", 24)
    assert [(b["attr"], b["count"], b["class"]) for b in transformer["blocks"]] == [
        ("transformer_blocks", 19, "FluxTransformerBlock"),
        ("single_transformer_blocks", 38, "FluxSingleTransformerBlock"),
    ]
    assert found["accelerators"]["text_encoders"] == ["text_encoder", "text_encoder_2"]


def test_a_saved_folder_is_read_from_its_configs(tmp_path: Path) -> None:
    pipe = FAMILIES["wan"].tiny()  # type: ignore[misc]
    pipe.save_pretrained(tmp_path / "wan")
    found = json.loads(invoke("inspect", str(tmp_path / "wan"), "--json").stdout)
    assert (found["source"], found["pipeline"], found["family"]["name"]) == ("folder", "WanPipeline", "wan")
    assert [(b["attr"], b["count"], b["class"]) for b in found["transformers"][0]["blocks"]] == [
        ("blocks", len(pipe.transformer.blocks), "WanTransformerBlock")
    ]


def _refused(model: str) -> str:
    result = invoke("inspect", model)
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1  # one line, no traceback
    return result.stderr.removeprefix("error: ").rstrip("\n")


def test_an_unknown_name_is_refused_in_one_line() -> None:
    from accel.models.registry import unknown_model_message

    assert _refused("tiny-flx") == unknown_model_message("tiny-flx")
    assert unknown_model_message("tiny-flx").startswith(
        "unknown model 'tiny-flx' (did you mean 'tiny-flux'?): use one of flux, "
    )


def test_a_folder_that_is_not_a_pipeline_is_refused_in_one_line(tmp_path: Path) -> None:
    assert _refused(str(tmp_path)) == (
        f"{tmp_path} is not a diffusers pipeline folder: it has no model_index.json; "
        "pass the folder save_pretrained wrote, or a downloaded pipeline"
    )


def _folder(tmp_path: Path, pipeline: str, transformer: str | None, config: dict[str, Any] | None = None) -> str:
    """A pipeline folder as save_pretrained writes it, without weights: inspect reads configs only."""
    index: dict[str, Any] = {"_class_name": pipeline, "vae": ["diffusers", "AutoencoderKL"]}
    if transformer is not None:
        index["transformer"] = ["diffusers", transformer]
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    if config is not None:
        (tmp_path / "transformer").mkdir()
        (tmp_path / "transformer" / "config.json").write_text(json.dumps({"_class_name": transformer, **config}))
    return str(tmp_path)


def test_a_pipeline_no_family_knows_is_described_from_its_transformer_and_its_generic_path(tmp_path: Path) -> None:
    from test_discover import OUTSIDE

    folder = _folder(
        tmp_path, "Cosmos2TextToImagePipeline", "CosmosTransformer3DModel", OUTSIDE["CosmosTransformer3DModel"][0]
    )
    found = json.loads(invoke("inspect", folder, "--json").stdout)
    assert found["family"] == {"name": None, "title": "Cosmos2TextToImagePipeline", "tested": False}
    assert found["refused"] is None
    assert found["generic"] == (
        "accel learns the blocks from the model at load (one probe call learns what a block returns); "
        "cache, quantization and compile apply"
    )
    [transformer] = found["transformers"]
    assert (transformer["class"], transformer["heads"]) == ("CosmosTransformer3DModel", 2)
    assert transformer["blocks"] == [
        {
            "attr": "transformer_blocks",
            "count": 3,
            "class": "CosmosTransformerBlock",
            "returns": None,
            "found_by": "_no_split_modules",
            "unknown": "diffusers' block registry has no entry for CosmosTransformerBlock",
        }
    ]
    assert found["parallel"]["plan"] == "automatic" and found["parallel"]["verdicts"] == []  # none verified yet
    assert found["parallel"]["modes"] == {"ulysses": True, "ring": True, "cfg": False, "tp": False}
    assert found["parallel"]["refused"]["cfg"] == (
        "Cosmos2TextToImagePipeline is not a family accel was taught: how it runs classifier-free guidance is not known"
    )
    accelerators = found["accelerators"]
    assert (accelerators["cache"], accelerators["quant"], accelerators["compile"]) == (
        ["fbcache", "dbcache", "taylorseer", "magcache"],
        ["int8wo", "int8dq", "fp8dq", "fp8wo", "int4wo"],
        "regional",
    )
    # What its VAE class supports, for when the pipeline runs: AutoencoderKL tiles and is split (FLUX's VAE).
    assert (accelerators["vae_tiling"], accelerators["vae"]) == (
        True,
        {"class": "AutoencoderKL", "parallel": True, "method": vae_plan("AutoencoderKL").method},
    )  # type: ignore[union-attr]
    table = invoke("inspect", folder).stdout
    assert "none: not a tested family" in table and "unknown: diffusers' block registry has no entry for" in table
    assert "generic path" in table and "accel learns the blocks from the model at load" in table


def test_a_class_that_ships_a_cp_plan_no_family_names_is_planned_from_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Wan's transformer with the Wan family taken out of the registry: its own `_cp_plan` is the source
    accel tries first. MiniMax-H3's gathers video and audio apart, which accel's engine cannot follow:
    the automatic plan."""
    from accel.models import registry

    monkeypatch.setattr(
        registry, "FAMILIES", {name: family for name, family in registry.FAMILIES.items() if name != "wan"}
    )
    (tmp_path / "wan").mkdir()
    (tmp_path / "minimax").mkdir()
    wan = _folder(tmp_path / "wan", "WanPipeline", "WanTransformer3DModel", {"num_layers": 2})
    found = json.loads(invoke("inspect", wan, "--json").stdout)
    assert (found["family"]["tested"], found["parallel"]["plan"]) == (False, "diffusers _cp_plan")
    assert (
        "diffusers _cp_plan: its streams learned from the model, verified on simulated ranks at first use (else the "
        "automatic plan)" in invoke("inspect", wan).stdout
    )
    minimax = _folder(tmp_path / "minimax", "MiniMaxH3Pipeline", "MiniMaxH3Transformer3DModel", {"num_layers": 2})
    assert json.loads(invoke("inspect", minimax, "--json").stdout)["parallel"]["plan"] == "automatic"


def test_registry_answers_show_for_a_pipeline_no_family_knows(tmp_path: Path) -> None:
    from test_discover import OUTSIDE

    folder = _folder(
        tmp_path, "MotifVideoPipeline", "MotifVideoTransformer3DModel", OUTSIDE["MotifVideoTransformer3DModel"][0]
    )
    [transformer] = json.loads(invoke("inspect", folder, "--json").stdout)["transformers"]
    assert [(b["attr"], b["count"], b["returns"], b["unknown"]) for b in transformer["blocks"]] == [
        ("transformer_blocks", 2, ["hidden_states", "encoder_hidden_states"], None),
        ("single_transformer_blocks", 3, ["hidden_states", "encoder_hidden_states"], None),
    ]


def test_what_cannot_be_described_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "foo").mkdir()
    (tmp_path / "none").mkdir()
    assert _refused(_folder(tmp_path / "foo", "FooPipeline", "FooTransformer2DModel")) == (
        "FooTransformer2DModel (transformer) is not a diffusers model class with a config here: accel cannot describe "
        "it"
    )
    assert _refused(_folder(tmp_path / "none", "BarPipeline", None)) == (
        "BarPipeline has no transformer component: accel accelerates diffusion transformers"
    )


@pytest.mark.parametrize("columns", ["240", "80"])
def test_models_marks_every_family_tested_and_points_to_inspect(columns: str) -> None:
    from accel.report import INSPECT_HINT

    result = runner.invoke(app, ["models"], env={"COLUMNS": columns}, catch_exceptions=False)
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    if columns == "240":  # a row a family, its second cell "tested"
        rows = [line for line in lines if line.startswith("│ ") and line.split("│")[1].strip() in FAMILIES]
        assert [row.split("│")[2].strip() for row in rows] == ["tested"] * len(FAMILIES)
    else:  # a block a family, its first line beginning "tested"
        heads = [line for line in lines if line.split(" ", 1)[0] in FAMILIES]
        assert [line.split(None, 1)[1].split(" · ")[0] for line in heads] == ["tested"] * len(FAMILIES)
    assert " ".join(" ".join(lines).split()).endswith(INSPECT_HINT)
    assert (
        INSPECT_HINT
        == "tested: a family accel was taught and tests; for any other pipeline, accel inspect MODEL says what accel "
        "finds"
    )


def test_a_family_without_a_flagship_config_gives_its_classes_and_heads() -> None:
    family = FAMILIES["flux2-klein"]
    found = json.loads(invoke("inspect", "flux2-klein", "--json").stdout)
    [transformer] = found["transformers"]
    assert (found["pipeline"], transformer["class"], transformer["heads"]) == (
        family.pipeline_class,
        family.transformer_class,
        family.heads,
    )
    assert [(b["attr"], b["count"], b["class"]) for b in transformer["blocks"]] == [
        (b.attr, None, None) for b in family.blocks
    ]
