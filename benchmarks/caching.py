"""Caching methods side by side: speedup and PSNR of each setting against the uncached run, accel's
methods beside diffusers' own FirstBlockCache, TaylorSeer and MagCache hooks, on one pipeline in
one process, timed interleaved (absolute times on a shared machine mean little).

The pipeline is tiny-flux with a deep FLUX.1 transformer in place of its two-block one (the real
diffusers class, 4 double + 16 single blocks, seeded random weights). Random weights change far
more from step to step than trained ones, so the PSNR of a setting here is much lower than on real
weights; what carries over is the ordering of methods at equal PSNR, not the thresholds.

    python benchmarks/caching.py [--size 128] [--steps 12] [--repeats 7] [--plot outputs/caching.png]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class Setting:
    name: str
    family: str  # "accel" or "diffusers"
    apply: Callable[[Any], Callable[[], int]]  # installs itself; returns an undo that gives the cached calls (or -1)


def deep_flux(steps: int, size: int) -> tuple[Any, dict[str, Any]]:
    import accel
    from diffusers import FluxTransformer2DModel

    pipe = accel.load_pipeline("tiny-flux")
    pipe.set_progress_bar_config(disable=True)
    config = {k: v for k, v in pipe.transformer.config.items() if not k.startswith("_")}
    torch.manual_seed(0)
    pipe.transformer = FluxTransformer2DModel.from_config({**config, "num_layers": 4, "num_single_layers": 16}).eval()
    call = dict(prompt="a red fox in the snow, photograph", height=size, width=size, num_inference_steps=steps, guidance_scale=3.5,
                output_type="np")
    return pipe, call


def accel_setting(name: str, cache: dict[str, Any]) -> Setting:
    def apply(pipe: Any) -> Callable[[], int]:
        import accel

        handle = accel.apply(pipe, {"cache": cache})

        def undo() -> int:
            stats = handle.cache_stats
            handle.remove()
            return stats.cached if stats is not None else 0

        return undo

    return Setting(name, "accel", apply)


def diffusers_setting(name: str, make_config: Callable[[], Any]) -> Setting:
    def apply(pipe: Any) -> Callable[[], int]:
        pipe.transformer.enable_cache(make_config())

        def undo() -> int:
            pipe.transformer.disable_cache()
            return -1

        return undo

    return Setting(name, "diffusers", apply)


def settings(curve: list[list[float]], steps: int) -> list[Setting]:
    from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    found = []
    for threshold in (0.3, 0.6, 1.0, 1.5):  # random weights: block 0 moves far more a step than trained ones
        found.append(accel_setting(f"fbcache {threshold}", {"threshold": threshold}))
        found.append(accel_setting(f"dbcache F2B2 {threshold}", {"threshold": threshold, "method": "dbcache", "first_blocks": 2, "last_blocks": 2}))
        found.append(accel_setting(f"dbcache F2B2+taylorseer {threshold}", {"threshold": threshold, "method": "dbcache", "first_blocks": 2,
                                                                            "last_blocks": 2, "calibrator": "taylorseer"}))
        found.append(diffusers_setting(f"diffusers FBCache {threshold}", lambda t=threshold: FirstBlockCacheConfig(threshold=t)))
    for interval in (2, 3, 4):
        found.append(accel_setting(f"taylorseer every {interval}", {"method": "taylorseer", "interval": interval}))
        found.append(diffusers_setting(f"diffusers TaylorSeer every {interval}",
                                       lambda i=interval: TaylorSeerCacheConfig(cache_interval=i, disable_cache_before_step=1, max_order=1,
                                                                                taylor_factors_dtype=torch.float32)))
    for threshold in (0.02, 0.05, 0.1, 0.2):
        found.append(accel_setting(f"magcache {threshold}", {"method": "magcache", "threshold": threshold, "mag_ratios": curve}))
        found.append(diffusers_setting(f"diffusers MagCache {threshold}",
                                       lambda t=threshold: MagCacheConfig(threshold=t, mag_ratios=curve[0], num_inference_steps=steps,
                                                                          retention_ratio=0.0)))
    return found


def psnr(output: np.ndarray, reference: np.ndarray) -> float:
    from accel.quality import psnr as measure

    return measure(output, reference)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=128, help="output height and width (128: 64 image tokens)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--plot", default="", help="write the speedup / PSNR curves to this PNG")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import accel
    from accel.tune import calibrate_magcache

    pipe, call = deep_flux(args.steps, args.size)
    run = lambda: pipe(**call, generator=torch.Generator().manual_seed(0)).images  # noqa: E731
    reference = run()
    handle = accel.apply(pipe, {})
    curve = [list(c) for c in calibrate_magcache(pipe, handle, {k: v for k, v in call.items() if k != "output_type"}, 0)]
    handle.remove()

    found = settings(curve, args.steps)
    outputs: dict[str, np.ndarray] = {}
    hits: dict[str, int] = {}
    times: dict[str, list[float]] = {setting.name: [] for setting in found}
    times["no cache"] = []
    for repeat in range(args.repeats + 1):  # the first round untimed (warm-up), then interleaved rounds
        for setting in [None, *found]:
            name = "no cache" if setting is None else setting.name
            undo = setting.apply(pipe) if setting is not None else (lambda: 0)
            start = time.perf_counter()
            output = run()
            elapsed = time.perf_counter() - start
            cached = undo()
            if repeat:
                times[name].append(elapsed)
            else:
                outputs[name], hits[name] = output, cached
    base = statistics.median(times["no cache"])
    rows = []
    for setting in found:
        speedup = base / statistics.median(times[setting.name])
        rows.append((setting.family, setting.name, speedup, psnr(outputs[setting.name], reference), hits[setting.name]))
    print(f"deep FLUX-class pipeline: 4 double + 16 single blocks, {args.size}x{args.size}, {args.steps} steps, "
          f"median of {args.repeats} interleaved runs; no cache {base * 1e3:.0f} ms")
    print(f"{'setting':36} {'speedup':>8} {'PSNR dB':>8} {'cached':>7}")
    for family, name, speedup, quality, cached in rows:
        print(f"{name:36} {speedup:8.2f} {quality:8.1f} {cached if cached >= 0 else '':>7}")
    print("\nfastest setting at each PSNR level (accel | diffusers):")
    for level in (70, 60, 50, 40, 30):
        best = {family: max(((s, n) for f, n, s, q, _ in rows if f == family and q >= level), default=None) for family in ("accel", "diffusers")}
        shown = [f"{b[0]:.2f}x ({b[1]})" if b else "none" for b in best.values()]
        print(f"  PSNR >= {level} dB: {shown[0]:40} | {shown[1]}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(figsize=(7, 4.5))
        groups: dict[str, list[tuple[float, float]]] = {}
        for family, name, speedup, quality, _ in rows:
            method = name.rsplit(" ", 1)[0] if family == "accel" or "every" not in name else name.rsplit(" ", 2)[0]
            groups.setdefault(method.replace(" every", ""), []).append((min(quality, 80.0), speedup))
        for method, points in sorted(groups.items()):
            points.sort()
            axes.plot([p[0] for p in points], [p[1] for p in points], "o--" if method.startswith("diffusers") else "o-", label=method)
        axes.set_xlabel("PSNR against the uncached run (dB, capped at 80)")
        axes.set_ylabel("speedup (CPU time)")
        axes.legend(fontsize=7)
        axes.grid(alpha=0.3)
        figure.tight_layout()
        figure.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
