"""How `accel tune --target` searches: cache settings in lines, each ordered by one knob.

Along a line (one method, its block counts and calibrator; the threshold or interval varies) more
caching means a higher hit rate, more speed and less quality, so the most caching setting that
meets the target is found by bisection. The search stays cheap: a line's most caching setting is
measured first, and a line whose fastest setting cannot beat the best found so far is dropped;
bisection stops once a failing setting is no faster than the best (every passing one below it is
slower still); a setting stops at the first prompt that misses the target. Measuring is a
callable, so the search is the same on one process, under torchrun, and in tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from accel.cache.config import CACHE_METHODS
from accel.errors import UserError
from accel.recipe.checks import suggest
from accel.tune.target import Target

# Thresholds from 0.005 to 1.28, each √2 above the last: FBCache-style relative changes and
# MagCache's accumulated error both live in this range; 17 rungs take 5 measurements to bisect.
THRESHOLDS: tuple[float, ...] = tuple(float(f"{0.005 * 2 ** (k / 2):.3g}") for k in range(17))
INTERVALS: tuple[int, ...] = (2, 3, 4, 5, 6, 8)
# dbcache's (first_blocks, last_blocks), tried where they leave at least half the blocks to cache.
BLOCK_COUNTS: tuple[tuple[int, int], ...] = ((2, 0), (1, 1), (4, 0), (2, 2), (8, 0), (4, 4))
WARMUPS: tuple[int, ...] = (1, 2, 4)


@dataclass(frozen=True)
class Line:
    """Settings that differ in `knob` only, from least to most caching."""

    name: str
    base: Mapping[str, Any]
    knob: str
    values: tuple[Any, ...]

    def setting(self, index: int) -> dict[str, Any]:
        return {**self.base, self.knob: self.values[index]}


@dataclass
class Trial:
    """One setting as measured: speedup (mean over prompts) and the worst prompt's quality.

    `prompts` counts the prompts measured; fewer than all when it stopped early (`stopped` says
    why), and then `meets` is False (a prompt missed) or None (slower than the best: not needed)."""

    line: str
    cache: dict[str, Any]
    speedup: float
    psnr_db: float
    ssim: float
    hit_rate: float
    prompts: int
    meets: bool | None
    stopped: str | None = None
    pareto: bool = False
    retimed: float | None = None  # the speedup timed again, interleaved with the baseline (finalists only)

    @property
    def final_speedup(self) -> float:
        return self.retimed if self.retimed is not None else self.speedup

    @property
    def complete(self) -> bool:
        return self.stopped is None


# (cache keys, line name, speedup to beat) -> the trial, measured prompt by prompt.
Probe = Callable[[dict[str, Any], str, float], Trial]


@dataclass
class Search:
    target: Target
    probe: Probe
    trials: list[Trial] = field(default_factory=list)
    best: Trial | None = None

    @property
    def to_beat(self) -> float:
        """Speedup a new setting must exceed to matter: the best found, else none (0)."""
        return self.best.speedup if self.best is not None else 0.0

    def measure(self, line: Line, index: int) -> Trial:
        trial = self.probe(line.setting(index), line.name, self.to_beat)
        self.trials.append(trial)
        if trial.meets and trial.hit_rate > 0 and trial.speedup > self.to_beat:
            self.best = trial
        return trial

    def run_line(self, line: Line) -> None:
        """The most caching setting of `line` that meets the target, by bisection."""
        top = self.measure(line, len(line.values) - 1)
        if top.meets or top.speedup <= self.to_beat:
            return  # nothing on the line is faster than its top, which meets or cannot win
        passing, failing = -1, len(line.values) - 1  # -1: the uncached run, which meets any target
        while failing - passing > 1:
            middle = (passing + failing) // 2
            trial = self.measure(line, middle)
            if trial.meets is False:
                failing = middle
                if trial.speedup <= self.to_beat:
                    return  # every setting below it caches less, so is slower still
            else:
                passing = middle


def parse_methods(text: str) -> frozenset[str]:
    """`--methods fbcache,taylorseer`: the cache methods to search, named as the recipe's `[cache] method`;
    a typo is refused here, before any rank starts, rather than leaving nothing to search."""
    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    if not names:
        raise UserError(
            f"--methods is empty: name one or more cache methods, comma-separated ({', '.join(CACHE_METHODS)})"
        )
    for name in names:
        if name not in CACHE_METHODS:
            raise UserError(
                f"--methods {text}: unknown cache method {name!r}{suggest(name, CACHE_METHODS, repr, 'methods')}"
            )
    return frozenset(names)


def lines(
    blocks: int,
    steps: int,
    mag_ratios: tuple[tuple[float, ...], ...] | None,
    methods: frozenset[str] | None = None,
) -> list[Line]:
    """Every line worth a look on a transformer of `blocks` blocks over `steps` steps, roughly
    from the usual winners to the rest (an early winner lets later lines stop sooner); only those of
    `methods` (None: all) when the user knows which methods they can deploy or wants a quicker search."""
    found = [
        Line("fbcache", {"method": "fbcache"}, "threshold", THRESHOLDS),
        Line("fbcache + taylorseer", {"method": "fbcache", "calibrator": "taylorseer"}, "threshold", THRESHOLDS),
    ]
    for first, last in BLOCK_COUNTS:
        if first + last <= blocks // 2:
            base = {"method": "dbcache", "first_blocks": first, "last_blocks": last}
            found.append(Line(f"dbcache F{first}B{last}", base, "threshold", THRESHOLDS))
            found.append(
                Line(
                    f"dbcache F{first}B{last} + taylorseer",
                    {**base, "calibrator": "taylorseer"},
                    "threshold",
                    THRESHOLDS,
                )
            )
    intervals = tuple(i for i in INTERVALS if i < steps)
    if intervals:
        found.append(Line("taylorseer", {"method": "taylorseer"}, "interval", intervals))
        found.append(
            Line("taylorseer early", {"method": "taylorseer", "extrapolate_early": True}, "interval", intervals)
        )
        # diffusers' TaylorSeer schedule: step 0, one reused step, then every interval-th from step 2.
        found.append(
            Line(
                "taylorseer early+1",
                {"method": "taylorseer", "extrapolate_early": True, "disable_before": 1, "interval_offset": 1},
                "interval",
                intervals,
            )
        )
    if mag_ratios:
        found.append(Line("magcache", {"method": "magcache", "mag_ratios": mag_ratios}, "threshold", THRESHOLDS))
    return [line for line in found if methods is None or line.base["method"] in methods]


def warmup_lines(line: Line, steps: int) -> list[Line]:
    """`line` again with more of the first steps always computed: a later start can allow a
    higher threshold (or a longer interval) at the same quality."""
    key = "disable_before" if line.base.get("method") == "taylorseer" else "warmup_steps"
    have = line.base.get(key, 0)
    return [
        Line(f"{line.name}, {key} {w}", {**line.base, key: w}, line.knob, line.values)
        for w in WARMUPS
        if w != have and w < steps // 2
    ]


def run_search(
    target: Target,
    probe: Probe,
    blocks: int,
    steps: int,
    mag_ratios: tuple[tuple[float, ...], ...] | None,
    announce: Callable[[str], None] = lambda _line: None,
    methods: frozenset[str] | None = None,
) -> Search:
    """Every line (of `methods`, None: all), then the winning line with longer warm-ups."""
    search = Search(target, probe)
    candidates = lines(blocks, steps, mag_ratios, methods)
    if not candidates:  # only a filter empties it: fbcache always has a line
        names = sorted(methods or ())
        raise UserError(
            f"--methods {','.join(names)}: no {' or '.join(names)} setting fits this pipeline ({blocks} blocks, "
            f"{steps} steps); add another method"
        )
    for line in candidates:
        announce(f"line {line.name}")
        search.run_line(line)
    if search.best is not None:
        winner = next(line for line in candidates if line.name == search.best.line)
        for line in warmup_lines(winner, steps):
            announce(f"line {line.name}")
            search.run_line(line)
    return search


def finalists(search: Search, count: int = 3) -> list[Trial]:
    """The fastest few complete settings that meet the target and cache something: the search's
    timings are one per setting, so the choice among close ones is timed again."""
    meeting = [t for t in search.trials if t.complete and t.meets and t.hit_rate > 0]
    return sorted(meeting, key=lambda t: -t.speedup)[:count]


def choose(search: Search) -> Trial | None:
    """The fastest finalist by its re-timed speedup."""
    timed = [t for t in search.trials if t.retimed is not None]
    return max(timed, key=lambda t: t.final_speedup) if timed else search.best


def mark_pareto(trials: Sequence[Trial], target: Target) -> None:
    """A complete trial is on the front when no other complete one is both at least as fast and at
    least as good in the targeted metric, and better in one of them."""
    complete = [t for t in trials if t.complete]
    for trial in complete:
        quality = target.of(trial.psnr_db, trial.ssim)
        speed = trial.final_speedup
        trial.pareto = not any(
            other.final_speedup >= speed
            and target.of(other.psnr_db, other.ssim) >= quality
            and (other.final_speedup > speed or target.of(other.psnr_db, other.ssim) > quality)
            for other in complete
            if other is not trial
        )


def describe(cache: Mapping[str, Any]) -> str:
    """A setting in a few words: method, block counts, calibrator, knob, warm-up (not MagCache's curve)."""
    words = [str(cache["method"])]
    if cache["method"] == "dbcache":
        words.append(f"F{cache.get('first_blocks', 1)}B{cache.get('last_blocks', 0)}")
    if cache.get("calibrator", "none") != "none":
        words.append(f"+{cache['calibrator']}")
    if cache["method"] == "taylorseer":
        words.append(f"every {cache['interval']}" + (" early" if cache.get("extrapolate_early") else ""))
        if cache.get("interval_offset"):
            words.append(f"offset {cache['interval_offset']}")
    else:
        words.append(f"t={_value(cache['threshold'])}")
    for key, name in (("warmup_steps", "warm-up"), ("disable_before", "from step")):
        if cache.get(key):
            words.append(f"{name} {cache[key]}")
    return " ".join(words)


def _value(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) and not math.isinf(value) else str(value)
