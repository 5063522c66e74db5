"""Caching methods side by side: speedup and PSNR of each setting against the uncached run, accel's
methods beside diffusers' own FirstBlockCache, TaylorSeer and MagCache hooks and cache-dit's
DBCache (with and without its TaylorSeer calibrator), on one pipeline in one process, timed
interleaved (absolute times on a shared machine mean little).

Two families, each the real diffusers transformer class made deep with seeded random weights:
FLUX.1 (tiny-flux with 4 double + 16 single blocks) and Wan 2.1 (tiny-wan with 20 blocks, a few
frames, CFG on). Random weights change far more from step to step than trained ones, so the PSNR
of a setting here is much lower than on real weights; what carries over is the ordering of methods
at equal PSNR, not the thresholds.

cache-dit is optional (`pip install accel[bench]`); without it its settings are skipped with one line.

    python benchmarks/caching.py [--family flux|wan|all] [--steps 12] [--repeats 7] [--plot
    outputs/caching-{family}.png]
"""

from __future__ import annotations

import argparse
import copy
import importlib
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

LEVELS = (70, 60, 50, 40, 30)


@dataclass
class Setting:
    name: str
    family: str  # "accel", "diffusers" or "cache-dit"
    apply: Callable[[Any], Callable[[], int]]  # installs itself; returns an undo that gives the cached calls (or -1)


@dataclass
class Family:
    """One deep pipeline to compare on: how to build it, what its output is called, its title line."""

    name: str
    build: Callable[[argparse.Namespace], tuple[Any, dict[str, Any]]]
    output: str  # "images" or "frames"
    title: str


def deep_flux(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    import accel
    from diffusers import FluxTransformer2DModel

    pipe = accel.load_pipeline("tiny-flux")
    pipe.set_progress_bar_config(disable=True)
    config = {k: v for k, v in pipe.transformer.config.items() if not k.startswith("_")}
    torch.manual_seed(0)
    pipe.transformer = FluxTransformer2DModel.from_config({**config, "num_layers": 4, "num_single_layers": 16}).eval()
    call = dict(
        prompt="a red fox in the snow, photograph",
        height=args.size,
        width=args.size,
        num_inference_steps=args.steps,
        guidance_scale=3.5,
        output_type="np",
    )
    return pipe, call


def deep_wan(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    import accel
    from diffusers import WanTransformer3DModel

    pipe = accel.load_pipeline("tiny-wan")
    pipe.set_progress_bar_config(disable=True)
    config = {k: v for k, v in pipe.transformer.config.items() if not k.startswith("_")}
    torch.manual_seed(0)
    pipe.transformer = WanTransformer3DModel.from_config({**config, "num_layers": 20}).eval()
    call = dict(
        prompt="a red fox running in the snow",
        negative_prompt="blurry",
        height=args.video_size,
        width=args.video_size,
        num_frames=args.frames,
        num_inference_steps=args.steps,
        guidance_scale=5.0,
        max_sequence_length=args.text_tokens,
        output_type="np",
    )
    return pipe, call


FAMILIES = {
    "flux": Family("flux", deep_flux, "images", "deep FLUX.1 (4 double + 16 single blocks)"),
    "wan": Family("wan", deep_wan, "frames", "deep Wan 2.1 (20 blocks, CFG 5.0)"),
}


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


_CACHE_DIT_COPIES: dict[int, Any] = {}


def cache_dit_setting(name: str, steps: int, first: int, last: int, threshold: float, taylorseer: bool) -> Setting:
    """cache-dit's DBCache on a copy of the transformer (same weights): enabling it replaces the
    FLUX transformer's and single blocks' forward for good, which the other settings must not run."""

    def apply(pipe: Any) -> Callable[[], int]:
        import cache_dit

        original = pipe.transformer
        pipe.transformer = _CACHE_DIT_COPIES.setdefault(id(original), copy.deepcopy(original))
        cache_dit.enable_cache(
            pipe,
            cache_config=cache_dit.DBCacheConfig(
                Fn_compute_blocks=first,
                Bn_compute_blocks=last,
                residual_diff_threshold=threshold,
                max_warmup_steps=1,
                num_inference_steps=steps,
            ),
            calibrator_config=cache_dit.TaylorSeerCalibratorConfig(taylorseer_order=1) if taylorseer else None,
        )

        def undo() -> int:
            stats = cache_dit.summary(pipe, logging=False)
            cached = len(stats[0].cached_steps) + len(stats[0].cfg_cached_steps) if stats else -1  # cond, uncond
            cache_dit.disable_cache(pipe)
            pipe.transformer = original
            return cached

        return undo

    return Setting(name, "cache-dit", apply)


def have_cache_dit() -> bool:
    os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "error")  # read when cache_dit is imported
    try:
        importlib.import_module("cache_dit")
    except ImportError as error:
        print(f"cache-dit is not installed ({error}); its settings are skipped (pip install accel[bench])")
        return False
    return True


def settings(family: str, curve: list[list[float]], steps: int, peers: tuple[str, ...]) -> list[Setting]:
    from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    found = []
    # Random weights: block 0 moves far more a step than trained ones (FLUX here 0.3-0.6, Wan 0.06-0.12).
    thresholds = (0.3, 0.6, 1.0) if family == "flux" else (0.08, 0.1, 0.15)
    for threshold in thresholds:
        found.append(
            diffusers_setting(f"diffusers FBCache {threshold}", lambda t=threshold: FirstBlockCacheConfig(threshold=t))
        )
        for first, last in ((1, 0), (8, 0), (4, 4)):
            for taylorseer in (False, True):
                label = "+taylorseer" if taylorseer else ""
                method = {"method": "dbcache", "first_blocks": first, "last_blocks": last} if first > 1 else {}
                name = f"fbcache{label} {threshold}" if first == 1 else f"dbcache F{first}B{last}{label} {threshold}"
                found.append(
                    accel_setting(
                        name, {"threshold": threshold, **method, "calibrator": "taylorseer" if taylorseer else "none"}
                    )
                )
                # cache-dit's residual_diff_threshold is the same relative L1 of the first blocks' residual as accel's
                # threshold.
                found.append(
                    cache_dit_setting(
                        f"cache-dit F{first}B{last}{label} {threshold}", steps, first, last, threshold, taylorseer
                    )
                )
    # diffusers' TaylorSeer hooks modules named *attn by default: FLUX's attn, none of Wan's (attn1, attn2).
    attention = None if family == "flux" else [r"blocks\.\d+\.attn[12]"]
    for interval in (2, 3, 4):
        found.append(accel_setting(f"taylorseer every {interval}", {"method": "taylorseer", "interval": interval}))
        found.append(
            accel_setting(
                f"taylorseer early every {interval}",
                {"method": "taylorseer", "interval": interval, "extrapolate_early": True},
            )
        )
        # diffusers' own schedule: step 0, one reused step, then every interval-th from step 2.
        found.append(
            accel_setting(
                f"taylorseer early+1 every {interval}",
                {
                    "method": "taylorseer",
                    "interval": interval,
                    "disable_before": 1,
                    "interval_offset": 1,
                    "extrapolate_early": True,
                },
            )
        )
        found.append(
            diffusers_setting(
                f"diffusers TaylorSeer every {interval}",
                lambda i=interval: TaylorSeerCacheConfig(
                    cache_interval=i,
                    disable_cache_before_step=1,
                    max_order=1,
                    taylor_factors_dtype=torch.float32,
                    cache_identifiers=attention,
                ),
            )
        )
    for interval in (2, 3):
        found.append(
            accel_setting(
                f"taylorseer from 1 every {interval}",
                {"method": "taylorseer", "interval": interval, "disable_before": 1},
            )
        )
    for threshold in (0.02, 0.05, 0.1, 0.2):
        found.append(
            accel_setting(f"magcache {threshold}", {"method": "magcache", "threshold": threshold, "mag_ratios": curve})
        )
        # diffusers' MagCache stops after 3 skipped steps in a row (max_skip_steps); accel's limit is off unless set.
        found.append(
            accel_setting(
                f"magcache max 3 {threshold}",
                {"method": "magcache", "threshold": threshold, "mag_ratios": curve, "max_consecutive_cached": 3},
            )
        )
        found.append(
            diffusers_setting(
                f"diffusers MagCache {threshold}",
                lambda t=threshold: MagCacheConfig(
                    threshold=t, mag_ratios=curve[0], num_inference_steps=steps, retention_ratio=0.0
                ),
            )
        )
    return [s for s in found if s.family == "accel" or s.family in peers]


def psnr(output: np.ndarray, reference: np.ndarray) -> float:
    from accel.quality import psnr as measure

    return measure(output, reference)


def measure(
    family: Family, args: argparse.Namespace, peers: tuple[str, ...]
) -> list[tuple[str, str, float, float, int]]:
    """Every setting and the uncached run, interleaved; rows of (family, name, speedup, PSNR, cached)."""
    import accel
    from accel.tune import calibrate_magcache

    pipe, call = family.build(args)
    run = lambda: getattr(pipe(**call, generator=torch.Generator().manual_seed(0)), family.output)  # noqa: E731
    reference = run()
    handle = accel.apply(pipe, {})
    curve = [
        list(c) for c in calibrate_magcache(pipe, handle, {k: v for k, v in call.items() if k != "output_type"}, 0)
    ]
    handle.remove()

    found = [
        s for s in settings(family.name, curve, args.steps, peers) if not args.only or s.name in args.only.split(",")
    ]
    outputs: dict[str, np.ndarray] = {}
    hits: dict[str, int] = {}
    times: dict[str, list[float]] = {setting.name: [] for setting in found}
    times["no cache"] = []
    for repeat in range(args.repeats + 1):  # the first round untimed (warm-up), then interleaved rounds
        # A new order each round: a setting that always ran right after the same other one read up
        # to 5 % off at identical decisions (allocator and cache state carry over between runs).
        order = [None, *found]
        if repeat:
            random.Random(repeat).shuffle(order)
        for setting in order:
            name = "no cache" if setting is None else setting.name
            undo = setting.apply(pipe) if setting is not None else (lambda: 0)
            start = time.process_time()  # this process's CPU time: what other jobs on a shared machine disturb least
            output = run()
            elapsed = time.process_time() - start
            cached = undo()
            if repeat:
                times[name].append(elapsed)
            else:
                outputs[name], hits[name] = output, cached
    base = statistics.median(times["no cache"])
    calls = args.steps * (2 if family.name == "wan" else 1)
    shape = (
        f"{args.size}x{args.size}"
        if family.name == "flux"
        else f"{args.frames} frames {args.video_size}x{args.video_size}, {args.text_tokens} text tokens"
    )
    print(
        f"\n{family.title}, {shape}, {args.steps} steps ({calls} transformer calls), median CPU time of "
        f"{args.repeats} interleaved runs; "
        f"no cache {base * 1e3:.0f} ms"
    )
    print(f"{'setting':40} {'speedup':>8} {'PSNR dB':>8} {'cached':>7}")
    rows = []
    for setting in found:
        row = (
            setting.family,
            setting.name,
            base / statistics.median(times[setting.name]),
            psnr(outputs[setting.name], reference),
            hits[setting.name],
        )
        rows.append(row)
        print(f"{row[1]:40} {row[2]:8.2f} {row[3]:8.1f} {row[4] if row[4] >= 0 else '':>7}")
    return rows


def best_at_levels(rows: list[tuple[str, str, float, float, int]], peers: tuple[str, ...]) -> None:
    print(
        f"\nfastest setting at each PSNR level (accel | {' | '.join(peers)}), and whether accel is at least as fast "
        "as the best peer:"
    )
    for level in LEVELS:
        # A setting as exact as the uncached run (infinite PSNR) cached nothing: it is no cache, not a method.
        best = {
            group: max(
                (
                    (speed, name)
                    for g, name, speed, quality, _ in rows
                    if g == group and level <= quality < float("inf")
                ),
                default=None,
            )
            for group in ("accel", *peers)
        }
        shown = [f"{b[0]:.2f}x ({b[1]})" if b else "none" for b in best.values()]
        peer_best = max((b[0] for g, b in best.items() if g != "accel" and b), default=0.0)
        met = "met" if best["accel"] and best["accel"][0] >= peer_best else "NOT met"
        print(f"  PSNR >= {level} dB: {' | '.join(shown)}  -> {met}")


def plot(rows: list[tuple[str, str, float, float, int]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 5.5))
    groups: dict[str, list[tuple[float, float]]] = {}
    for _, name, speedup, quality, _ in rows:  # one curve per setting name without its last word (the swept value)
        method = name.rsplit(" ", 1)[0]
        method = method.rsplit(" every", 1)[0] if " every" in method else method
        groups.setdefault(method, []).append((min(quality, 80.0), speedup))
    styles = {"diffusers": "s--", "cache-dit": "^:"}
    colours = plt.get_cmap("tab20")
    for index, (method, points) in enumerate(sorted(groups.items())):
        points.sort()
        style = next((v for k, v in styles.items() if method.startswith(k)), "o-")
        axes.plot(
            [p[0] for p in points], [p[1] for p in points], style, label=method, markersize=4, color=colours(index % 20)
        )
    for level in (70, 60, 50):
        axes.axvline(level, color="grey", alpha=0.3)
    axes.set_title(title, fontsize=9)
    axes.set_xlabel("PSNR against the uncached run (dB, capped at 80)")
    axes.set_ylabel("speedup (CPU time)")
    axes.legend(fontsize=6, ncol=2)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"wrote {path}")


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=[*FAMILIES, "all"], default="all")
    parser.add_argument("--size", type=int, default=128, help="FLUX output height and width (128: 64 image tokens)")
    parser.add_argument("--video-size", type=int, default=128, help="Wan output height and width")
    parser.add_argument("--frames", type=int, default=5, help="Wan frames (4k + 1; 5 at 128: 2x8x8 = 128 video tokens)")
    parser.add_argument(
        "--text-tokens", type=int, default=64, help="Wan text length (the pipeline pads the prompt to it)"
    )
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-peers", action="store_true", help="accel's settings only")
    parser.add_argument(
        "--only", default="", help="comma-separated setting names to run (a head-to-head with more repeats)"
    )
    parser.add_argument(
        "--plot", default="", help="write the speedup / PSNR curves to this PNG; {family} is replaced by the family"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    peers = () if args.no_peers else ("diffusers", "cache-dit") if have_cache_dit() else ("diffusers",)
    for name in FAMILIES if args.family == "all" else [args.family]:
        family = FAMILIES[name]
        rows = measure(family, args, peers)
        best_at_levels(rows, peers)
        if args.plot:
            plot(
                rows,
                args.plot.replace("{family}", name),
                f"{family.title}, {args.steps} steps, median of {args.repeats} interleaved runs",
            )


if __name__ == "__main__":
    main()
