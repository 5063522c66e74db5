"""torchao quantization: outputs within a stated PSNR of the unquantized pipeline, the layers it
touches, its defaults earning their keep, and one-line refusals of schemes the hardware cannot run."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import pytest
import torch
from conftest import generate
from test_cli import invoke
from families import FAMILY_CASES

import accel
from accel.errors import UserError
from accel.models.registry import FAMILIES
from accel.optimize.quantize import hardware_refusal
from accel.quality import psnr

# Stated tolerances (PSNR of the 0..1 output against the unquantized one, same seed). Seen on the
# tiny models: int8wo 71.6–85.5 dB, int8dq 59.6–73.6 dB with the default scope.
MIN_PSNR = {"int8wo": 60.0, "int8dq": 50.0}


def fresh(family: str) -> Any:
    """A new tiny pipeline: quantization replaces weights for good, so no test may share one."""
    pipe = FAMILIES[family].tiny()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def quantized_names(module: torch.nn.Module) -> set[str]:
    """Linear layers whose weight is no longer a plain tensor (torchao swaps in a subclass)."""
    return {
        name
        for name, layer in module.named_modules()
        if isinstance(layer, torch.nn.Linear) and type(layer.weight.data) is not torch.Tensor
    }


def linear_names(module: torch.nn.Module) -> set[str]:
    return {name for name, layer in module.named_modules() if isinstance(layer, torch.nn.Linear)}


def quantized_run(family: str, quant: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, Any, Any]:
    pipe = fresh(family)
    call = FAMILY_CASES[family].call
    reference = generate(pipe, call)
    handle = accel.apply(pipe, {"quant": quant})
    return reference, generate(pipe, call), handle, pipe


@pytest.mark.parametrize("scheme", list(MIN_PSNR))
@pytest.mark.parametrize("family", list(FAMILY_CASES))
def test_quantized_output_is_within_the_stated_psnr(family: str, scheme: str) -> None:
    reference, output, handle, pipe = quantized_run(family, {"type": scheme})
    assert np.abs(output - reference).max() > 0  # it did change the weights
    assert psnr(output, reference) >= MIN_PSNR[scheme]
    block_attrs = {spec.attr for spec in FAMILIES[family].blocks}
    in_blocks = {name for name in linear_names(pipe.transformer) if name.split(".")[0] in block_attrs}
    assert quantized_names(pipe.transformer) == in_blocks
    assert handle.quant.as_dict() == {
        "type": scheme,
        "quantized_layers": len(in_blocks),
        "kept_layers": {"outside the repeated blocks": len(linear_names(pipe.transformer) - in_blocks)},
    }


@pytest.mark.parametrize("family", list(FAMILY_CASES))
def test_default_scope_keeps_quality_the_whole_transformer_loses(family: str) -> None:
    """The embedders and output layers left in the model dtype are why the default is better."""
    reference, blocks_only, _, _ = quantized_run(family, {"type": "int8dq"})
    _, everything, _, pipe = quantized_run(family, {"type": "int8dq", "scope": "transformer"})
    assert quantized_names(pipe.transformer) == linear_names(pipe.transformer)
    assert psnr(blocks_only, reference) > psnr(everything, reference) + 3.0


def test_exclude_patterns_keep_layers_in_the_model_dtype() -> None:
    _, _, handle, pipe = quantized_run(
        "flux", {"type": "int8wo", "exclude": ["*.ff.*", "single_transformer_blocks.1.*"]}
    )
    names = quantized_names(pipe.transformer)
    assert names and not any(".ff." in name or name.startswith("single_transformer_blocks.1.") for name in names)
    assert any(name.startswith("single_transformer_blocks.0.") for name in names)
    excluded = {
        n for n in linear_names(pipe.transformer) if ".ff." in n or n.startswith("single_transformer_blocks.1.")
    }
    assert handle.quant.kept["excluded"] == sorted(excluded, key=list(dict(pipe.transformer.named_modules())).index)


def test_quantization_stays_after_remove_and_a_second_apply_keeps_it() -> None:
    pipe = fresh("flux")
    call = FAMILY_CASES["flux"].call
    accel.apply(pipe, {"quant": {"type": "int8wo"}}).remove()
    once = generate(pipe, call)
    names = quantized_names(pipe.transformer)
    accel.apply(pipe, {"quant": {"type": "int8wo"}}).remove()  # same scheme: left as it is
    assert quantized_names(pipe.transformer) == names
    np.testing.assert_array_equal(generate(pipe, call), once)
    with pytest.raises(
        UserError,
        match=re.escape(
            "[quant] type = 'int8dq': this pipeline's transformer is already quantized as 'int8wo'; "
            "load the pipeline again to quantize it differently"
        ),
    ):
        accel.apply(pipe, {"quant": {"type": "int8dq"}})


def test_both_wan_experts_are_quantized() -> None:
    from accel.models.wan import build_tiny_22

    pipe = build_tiny_22()
    handle = accel.apply(pipe, {"quant": {"type": "int8wo"}})
    assert quantized_names(pipe.transformer) and quantized_names(pipe.transformer_2)
    assert any(name.startswith("transformer_2.") for name in handle.quant.quantized)


FP8 = "an NVIDIA GPU of compute capability 8.9 or newer"


@pytest.mark.parametrize(
    "scheme, device, capability, dtype, refusal",
    [
        ("int8wo", "cpu", None, torch.float32, None),
        ("int8dq", "cuda", (7, 0), torch.float16, None),
        (
            "fp8dq",
            "cpu",
            None,
            torch.bfloat16,
            f"[quant] type = 'fp8dq' needs {FP8}; this run is on cpu. Use int8wo or int8dq",
        ),
        (
            "fp8wo",
            "cuda",
            (8, 6),
            torch.bfloat16,
            f"[quant] type = 'fp8wo' needs {FP8}; this GPU is 8.6. Use int8wo or int8dq",
        ),
        ("fp8dq", "cuda", (8, 9), torch.bfloat16, None),
        ("fp8dq", "cuda", (9, 0), torch.float16, None),
        (
            "int4wo",
            "cuda",
            (7, 5),
            torch.bfloat16,
            "[quant] type = 'int4wo' needs an NVIDIA GPU of compute capability 8.0 or newer; this GPU is 7.5. Use "
            "int8wo or int8dq",
        ),
        (
            "int4wo",
            "cuda",
            (8, 0),
            torch.float16,
            "[quant] type = 'int4wo' needs bfloat16 weights, the model is float16; set --dtype bfloat16",
        ),
        ("int4wo", "cuda", (9, 0), torch.bfloat16, None),
    ],
)
def test_hardware_requirements(
    scheme: str, device: str, capability: Any, dtype: torch.dtype, refusal: str | None
) -> None:
    assert hardware_refusal(scheme, device, capability, dtype) == refusal


@pytest.mark.parametrize(
    "args, message",
    [
        (["--quant", "fp8dq"], f"[quant] type = 'fp8dq' needs {FP8}; this run is on cpu. Use int8wo or int8dq"),
        (
            ["--quant", "fp8wo", "--gpus", "2"],
            f"[quant] type = 'fp8wo' needs {FP8}; this run is on cpu. Use int8wo or int8dq",
        ),
        (
            ["--quant", "int4wo"],
            "[quant] type = 'int4wo' needs an NVIDIA GPU of compute capability 8.0 or newer; "
            "this run is on cpu. Use int8wo or int8dq",
        ),
    ],
)
def test_unsupported_quant_type_exits_2_before_loading(args: list[str], message: str) -> None:
    result = invoke("run", "tiny-flux", "--device", "cpu", *args)
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: {message}"


def test_apply_refuses_a_scheme_the_device_cannot_run() -> None:
    pipe = fresh("flux")
    with pytest.raises(UserError, match=re.escape(f"[quant] type = 'fp8dq' needs {FP8}; this run is on cpu")):
        accel.apply(pipe, {"quant": {"type": "fp8dq"}})
    assert not quantized_names(pipe.transformer)


def test_run_reports_what_was_quantized(tmp_path) -> None:
    report = tmp_path / "q.json"
    result = invoke(
        "run",
        "tiny-flux",
        "--quant",
        "int8wo",
        "--steps",
        "2",
        "--warmup",
        "0",
        "-o",
        str(tmp_path / "q.png"),
        "--json",
        str(report),
    )
    assert result.exit_code == 0, result.output
    pipe = fresh("flux")
    blocks = {spec.attr for spec in FAMILIES["flux"].blocks}
    inside = {n for n in linear_names(pipe.transformer) if n.split(".")[0] in blocks}
    outside = len(linear_names(pipe.transformer)) - len(inside)
    assert json.loads(report.read_text())["quant"] == {
        "type": "int8wo",
        "quantized_layers": len(inside),
        "kept_layers": {"outside the repeated blocks": outside},
    }
    assert f"int8wo ({len(inside)} Linear layers; {outside} kept" in result.stdout  # the table row
