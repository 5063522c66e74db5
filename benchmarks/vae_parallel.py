"""Parallel VAE decode: decode time and peak memory per rank, split over ranks against one process.

Ratios measured side by side in one run (absolute times on a shared machine mean little):

1. CPU (default): a random-weight AutoencoderKL with FLUX.1's VAE config (128-512 channels,
   16 latent channels, mid-block attention) decodes a 1024x1024 image in float32: one process
   x 1 thread against 2 gloo ranks x 1 thread. Reported: decode time (the slower rank) and the
   peak resident memory each rank added while decoding (VmHWM reset first; weights and latents
   excluded), with their ratios to one process. A third run decodes the two halves side by side
   with no exchange at all: the most two ranks of this machine can give.
2. --device cuda: one process plays rank 0 of N with the "fake" process group (collectives
   move nothing, so this is per-rank compute and memory) for N = 1, 2, 4, 8 in bf16: the FLUX
   VAE at 2048x2048 and Wan 2.1's VAE at 1280x720, 81 frames. Rank 0 is the one that also
   receives the whole image, so its memory is the largest. --smoke runs that code on the CPU at
   small sizes.

    python benchmarks/vae_parallel.py [--size 1024] [--device cpu|cuda] [--smoke] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from ranks import join_gloo

from accel.launch.environment import free_port
from timing import median_time


def flux_vae() -> Any:
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(128, 256, 512, 512),
        layers_per_block=2,
        latent_channels=16,
        norm_num_groups=32,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ).eval()


def wan_vae() -> Any:
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    return AutoencoderKLWan().eval()  # the class defaults are Wan 2.1's VAE


def _resident_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _cpu_rank(rank: int, world: int, port: int, size: int, split: bool, results: Any) -> None:
    if split:
        join_gloo(rank, world, port)
    else:
        torch.set_num_threads(1)
    from accel.vae import ParallelDecode, plan_for

    vae = flux_vae()
    rows = size // 8 if split or world == 1 else size // 8 // world  # unsplit ranks decode their band alone
    latents = torch.randn((1, 16, rows, size // 8), generator=torch.Generator().manual_seed(1))
    engine = ParallelDecode(vae, plan_for(vae)) if split else None
    before = _resident_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # restart the peak-resident count from now
    start = time.perf_counter()
    with torch.no_grad():
        vae.decode(latents, return_dict=False)
    seconds = time.perf_counter() - start
    peak = (_resident_kib("VmHWM") - before) * 1024
    if engine is not None:
        engine.remove()
    results.put((rank, seconds, peak))


def cpu(size: int) -> None:
    context = mp.get_context("spawn")
    rows = []
    runs = {"1 process": (1, False), "2 ranks, split": (2, True), "2 processes, half each, no exchange": (2, False)}
    for label, (world, split) in runs.items():
        results = context.Queue()
        port = free_port()
        processes = [
            context.Process(target=_cpu_rank, args=(r, world, port, size, split, results)) for r in range(world)
        ]
        for process in processes:
            process.start()
        measured = sorted(results.get() for _ in range(world))
        for process in processes:
            process.join()
        rows.append((max(m[1] for m in measured), max(m[2] for m in measured)))
        print(f"  {label}: decode {rows[-1][0]:.1f} s, peak added per rank {rows[-1][1] / 2**30:.2f} GiB", flush=True)
    (one_s, one_peak), (two_s, two_peak), (bound_s, _) = rows
    print(f"\nFLUX VAE, {size}x{size}, float32, CPU: 2 ranks vs 1")
    print(
        f"  decode time      {two_s:.1f} s vs {one_s:.1f} s  -> {one_s / two_s:.2f}x speedup "
        f"(this machine's bound, two halves decoded side by side with no exchange: {one_s / bound_s:.2f}x)"
    )
    print(
        f"  peak per rank    {two_peak / 2**30:.2f} GiB vs {one_peak / 2**30:.2f} GiB  -> "
        f"{two_peak / one_peak:.2f} of one process"
    )


def fake_ranks(device: str, smoke: bool, repeats: int = 3) -> None:
    """Per-rank decode time and peak memory as rank 0 of N (fake process group)."""
    cases = {
        "FLUX VAE 2048x2048": (flux_vae, (1, 16, 256, 256)),
        "Wan 2.1 VAE 1280x720x81": (wan_vae, (1, 16, 21, 90, 160)),
    }
    if smoke:
        cases = {
            "FLUX VAE 256x256": (flux_vae, (1, 16, 32, 32)),
            "Wan 2.1 VAE 128x128x5": (wan_vae, (1, 16, 2, 16, 16)),
        }
    for name, (build, shape) in cases.items():
        _fake_case(name, build(), shape, device, repeats=1 if smoke else repeats)


def _fake_case(name: str, vae: Any, shape: tuple[int, ...], device: str, repeats: int) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from accel.vae import ParallelDecode, plan_for

    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    vae = vae.to(device, dtype)
    latents = torch.randn(shape, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def decode() -> None:
        with torch.no_grad():
            vae.decode(latents, return_dict=False)

    baseline: tuple[float, int] | None = None
    print(f"\n{name}, {dtype}, {device}: rank 0 of N (fake process group)")
    for world in (1, 2, 4, 8):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        engine = ParallelDecode(vae, plan_for(vae)) if world > 1 else None
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if cuda else 0
        seconds = median_time(decode, repeats=repeats, sync=sync, warmup=1)
        peak = torch.cuda.max_memory_allocated() - before if cuda else 0
        if engine is not None:
            engine.remove()
        dist.destroy_process_group()
        baseline = baseline or (seconds, peak)
        memory = f", peak {peak / 2**30:.2f} GiB ({peak / baseline[1]:.2f} of 1)" if cuda else ""
        print(f"  N={world}: {seconds * 1000:.0f} ms ({baseline[0] / seconds:.2f}x){memory}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1024, help="image side for the CPU comparison")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--smoke", action="store_true", help="run the fake-rank section on the CPU at small sizes")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed decodes per N on CUDA (gpu_check.py uses 1 to fit its budget)"
    )
    args = parser.parse_args()
    if args.device == "cuda":
        fake_ranks("cuda", smoke=False, repeats=args.repeats)
        return
    if args.smoke:
        fake_ranks("cpu", smoke=True)
    cpu(args.size)


if __name__ == "__main__":
    main()
