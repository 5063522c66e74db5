"""Quantization and torch.compile: transformer step time of each variant ÷ eager, in one process.

A FLUX-class transformer (the real diffusers class, random weights) runs one denoising step
(one transformer call, as FLUX.1-dev makes per step) per variant:

- eager; compile of the repeated blocks (accel's default) and of the whole transformer;
- quantized: int8wo and int8dq on a CPU, fp8dq on a GPU, each eager and compiled;
- a cached step (First Block Cache skipping all blocks after the first), eager and compiled.

Compile time (the first call) is printed apart from the step time. Quantization changes the
weights for good, so those variants run last on the same model.

    python benchmarks/optimize.py                      # CPU: a tiny-but-deep FLUX (4 + 16 blocks)
    python benchmarks/optimize.py --device cuda        # FLUX.1-dev config (19 + 38 blocks), bf16, 1024²

On a GPU the 28-step estimate (28 × step) is set against xDiT's published 1×H100 FLUX.1-dev
figures: 6.71 s eager, 4.30 s compiled (theirs are end to end, text encoders and VAE included).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from timing import median_time

XDIT_H100 = {"eager": 6.71, "compile": 4.30}  # s for 28 steps, FLUX.1-dev 1024², xDiT's published table
FLUX_DEV = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
TINY_DEEP = dict(
    patch_size=1,
    in_channels=16,
    num_layers=4,
    num_single_layers=16,
    attention_head_dim=64,
    num_attention_heads=4,
    joint_attention_dim=64,
    pooled_projection_dim=32,
    guidance_embeds=True,
    axes_dims_rope=(16, 24, 24),
)


def build(config: dict[str, Any], device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in the target dtype: a 12B model never exists in float32
    try:
        with device:
            return FluxTransformer2DModel(**config).eval()
    finally:
        torch.set_default_dtype(default)


def step_inputs(
    config: dict[str, Any], tokens: int, text: int, device: torch.device, dtype: torch.dtype
) -> dict[str, Any]:
    side = int(tokens**0.5)
    grid = torch.meshgrid(
        torch.zeros(1), torch.arange(side).float(), torch.arange(tokens // side).float(), indexing="ij"
    )
    return dict(
        hidden_states=torch.randn(1, tokens, config["in_channels"], device=device, dtype=dtype),
        encoder_hidden_states=torch.randn(1, text, config["joint_attention_dim"], device=device, dtype=dtype),
        pooled_projections=torch.randn(1, config["pooled_projection_dim"], device=device, dtype=dtype),
        timestep=torch.tensor([0.5], device=device, dtype=dtype),
        guidance=torch.tensor([3.5], device=device, dtype=dtype),
        img_ids=torch.stack(grid, -1).reshape(-1, 3).to(device),
        txt_ids=torch.zeros(text, 3, device=device),
        return_dict=False,
    )


class Bench:
    def __init__(self, model: torch.nn.Module, inputs: dict[str, Any], repeats: int, device: torch.device) -> None:
        self.model, self.inputs, self.repeats = model, inputs, repeats
        self.sync: Callable[[], None] = (
            (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        )
        self.rows: list[tuple[str, float, float | None]] = []

    @torch.no_grad()
    def time(self, name: str, compiled: bool = False) -> float:
        call = lambda: self.model(**self.inputs)  # noqa: E731
        first = None
        if compiled:
            self.sync()
            start = time.perf_counter()
            call()
            self.sync()
            first = time.perf_counter() - start
        step = median_time(call, self.repeats, self.sync, warmup=1)
        self.rows.append((name, step, first))
        print(
            f"  {name:<34} {step * 1e3:9.1f} ms" + (f"   (first call, compiling: {first:.1f} s)" if first else ""),
            flush=True,
        )
        return step


def run(
    device: torch.device,
    config: dict[str, Any],
    tokens: int,
    text: int,
    dtype: torch.dtype,
    repeats: int,
    schemes: list[str],
    whole: bool = True,
) -> None:
    from accel.cache.fbcache import FirstBlockCache
    from accel.models.flux import FAMILY
    from accel.optimize.compile import CompiledRegions
    from accel.optimize.quantize import QuantSummary, quantize_transformer

    model = build(config, device, dtype)
    inputs = step_inputs(config, tokens, text, device, dtype)
    blocks = len(model.transformer_blocks) + len(model.single_transformer_blocks)
    print(
        f"FLUX-class transformer: {len(model.transformer_blocks)} double + {len(model.single_transformer_blocks)} "
        "single "
        f"blocks, {tokens} image + {text} text tokens, {str(dtype).removeprefix('torch.')}, {device}"
    )
    bench = Bench(model, inputs, repeats, device)

    def compiled(scope: str) -> CompiledRegions:
        return CompiledRegions(model, FAMILY.blocks, scope, "default")

    eager = bench.time("eager")
    regions = compiled("blocks")
    compile_blocks = bench.time("compile (blocks)", compiled=True)
    regions.remove()
    if whole:
        regions = compiled("transformer")
        bench.time("compile (whole transformer)", compiled=True)
        regions.remove()

    cache = FirstBlockCache(model, FAMILY.blocks, threshold=1e9)
    with torch.no_grad():
        model(**inputs)  # fills the cache: every later call skips all blocks after the first
    cached = bench.time("cached step (eager)")
    cache.remove()
    regions = compiled("blocks")
    cache = FirstBlockCache(model, FAMILY.blocks, threshold=1e9)
    bench.time("cached step (compile)", compiled=True)
    cache.remove()
    regions.remove()

    quantized: dict[str, float] = {}
    for index, scheme in enumerate(schemes):
        if index:  # every scheme starts from the same unquantized weights
            model = build(config, device, dtype)
            bench.model = model
        quantize_transformer(model, QuantSummary(scheme), FAMILY.blocks, "blocks", ())
        quantized[scheme] = bench.time(f"{scheme}")
        regions = compiled("blocks")
        quantized[f"{scheme} + compile"] = bench.time(f"{scheme} + compile (blocks)", compiled=True)
        regions.remove()

    print("ratios to eager (step time; below 1 is faster):")
    for name, step, _ in bench.rows[1:]:
        print(f"  {name:<34} {step / eager:6.3f}   ({eager / step:.2f}× faster)")
    print(f"  ideal cached step (1 of {blocks} blocks)   {1 / blocks:6.3f}")
    if device.type == "cuda":
        print("28-step estimate (transformer only) vs xDiT 1×H100 (end to end):")
        print(f"  eager     {28 * eager:6.2f} s   xDiT {XDIT_H100['eager']:.2f} s")
        print(f"  compile   {28 * compile_blocks:6.2f} s   xDiT {XDIT_H100['compile']:.2f} s")
        for name, step in quantized.items():
            print(f"  {name:<9} {28 * step:6.2f} s")
        print(f"  cached step {cached * 1e3:.1f} ms (a step First Block Cache skips)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--tokens", type=int, default=None, help="image tokens (default: 1024 CPU, 4096 = 1024² on CUDA)"
    )
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--no-whole-compile",
        action="store_true",
        help="skip compiling the whole transformer (minutes at FLUX.1-dev size; gpu_check.py skips it)",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        run(
            device,
            FLUX_DEV,
            args.tokens or 4096,
            512,
            torch.bfloat16,
            args.repeats or 10,
            ["fp8dq"],
            not args.no_whole_compile,
        )
    else:
        run(
            device,
            TINY_DEEP,
            args.tokens or 1024,
            64,
            torch.float32,
            args.repeats or 7,
            ["int8wo", "int8dq"],
            not args.no_whole_compile,
        )


if __name__ == "__main__":
    main()
