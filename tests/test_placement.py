"""Component placement ([memory]): with text_encoder = "rank0" only the layout's first rank holds
the text encoders and encodes; the others receive the embeddings and equal one process. With "cpu"
that rank keeps them in host memory and encodes there, its outputs moved to the transformer's device."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import commands
import torch

import parallel_cases as cases
from families import FAMILY_CASES
from family_parallel import TOLERANCE, reference, splits_sequence
from variant_cases import has_text_encoders


@pytest.mark.parametrize("family", [family for family in FAMILY_CASES if has_text_encoders(family)])
def test_first_rank_encodes_for_every_rank(rank_pools, family: str) -> None:
    case = FAMILY_CASES[family]
    expected, _ = reference(family, case.call)
    parallel = {"ulysses": 2} if splits_sequence(family) else {"cfg": 2}  # Qwen-Image 2.1's sequence is not cut
    (lead, lead_encoders, _), (other, other_encoders, _) = rank_pools(2).run(
        cases.first_rank_encodes_run, f"tiny-{family}", parallel, case.call
    )
    assert lead_encoders and "text_encoder" in lead_encoders
    assert other_encoders == []  # dropped at apply: the memory is given back
    for output in (lead, other):
        assert np.abs(output - expected).max() <= TOLERANCE


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_first_rank_encodes_on_the_cpu_for_every_rank(rank_pools, family: str) -> None:
    case = FAMILY_CASES[family]
    expected, _ = reference(family, case.call)
    (lead, lead_encoders, devices), (other, other_encoders, _) = rank_pools(2).run(
        cases.first_rank_encodes_run, f"tiny-{family}", {"ulysses": 2}, case.call, "cpu"
    )
    assert "text_encoder" in lead_encoders and set(devices) == {"cpu"} and other_encoders == []
    for output in (lead, other):
        assert np.abs(output - expected).max() <= TOLERANCE


class _Encoding:
    """A pipeline's encode_prompt as diffusers writes it: embeddings made on the `device` it is given."""

    def __init__(self) -> None:
        self.text_encoder = torch.nn.Linear(4, 4)
        self.components = {"text_encoder": self.text_encoder}
        self.devices: list[torch.device] = []

    def encode_prompt(self, prompt: str, device: torch.device | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        self.devices.append(torch.device(device))
        embeds = self.text_encoder(torch.ones(1, 4, device=device))
        return embeds, [embeds * 2]


def test_cpu_placement_encodes_on_the_cpu_and_hands_the_transformer_its_device() -> None:
    """The transformer's device is "meta" here (no GPU): the encoder runs on the CPU, every tensor of
    the result arrives on the transformer's device, and remove() puts the wrapper away."""
    from accel.parallel.encoders import EncodesOnCpu

    pipe = _Encoding()
    placed = EncodesOnCpu(pipe, torch.device("meta"))
    embeds, (pooled,) = pipe.encode_prompt("a fox", device=torch.device("meta"))
    assert pipe.devices == [torch.device("cpu")]
    assert embeds.device.type == "meta" and pooled.device.type == "meta" and pooled.shape == (1, 4)
    placed.remove()
    assert pipe.encode_prompt("a fox", device=torch.device("cpu"))[0].device.type == "cpu"
    assert pipe.devices[-1] == torch.device("cpu") and len(pipe.devices) == 2


def test_cpu_placement_needs_an_encode_prompt_that_takes_a_device() -> None:
    from accel.errors import NotAvailableError
    from accel.parallel.encoders import EncodesOnCpu

    class NoDevice:
        components: dict = {}

        def encode_prompt(self, prompt: str) -> torch.Tensor:
            return torch.zeros(1)

    with pytest.raises(NotAvailableError) as refused:
        EncodesOnCpu(NoDevice(), torch.device("meta"))
    assert str(refused.value) == (
        '[memory] text_encoder = "cpu": NoDevice has no encode_prompt(device=...) to run on the CPU; '
        'set text_encoder = "replicated" or "rank0"'
    )


def test_text_encoders_loaded_for_the_cpu_never_reach_the_device() -> None:
    """load_pipeline(..., text_encoders_on_cpu=True) moves everything else to the device ("meta" stands in
    for the GPU, which load_pipeline's device check would refuse): its last step, on a loaded pipeline."""
    import accel
    from accel.models.loading import _place

    pipe = accel.load_pipeline("tiny-flux", "float32", device="cpu")
    _place(pipe, torch.device("meta"), text_encoders_on_cpu=True)
    assert next(pipe.transformer.parameters()).device.type == "meta"
    assert next(pipe.vae.parameters()).device.type == "meta"
    for name in ("text_encoder", "text_encoder_2"):
        assert next(getattr(pipe, name).parameters()).device.type == "cpu"


def _saved(family: str, builder: str, folder) -> np.ndarray:
    """The family's tiny pipeline saved to `folder`, and the output of it loaded back on one process."""
    import accel

    cases.tiny_pipeline(builder).save_pretrained(folder)
    whole = accel.load_pipeline(str(folder), "float32")
    whole.set_progress_bar_config(disable=True)
    return cases.output_of(
        whole(**FAMILY_CASES[family].call, generator=torch.Generator().manual_seed(0), output_type="np")
    )


def test_ranks_that_do_not_encode_never_load_the_encoders(rank_pools, tmp_path) -> None:
    folder = tmp_path / "tiny-wan"
    expected = _saved("wan", "accel.models.wan:build_tiny", folder)
    runs = rank_pools(2).run(cases.first_rank_loads_run, str(folder), FAMILY_CASES["wan"].call)
    assert [loaded for _, loaded in runs] == [True, False]
    for output, _ in runs:
        assert np.abs(output - expected).max() <= TOLERANCE


# -- [memory] text_encoder = "sharded" ---------------------------------------------------------------------

SHARDED_NO_PLAN = (
    '[memory] text_encoder = "sharded": the text encoders of FluxPipeline (CLIPTextModel, T5EncoderModel) '
    'have no tensor-parallel plan in transformers; set text_encoder = "replicated", "rank0" or "cpu"'
)


@pytest.mark.parametrize("family", ["qwenimage", "hunyuan"])
def test_sharded_text_encoder_equals_one_process_with_half_its_weights(rank_pools, family: str) -> None:
    """The Qwen2.5-VL of Qwen-Image and the Llama of HunyuanVideo split over 2 gloo ranks by transformers'
    own plan: the ranks' slices of every weight the plan splits add up to it (the vision tower, the
    norms and HunyuanVideo's CLIP, which has no plan, stay whole), and both ranks get the single
    process's embeddings and output."""
    case = FAMILY_CASES[family]
    expected, _ = reference(family, case.call)
    whole = cases.tiny_pipeline(f"tiny-{family}")
    with torch.no_grad():
        embeds = whole.encode_prompt(case.call["prompt"], device=torch.device("cpu"))[0]
    runs = rank_pools(2).run(cases.sharded_encodes_run, f"tiny-{family}", {"ulysses": 2}, case.call)
    for run in runs:
        assert list(run["split"]) == ["text_encoder"]  # attention, MLP and embeddings; never CLIP
        assert (run["embeds"] - embeds).abs().max().item() <= TOLERANCE
        assert np.abs(run["output"] - expected).max() <= TOLERANCE
        assert (
            run["after"]["text_encoder"]
            == run["before"]["text_encoder"] - run["split_whole"]["text_encoder"] + run["split_local"]["text_encoder"]
        )
        assert {name: size for name, size in run["after"].items() if name != "text_encoder"} == {
            name: size for name, size in run["before"].items() if name != "text_encoder"
        }
    assert sum(run["split_local"]["text_encoder"] for run in runs) == runs[0]["split_whole"]["text_encoder"]
    if family == "qwenimage":  # every split width is even: exactly half each
        assert runs[0]["split_local"]["text_encoder"] * 2 == runs[0]["split_whole"]["text_encoder"]


def test_sharded_text_encoder_loads_split(rank_pools, tmp_path) -> None:
    """accel run's load: transformers splits the Qwen2.5-VL as it reads it (each rank its slice, as
    apply would cut it) and accel.apply leaves it so; the output equals one process's."""
    folder = tmp_path / "tiny-qwenimage"
    expected = _saved("qwenimage", "tiny-qwenimage", folder)
    runs = rank_pools(2).run(cases.sharded_loads_run, str(folder), FAMILY_CASES["qwenimage"].call)
    for output, held, split in runs:
        assert split > 0 and held == 213760  # of 315648 bytes: what the apply test's split leaves each rank
        assert np.abs(output - expected).max() <= TOLERANCE


def test_sharded_refuses_encoders_without_a_plan_at_apply(tiny_flux) -> None:
    """T5 and CLIP have no plan in transformers: refused on one process too, the recipe meaning the same
    at any size; the pipeline is left as it was."""
    import accel
    from accel.errors import NotAvailableError

    with pytest.raises(NotAvailableError) as refused:
        accel.apply(tiny_flux, {"memory": {"text_encoder": "sharded"}})
    assert str(refused.value) == SHARDED_NO_PLAN


def test_sharded_refuses_uneven_heads() -> None:
    """Z-Image's tiny Qwen3 has one key-value head: 2 ranks would each hold half of it."""
    from accel.parallel.encoders import sharded_refusal

    assert sharded_refusal(cases.tiny_pipeline("tiny-zimage"), 2) == (
        '[memory] text_encoder = "sharded": Qwen3ForCausalLM has 2 attention heads and 1 key-value heads, which 2 '
        "ranks "
        'do not divide; set text_encoder = "replicated", "rank0" or "cpu"'
    )
    assert sharded_refusal(cases.tiny_pipeline("tiny-zimage"), 1) is None


def test_sharded_refuses_encoders_without_a_plan_before_any_rank_starts(tmp_path) -> None:
    from typer.testing import CliRunner

    from accel.cli import app

    folder = tmp_path / "tiny-flux"
    cases.tiny_pipeline("tiny-flux").save_pretrained(folder)
    result = CliRunner().invoke(
        app, ["run", str(folder), "--gpus", "2", "--text-encoder", "sharded"], catch_exceptions=False
    )
    assert result.exit_code == 2
    assert " ".join(result.stderr.split()) == f"error: {SHARDED_NO_PLAN}"


def test_sharded_loads_the_encoders_into_host_memory_on_several_ranks() -> None:
    """accel run / serve: apply moves each rank's slice to the GPU, so the whole encoder never goes there."""
    from accel.parallel.encoders import loads_into_host_memory, loads_text_encoders

    assert [loads_into_host_memory(placement, 2) for placement in ("replicated", "rank0", "cpu", "sharded")] == [
        False,
        False,
        True,
        True,
    ]
    assert not loads_into_host_memory("sharded", 1) and loads_text_encoders("sharded", 2)


def test_which_encoder_classes_have_a_plan() -> None:
    """The families' encoders as transformers plans them, from the class alone (before loading)."""
    import transformers

    from accel.parallel.encoders import class_has_tp_plan

    planned = [
        "LlamaModel",
        "Mistral3ForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen2_5_VLTextModel",
        "Qwen3ForCausalLM",
        "Gemma3ForConditionalGeneration",
    ]
    unplanned = ["T5EncoderModel", "UMT5EncoderModel", "CLIPTextModel", "CLIPTextModelWithProjection"]
    assert [name for name in planned + unplanned if class_has_tp_plan(getattr(transformers, name))] == planned


def test_an_unknown_placement_is_one_line() -> None:
    run = commands.run(
        [sys.executable, "-m", "accel.cli", "run", "tiny-flux", "--gpus", "2", "--text-encoder", "rank1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert (
        run.stderr.strip().splitlines()[-1]
        == "error: command line: [memory] text_encoder must be one of replicated, rank0, cpu, sharded, got 'rank1'"
    )


# -- [memory] offload ----------------------------------------------------------------------------------
# On the CPU both modes move weights from host memory to host memory: what is checked here is that
# diffusers' hooks compose with accel's (the cache's block wrappers) and change no number; the GPU
# memory they save is BENCHMARKS.md's (make gpu-check).

OFFLOAD_CALL = dict(prompt="a fox", num_inference_steps=4, height=64, width=64, output_type="np")


def _offload_output(pipe, recipe: dict) -> tuple[np.ndarray, object]:
    import accel

    handle = accel.apply(pipe, recipe)
    output = pipe(**OFFLOAD_CALL, generator=torch.Generator().manual_seed(0)).images
    return output, handle


@pytest.mark.parametrize("mode", ["model", "group"])
def test_offload_changes_no_number_with_or_without_the_cache(mode: str) -> None:
    import accel

    plain = accel.load_pipeline("tiny-flux", "float32", "cpu")
    plain.set_progress_bar_config(disable=True)
    expected, handle = _offload_output(plain, {})
    handle.remove()
    cached, cache_handle = _offload_output(plain, {"cache": {"threshold": 0.6, "warmup_steps": 1}})
    cache_handle.remove()
    offloaded = accel.load_pipeline("tiny-flux", "float32", "cpu")
    offloaded.set_progress_bar_config(disable=True)
    output, handle = _offload_output(offloaded, {"memory": {"offload": mode}})
    if mode == "model":  # accelerate's hooks move each component in and out
        assert hasattr(offloaded.transformer, "_hf_hook") and hasattr(offloaded.vae, "_hf_hook")
    else:  # diffusers' hook registry streams the blocks
        assert getattr(offloaded.transformer.transformer_blocks[0], "_diffusers_hook", None) is not None
    np.testing.assert_array_equal(output, expected)
    handle.remove()
    both, handle = _offload_output(
        offloaded, {"memory": {"offload": mode}, "cache": {"threshold": 0.6, "warmup_steps": 1}}
    )
    assert any(
        record.cached for record in handle.cache_stats.records
    )  # the cache skipped blocks under the offload hooks
    np.testing.assert_array_equal(both, cached)
    handle.remove()
    if mode == "model":  # undone by remove(): no accelerate hook left; group offload stays, like the TP split
        assert [name for name, part in offloaded.components.items() if hasattr(part, "_hf_hook")] == []


def test_group_offload_leaves_encoders_kept_on_the_cpu_unhooked() -> None:
    """With text_encoder = "cpu" the encoders stay in host memory: group offload must not hook them to
    move to the GPU while they run."""
    import accel

    plain = accel.load_pipeline("tiny-flux", "float32", "cpu")
    plain.set_progress_bar_config(disable=True)
    expected, handle = _offload_output(plain, {})
    handle.remove()
    pipe = accel.load_pipeline("tiny-flux", "float32", "cpu")
    pipe.set_progress_bar_config(disable=True)
    output, handle = _offload_output(pipe, {"memory": {"offload": "group", "text_encoder": "cpu"}})
    hooked = {
        name
        for name, part in pipe.components.items()
        if isinstance(part, torch.nn.Module)
        and any(getattr(m, "_diffusers_hook", None) is not None for m in part.modules())
    }
    assert hooked == {"transformer", "vae"}
    np.testing.assert_array_equal(output, expected)
    handle.remove()


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["run", "tiny-flux", "--gpus", "2", "--offload", "model"],
            '[memory] offload = "model" runs one process: each rank would stream its own whole copy; set offload = '
            '"none" with a '
            "parallel layout, or run one process",
        ),
        (
            ["run", "tiny-flux", "--offload", "group", "--compile"],
            '[memory] offload = "group" and [compile] do not compose: compiled graphs would capture weights that '
            "offloading moves; "
            "turn one of them off",
        ),
        (
            ["run", "tiny-flux", "--offload", "model", "--compare"],
            '--compare with [memory] offload = "model": the baseline would run from host memory on the CPU, which '
            "says nothing of "
            "the speedup; drop one of them",
        ),
        (
            ["run", "tiny-flux", "--offload", "disk"],
            "command line: [memory] offload must be one of none, model, group, got 'disk'",
        ),
        (
            ["run", "tiny-flux", "--offload", "model", "--text-encoder", "cpu"],
            '[memory] offload = "model" already keeps the text encoders in host memory between prompts and encodes on '
            "the GPU; "
            'set text_encoder = "replicated" with it, or offload = "group" to encode on the CPU',
        ),
    ],
)
def test_offload_refusals_are_one_line(argv: list[str], line: str) -> None:
    from typer.testing import CliRunner

    from accel.cli import app

    result = CliRunner().invoke(app, argv, catch_exceptions=False)
    assert result.exit_code == 2
    assert " ".join(result.stderr.split()) == f"error: {line}"
