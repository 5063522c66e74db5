"""Per-request LoRAs (`accel serve --lora NAME=PATH / --lora-dir DIR`): the registry and its
refusals before any rank starts, the adapters kept and dropped least-recently-used, and the real
server on tiny-flux answering the openai client's requests that alternate two LoRAs (one at a
step-distilled LoRA's few steps and guidance 1), a mix of both and none, each equal to
`accel run --lora` at the same seed; `accel batch` with the same field; an unknown name is 400
naming the registered ones."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

import interop_cases as cases
import parallel_cases
import accel
from accel.cli import app
from accel.errors import UserError
from accel.serve.loras import Adapters, chosen_loras, registered_loras

PROMPT = "a red fox in the snow"


@pytest.fixture(scope="module")
def lora_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of two seeded random LoRAs for tiny-flux: pixel.safetensors and ink.safetensors."""
    folder = tmp_path_factory.mktemp("loras")
    for name, seed in (("pixel", 1), ("ink", 2)):
        made = folder / f"made-{name}"
        made.mkdir()
        cases.make_lora(str(made), seed)
        (made / "pytorch_lora_weights.safetensors").rename(folder / f"{name}.safetensors")
        made.rmdir()
    return folder


def test_the_registry_names_each_file_and_refuses_what_it_cannot_serve(lora_files: Path, tmp_path: Path) -> None:
    pixel, ink = str(lora_files / "pixel.safetensors"), str(lora_files / "ink.safetensors")
    assert registered_loras(None, lora_files) == {"ink": ink, "pixel": pixel}
    assert registered_loras([f"p={pixel}"], None) == {"p": pixel}
    (tmp_path / "empty").mkdir()
    missing = f"{tmp_path}/none.safetensors"
    name_rule = "must be 1 to 64 letters, digits, '.', '_' or '-'"
    for given, folder, message in (
        (["p"], None, "--lora p: write NAME=PATH, e.g. --lora pixel=loras/pixel.safetensors"),
        ([f"a b={pixel}"], None, f"--lora a b={pixel}: the name 'a b' {name_rule}"),
        ([f"p={missing}"], None, f"--lora p={missing}: {missing} is not a file; pass a LoRA .safetensors file"),
        (
            [f"ink={pixel}"],
            lora_files,
            f"--lora-dir {lora_files}: the name 'ink' is registered twice; give each LoRA its own",
        ),
        (None, tmp_path / "empty", f"--lora-dir {tmp_path}/empty: no .safetensors file in it"),
        (
            None,
            tmp_path / "nope",
            f"--lora-dir {tmp_path}/nope: not a folder; pass the folder holding the LoRA .safetensors files",
        ),
    ):
        with pytest.raises(UserError) as refused:
            registered_loras(given, folder)
        assert str(refused.value) == message
    assert chosen_loras({"ink": 0.5, "pixel": 1}, {"ink": ink, "pixel": pixel}) == (("ink", 0.5), ("pixel", 1.0))
    with pytest.raises(ValueError) as refused:
        chosen_loras({"x": 1}, {})
    assert (
        str(refused.value)
        == "lora: no LoRA 'x' on this server; registered: none (accel serve --lora NAME=PATH registers them)"
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lora", "p"], "--lora p: write NAME=PATH, e.g. --lora pixel=loras/pixel.safetensors"),
        (["--max-loras", "0"], "--max-loras must be >= 1, got 0"),
        (
            ["--quant", "int8wo"],
            "--lora with [quant] type int8wo is not served yet: adapters over quantized layers are untested; fuse one "
            "LoRA into the model with the recipe's [model] lora instead",
        ),
    ],
)
def test_serve_and_batch_refuse_a_bad_lora_flag_in_one_line(
    flags: list[str], message: str, lora_files: Path, tmp_path: Path
) -> None:
    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"prompt": "x"}\n')
    for command in (["serve", "tiny-flux"], ["batch", str(requests), "tiny-flux", "--out", str(tmp_path / "o")]):
        result = CliRunner().invoke(app, [*command, "--lora-dir", str(lora_files), *flags], env={"COLUMNS": "400"})
        assert result.exit_code == 2 and result.output.strip().splitlines()[-1] == f"error: {message}"


class _Pipe:
    """Records the adapter calls `Adapters` makes, as diffusers' LoRA mixin would receive them."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def load_lora_weights(self, folder: str, weight_name: str, adapter_name: str) -> None:
        self.calls.append(("load", adapter_name))

    def delete_adapters(self, name: str) -> None:
        self.calls.append(("delete", name))

    def set_adapters(self, names: list[str], adapter_weights: list[float]) -> None:
        self.calls.append(("set", tuple(names), tuple(adapter_weights)))

    def enable_lora(self) -> None:
        self.calls.append(("enable",))

    def disable_lora(self) -> None:
        self.calls.append(("disable",))


def test_adapters_load_once_switch_by_scale_and_drop_the_least_recently_used(tmp_path: Path) -> None:
    pipe = _Pipe()
    for name in "abc":  # registered files exist (the registry checks): they load by folder and file name
        (tmp_path / f"{name}.safetensors").write_bytes(b"")
    adapters = Adapters(pipe, {name: str(tmp_path / f"{name}.safetensors") for name in "abc"}, most=2)
    for chosen in ((("a", 1.0),), (("b", 0.5),), (("a", 0.7),), (), (("c", 1.0),), (("a", 1.0), ("c", 1.0))):
        adapters.use(chosen)
    adapters.use((("a", 1.0), ("c", 1.0)))  # the same set again: nothing to do
    assert pipe.calls == [
        ("load", "a"), ("enable",), ("set", ("a",), (1.0,)),
        ("load", "b"), ("enable",), ("set", ("b",), (0.5,)),
        ("enable",), ("set", ("a",), (0.7,)),  # kept: a scale is a switch, not a load
        ("disable",),  # no LoRA: the base weights alone
        ("delete", "b"), ("load", "c"), ("enable",), ("set", ("c",), (1.0,)),  # b was used least recently
        ("enable",), ("set", ("a", "c"), (1.0, 1.0)),
    ]  # fmt: skip
    assert list(adapters.loaded) == ["a", "c"]


def test_compiled_blocks_switch_loras_without_compiling_again(lora_files: Path, tmp_path: Path) -> None:
    """Under [compile] each LoRA sits in a slot and a switch writes scales only: the blocks compile as
    slots fill, never again for a switch, another scale, none, both, or a LoRA refilling an evicted
    slot; each output equals the eager pipeline's set_adapters at the same scales."""
    from torch._dynamo.utils import counters

    made = tmp_path / "sketch"
    made.mkdir()
    cases.make_lora(str(made), 3)
    registered = {name: str(lora_files / f"{name}.safetensors") for name in ("pixel", "ink")}
    registered["sketch"] = str(made / "pytorch_lora_weights.safetensors")
    asked: list[tuple[tuple[str, float], ...]] = [
        (("pixel", 0.8),),  # fills slot 0: compiles
        (("ink", 1.0),),  # fills slot 1: compiles
        (),
        (("pixel", 0.5), ("ink", 0.5)),
        (("pixel", 0.3),),
        (("sketch", 1.0),),  # evicts ink (least recently used) and takes its slot
        (("pixel", 0.8),),
    ]
    call = dict(prompt=PROMPT, height=64, width=64, num_inference_steps=2, guidance_scale=3.5, output_type="np")

    def outputs(compiled: bool) -> tuple[list[np.ndarray], list[int]]:
        pipe = parallel_cases.tiny_pipeline("tiny-flux", key=f"lora slots {compiled}")
        handle = accel.apply(pipe, {"compile": {"enabled": compiled}})
        adapters = Adapters(pipe, registered, most=2, compiled=compiled)
        images, graphs = [], []
        try:
            for chosen in asked:
                adapters.use(chosen)
                before = counters["stats"]["unique_graphs"]
                images.append(pipe(**call, generator=torch.Generator().manual_seed(5)).images)
                graphs.append(counters["stats"]["unique_graphs"] - before)
        finally:
            handle.remove()
        return images, graphs

    eager, _ = outputs(False)
    compiled, graphs = outputs(True)
    assert graphs[0] > 0 and graphs[1] > 0 and graphs[2:] == [0] * (len(asked) - 2), graphs
    for chosen, made_eager, made_compiled in zip(asked, eager, compiled):
        assert np.abs(made_compiled - made_eager).max() <= 1e-4, chosen
    assert np.abs(compiled[0] - compiled[6]).max() == 0 and np.abs(compiled[0] - compiled[4]).max() > 1e-3


def _run(tmp_path: Path, name: str, lora: str | None, *flags: str) -> bytes:
    out = tmp_path / f"{name}.png"
    given = ["--lora", lora] if lora else []
    result = CliRunner().invoke(
        app, ["run", "tiny-flux", "--prompt", PROMPT, "--seed", "5", *given, *flags, "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    return out.read_bytes()


def _pixels(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB")).astype(int)


def test_requests_alternating_loras_equal_accel_run_with_each_fused(lora_files: Path, tmp_path: Path) -> None:
    from test_serve import start

    server = start("tiny-flux", "--lora-dir", str(lora_files), "--max-loras", "2", "--steps", "4")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    asked = [
        ("pixel", {"pixel": 0.8}, {}),
        ("ink-distilled", {"ink": 1.0}, {"steps": 2, "guidance_scale": 1.0}),  # a few-step LoRA's own settings
        ("none", None, {}),
        ("both", {"pixel": 0.5, "ink": 0.5}, {}),
        ("pixel-again", {"pixel": 0.8}, {}),
    ]
    answers: dict[str, bytes] = {}
    try:
        for name, lora, settings in asked:
            extra = {"seed": 5, **settings, **({"lora": lora} if lora else {})}
            result = client.images.generate(prompt=PROMPT, response_format="b64_json", extra_body=extra)
            answers[name] = base64.b64decode(result.data[0].b64_json)  # type: ignore[index, arg-type]
        with pytest.raises(openai.BadRequestError) as refused:
            client.images.generate(prompt=PROMPT, extra_body={"lora": {"sketch": 1.0}})
        assert refused.value.body == {
            "message": "lora: no LoRA 'sketch' on this server; registered: ink, pixel",
            "type": "invalid_request_error",
            "param": "lora",
            "code": None,
        }
    finally:
        code, _out, err = server.stop()
        assert code == 0, err[-2000:]
    pixel, ink = lora_files / "pixel.safetensors", lora_files / "ink.safetensors"
    runs = {
        "pixel": _run(tmp_path, "pixel", f"{pixel}@0.8"),
        "ink-distilled": _run(tmp_path, "ink", f"{ink}@1.0", "--steps", "2", "--guidance", "1.0"),
        "none": _run(tmp_path, "none", None, "--steps", "4"),
    }
    for name, expected in runs.items():  # unfused adapters against fused weights: equal to the 8-bit pixel here
        assert np.abs(_pixels(answers[name]) - _pixels(expected)).max() <= 1, name
    assert answers["pixel-again"] == answers["pixel"]  # after two other sets and an eviction
    assert len({answers[name] for name in ("pixel", "ink-distilled", "none", "both")}) == 4
    # The same LoRA field in a batch file: the server's answer.
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"custom_id": "fox", "prompt": PROMPT, "seed": 5, "lora": {"pixel": 0.8}}) + "\n")
    result = CliRunner().invoke(
        app,
        ["batch", str(requests), "tiny-flux", "--lora-dir", str(lora_files), "--steps", "4", "-o", str(tmp_path / "b")],
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "b" / "fox.png").read_bytes() == answers["pixel"]


@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
def test_a_multipart_request_carries_its_lora_as_the_openai_client_sends_it(tmp_path: Path) -> None:
    """A form has no objects: the openai client sends a dict as lora[NAME]=SCALE fields; JSON text works too."""
    import httpx
    from test_serve_videos import WAN_DEFAULTS, serve_front

    from accel.models.registry import FAMILIES
    from accel.serve.requests import Served

    served = Served("tiny-wan", FAMILIES["wan"], "video", dict(WAN_DEFAULTS), loras={"pixel": "/p", "ink": "/i"})
    with serve_front(tmp_path / "videos", served=served) as front:
        front.client.videos.create_and_poll(prompt="a fox", poll_interval_ms=20, extra_body={"lora": {"pixel": 0.8}})
        form = {"prompt": (None, "an owl"), "lora": (None, '{"ink": 0.5, "pixel": 1}')}  # fields, no files
        sent = httpx.post(f"{front.url}/v1/videos", files=form)
        assert sent.status_code == 200, sent.text
        bad = httpx.post(f"{front.url}/v1/videos", files={"prompt": (None, "an owl"), "lora": (None, "{pixel")})
        assert bad.status_code == 400
        assert bad.json()["error"]["message"] == "lora: a JSON object, or lora[NAME]=VALUE fields"
        front.client.videos.poll(sent.json()["id"], poll_interval_ms=20)
    assert [job.loras for job in front.replica.jobs] == [(("pixel", 0.8),), (("ink", 0.5), ("pixel", 1.0))]


def test_loras_on_two_ulysses_ranks_or_cfg_halves_with_the_cache_equal_one_process(
    lora_files: Path, tmp_path: Path
) -> None:
    """Every rank of a replica switches alike: a context-parallel replica, and one whose ranks each
    run a CFG half (FLUX's true CFG, two transformer calls a step), with the cache on, answer as one
    process does (the cache's decisions are the same on every rank)."""
    from test_serve import start

    recipe = tmp_path / "true-cfg.toml"
    recipe.write_text('[model]\nname = "tiny-flux"\n\n[generate]\ntrue_cfg_scale = 2.0\nnegative_prompt = "blurry"\n')
    layouts = {"one process": ("--gpus", "1"), "ulysses 2": ("--gpus", "2"), "cfg 2": ("--gpus", "2", "--cfg-parallel")}
    answers: dict[str, dict[str, np.ndarray]] = {}
    for layout, flags in layouts.items():
        server = start("--recipe", str(recipe), *flags, "--lora-dir", str(lora_files), "--steps", "4", "--cache", "0.1")
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        try:
            for name, lora in (("pixel", {"pixel": 0.8}), ("none", None), ("ink", {"ink": 1.0})):
                extra = {"seed": 5, **({"lora": lora} if lora else {})}
                result = client.images.generate(prompt=PROMPT, response_format="b64_json", extra_body=extra)
                answers.setdefault(layout, {})[name] = _pixels(base64.b64decode(result.data[0].b64_json))  # type: ignore[arg-type]
        finally:
            code, out, err = server.stop()
            assert code == 0, err[-2000:]
        assert f"of {flags[1]} process" in out
    for layout in ("ulysses 2", "cfg 2"):
        for name in ("pixel", "none", "ink"):
            assert np.abs(answers[layout][name] - answers["one process"][name]).max() <= 1, (layout, name)
    # Each LoRA moves the picture by more than that tolerance, so the equality above holds each one to its own.
    moved = (("pixel", "none"), ("ink", "none"))
    assert min(np.abs(answers["cfg 2"][a] - answers["cfg 2"][b]).max() for a, b in moved) > 1


# Every kind of layer tiny FLUX's tensor plan splits: column-wise, row-wise, and the single blocks'
# proj_out, row-wise over the attention's and the MLP's widths side by side.
SPLIT_LAYERS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "to_add_out", "ff.net.2", "proj_mlp", "proj_out")


def test_loras_on_two_tensor_parallel_ranks_equal_one_process(rank_pools: Any, tmp_path: Path) -> None:
    """A LoRA loaded per request onto TP-split blocks is cut as each layer was (B's rows of a
    column-wise layer, A's columns of a row-wise one, summed over the ranks before B): two LoRAs on
    every split layer, switched alone, mixed and off, eager and compiled, equal one process."""
    registered = {}
    for name, seed in (("wide", 4), ("deep", 5)):
        made = tmp_path / name
        made.mkdir()
        cases.make_lora(str(made), seed, SPLIT_LAYERS)
        registered[name] = str(made / "pytorch_lora_weights.safetensors")
    asked = [(("wide", 0.8),), (), (("deep", 1.0),), (("wide", 0.5), ("deep", 0.5))]
    call = dict(prompt=PROMPT, height=64, width=64, num_inference_steps=2, guidance_scale=3.5)
    reference = cases.switched_lora_outputs(registered, asked, call, {}, "lora tp reference")
    assert min(np.abs(reference[i] - reference[1]).max() for i in (0, 2, 3)) > 1e-2, "each LoRA moves the image"
    compiled = {"enabled": True, "backend": "aot_eager"}
    for recipe in ({"parallel": {"tp": 2}}, {"parallel": {"tp": 2}, "compile": compiled}):
        key = f"lora tp {'compile' in recipe}"
        for outputs in rank_pools(2).run(cases.switched_lora_outputs, registered, asked, call, recipe, key):
            for chosen, made, expected in zip(asked, outputs, reference):
                assert np.abs(made - expected).max() <= 1e-4, (recipe, chosen)


def test_a_dora_adapter_on_a_split_layer_is_refused_in_one_line() -> None:
    from torch import nn

    from accel.parallel.tensor import SPLIT_MARK, TensorGroup
    from accel.parallel.tensor_lora import cut_tensor

    transformer = nn.Module()
    setattr(transformer, SPLIT_MARK, TensorGroup(2, 1, None, {"blocks.0.out": ("rowwise", (8,))}))
    down = torch.arange(16.0).reshape(2, 8)
    assert cut_tensor({"transformer": transformer}, "transformer.blocks.0.out.lora_A.weight", down).tolist() == [
        [4.0, 5.0, 6.0, 7.0],
        [12.0, 13.0, 14.0, 15.0],
    ]
    # B of a row-wise layer stays whole; a key without the component's name is the transformer's
    assert cut_tensor({"transformer": transformer}, "blocks.0.out.lora_B.weight", down) is down
    with pytest.raises(UserError) as refused:
        cut_tensor({"transformer": transformer}, "transformer.blocks.0.out.lora_magnitude_vector", down)
    assert str(refused.value) == (
        "LoRA: transformer.blocks.0.out.lora_magnitude_vector is a DoRA magnitude, which tensor parallelism does not "
        "split; use a plain LoRA or tp = 1"
    )


def test_a_lora_loaded_before_the_split_is_refused_naming_the_order_that_works(tmp_path: Path) -> None:
    from accel.models.lora import Lora, load_adapter
    from accel.models.registry import FAMILIES
    from accel.parallel.tensor import planned_layers, resolve_tensor_plan

    cases.make_lora(str(tmp_path), 4, ("to_q",))
    pipe = parallel_cases.tiny_pipeline("tiny-flux", key="lora before the split")
    load_adapter(pipe, Lora(str(tmp_path / "pytorch_lora_weights.safetensors")), "early", "LoRA: ")
    with pytest.raises(UserError) as refused:
        planned_layers(pipe.transformer, resolve_tensor_plan(FAMILIES["flux"].tensor, pipe.transformer))
    assert str(refused.value) == (
        "[parallel] tp: transformer_blocks.0.attn.to_q carries a LoRA adapter loaded before the split; load it after "
        "accel.apply (it is then cut with its layer), or fuse and unload it first (pipe.fuse_lora(); "
        "pipe.unload_lora_weights())"
    )
