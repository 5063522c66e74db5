"""[memory] offload: GPU memory and time of none / model / group, side by side in one run.

A FLUX-class pipeline with the tiny variant's text encoders and VAE and a real-width transformer
(24 heads x 128, random weights, bf16), one generation per mode, from a fresh pipeline in host
memory each time; the peak is torch.cuda.max_memory_allocated over the generation (the load's
placement included). Output compared with the unoffloaded one (max abs difference of the image).

    python benchmarks/offload.py [--device cuda] [--layers 4 --single-layers 8] [--size 512] [--steps 4]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import accel

GiB = 2**30


def pipeline(layers: int, single: int, heads: int, dtype: torch.dtype) -> object:
    import diffusers

    pipe = accel.load_pipeline("tiny-flux", "float32", "cpu")
    pipe.to(dtype)
    config = pipe.transformer.config
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype: a float32 build and cast takes twice the time and memory
    try:
        transformer = diffusers.FluxTransformer2DModel(
            in_channels=config.in_channels,
            num_layers=layers,
            num_single_layers=single,
            attention_head_dim=128,
            num_attention_heads=heads,
            joint_attention_dim=config.joint_attention_dim,
            pooled_projection_dim=config.pooled_projection_dim,
            guidance_embeds=config.guidance_embeds,
            axes_dims_rope=(16, 56, 56),
        )
    finally:
        torch.set_default_dtype(previous)
    pipe.register_modules(transformer=transformer.eval())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--single-layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    call = dict(prompt="a fox", num_inference_steps=args.steps, height=args.size, width=args.size, output_type="np")
    base: tuple[float, int, np.ndarray] | None = None
    print(
        f"FLUX-class transformer {args.layers} + {args.single_layers} blocks, {args.heads} heads x 128, "
        f"{args.size}x{args.size}, "
        f"{args.steps} steps, {str(dtype).removeprefix('torch.')}, {args.device}",
        flush=True,
    )
    print(
        f"   {'offload':<8}{'generation':>12}{'÷ none':>9}{'peak GPU':>11}{'÷ none':>9}{'max |diff|':>12}   "
        "(transformer weights)",
        flush=True,
    )
    for mode in ("none", "model", "group"):
        pipe = pipeline(args.layers, args.single_layers, args.heads, dtype)
        weights = sum(p.numel() * p.element_size() for p in pipe.transformer.parameters())
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        if mode == "none":
            pipe.to(args.device)
            handle = accel.apply(pipe, {"model": {"device": args.device}})
        else:
            handle = accel.apply(pipe, {"model": {"device": args.device}, "memory": {"offload": mode}})
        pipe(**call, generator=torch.Generator().manual_seed(0))  # warm-up (kernels, streams)
        warm = time.perf_counter()
        image = pipe(**call, generator=torch.Generator().manual_seed(0)).images
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - warm
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        handle.remove()
        del pipe, handle
        base = base or (seconds, peak, image)
        base_s, base_peak, base_image = base
        ratio = f"{peak / base_peak:>9.3f}" if base_peak else f"{'—':>9}"
        print(
            f"   {mode:<8}{seconds:>11.3f}s{seconds / base_s:>9.2f}{peak / GiB:>10.2f}G{ratio}"
            f"{float(np.abs(image - base_image).max()):>12.2e}   ({weights / GiB:.2f} GiB; "
            f"{time.perf_counter() - start:.0f} s in all)",
            flush=True,
        )


if __name__ == "__main__":
    main()
