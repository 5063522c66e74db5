"""What accel shows people: rich tables for a run, the registry and the environment; JSON (a bench's
tables: accel.bench.report; how numbers are written: accel.formatting).

Importing it loads neither torch nor the runner: `accel models` must answer in well under a second."""

from __future__ import annotations

import json
import math
import platform
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table
from rich.text import Text

from accel.files.publish import OVERWRITE_HINT, by_descriptor, write_file
from accel.formatting import (
    SINGLE_REPEAT,
    Fit,
    format_bytes,
    format_seconds,
    format_size,
    format_span,
    format_threads,
    packed,
)
from accel.models.base import Family
from accel.models.vaes import vae_plan

if TYPE_CHECKING:
    from accel.metrics import Metrics


def run_table(metrics: Metrics) -> Table:
    table = Table(title=f"accel run {metrics.model}", show_header=True, header_style="bold")
    table.add_column("measure")
    table.add_column("value", justify="right")
    written = {"frames": metrics.output_frames, "width": metrics.output_width, "height": metrics.output_height}
    size = format_size(
        dict(metrics.recipe["generate"], **{key: value for key, value in written.items() if value}), metrics.output_kind
    )
    rows: list[tuple[str, str]] = [
        ("model", f"{metrics.model} ({metrics.family}, {metrics.dtype}, {metrics.device})"),
        ("output", f"{size}, {metrics.steps} steps → {metrics.output_path}"),
        ("load", format_seconds(metrics.load_s)),
        ("warm-up (compile)" if metrics.compile else "warm-up", format_seconds(metrics.warmup_s)),
        ("generation", _timed(metrics.times_s)),
        ("per step", format_seconds(metrics.per_step_s)),
        ("steps/s", f"{metrics.steps_per_s:.2f}"),
    ]
    if metrics.cache is not None:
        cache = metrics.cache
        rows.append(
            ("cache hit rate", f"{cache['hit_rate']:.0%} ({cache['cached_calls']}/{cache['transformer_calls']} calls)")
        )
    else:
        rows.append(("cache hit rate", "off"))
    rows.append(("parallel", _parallel(metrics.parallel)))
    rows.append(("quantization", _quant(metrics.quant)))
    rows.append(("compile", _compile(metrics.compile)))
    rows.append((f"peak memory ({metrics.peak_memory_kind})", format_bytes(metrics.peak_memory_bytes)))
    if metrics.planned_peak_bytes is not None:
        rows.append(("peak memory (accel plan's estimate)", format_bytes(metrics.planned_peak_bytes)))
    if metrics.baseline_s is not None:
        rows.append(
            (
                "baseline generation",
                _timed(metrics.baseline_times_s) if metrics.baseline_times_s else format_seconds(metrics.baseline_s),
            )
        )
        rows.append(("speedup", _speedup(metrics)))
        psnr = metrics.psnr_db
        rows.append(
            ("PSNR vs baseline", "identical (∞ dB)" if psnr is not None and math.isinf(psnr) else f"{psnr:.2f} dB")
        )
        rows.append(("SSIM vs baseline", f"{metrics.ssim:.4f}" if metrics.ssim is not None else "—"))
    if metrics.threads is not None and metrics.device.startswith("cpu"):
        rows.append(("CPU threads", format_threads(metrics.threads)))
    for name, value in rows:
        table.add_row(name, value)
    return table


def _timed(times: list[float]) -> str:
    """'52.1 ms (49.0–60.2 ms)': the median and min–max of the timed runs; one run says so."""
    if len(times) == 1:
        return f"{format_seconds(times[0])} ({SINGLE_REPEAT})"
    return f"{format_seconds(statistics.median(times))} ({format_span(min(times), max(times))})"


def _speedup(metrics: Metrics) -> str:
    """'1.52× (1.31–1.80×, interleaved)': the speedup and its spread over the repeats (Metrics.speedup_spread)."""
    spread = metrics.speedup_spread
    if metrics.speedup is None or spread is None:
        return "—"
    if len(metrics.times_s) == 1 and len(metrics.baseline_times_s) == 1:
        return f"{metrics.speedup:.2f}× ({SINGLE_REPEAT}: noisy, use --repeats 5)"
    return f"{metrics.speedup:.2f}× ({spread[0]:.2f}–{spread[1]:.2f}×, {metrics.compare_order})"


def run_document(metrics: Metrics, argv: list[str]) -> dict[str, Any]:
    """The `accel run --json` document: the metrics, the command line that ran and the versions it ran with."""
    return {**metrics.as_dict(), "command": ["accel", *argv], "versions": versions()}


def versions() -> dict[str, str]:
    """Python's and the stack's versions, as `accel env` and the run JSON give them."""
    import importlib.metadata as metadata

    found = {"python": platform.python_version()}
    for package in ("accel", "torch", "diffusers", "transformers", "torchao"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def _parallel(parallel: dict[str, Any] | None) -> str:
    if parallel is None:
        return "off (1 process)"
    layout = " × ".join(
        f"{name} {parallel[name]}" for name in ("tp", "ulysses", "ring", "cfg") if parallel.get(name, 1) > 1
    )
    vae = ", VAE decode split" if parallel.get("vae_split") else ""
    if parallel.get("plan") not in (None, "family"):  # learned from the model and verified, not a family's tested plan
        vae = f", {'automatic plan' if parallel['plan'] == 'automatic' else parallel['plan']} (verified)" + vae
    # Only the sequence degrees are ever chosen: CFG halves and TP are the user's ask (--cfg-parallel, --tp).
    picked = " × ".join(f"{name} {parallel[name]}" for name in ("ulysses", "ring") if parallel[name] > 1)
    if parallel["chosen"] and picked and parallel["cfg"] == 1 and parallel.get("tp", 1) == 1:
        return f"{layout} (chosen for {parallel['world_size']} processes){vae}"
    if parallel["chosen"] and picked:
        return f"{layout} on {parallel['world_size']} processes ({picked} chosen){vae}"
    return f"{layout} on {parallel['world_size']} processes{vae}"


def _quant(quant: dict[str, Any] | None) -> str:
    if quant is None:
        return "off"
    kept = sum(quant["kept_layers"].values())
    return f"{quant['type']} ({quant['quantized_layers']} Linear layers; {kept} kept in the model dtype)"


def _compile(compiled: dict[str, Any] | None) -> str:
    if compiled is None:
        return "off"
    what = f"{compiled['compiled_modules']} blocks" if compiled["scope"] == "blocks" else "whole transformer"
    text = f"{what}, mode {compiled['mode']}"
    if compiled["graphs_timed"] is not None:
        text += f"; graphs built: {compiled['graphs_warmup']} in warm-up, {compiled['graphs_timed']} in the timed run"
    return text


def traffic_table(metrics: Metrics) -> Table:
    """Bytes rank 0 sent through each kind of collective during the timed run, for --verbose."""
    table = Table(title="Bytes sent by rank 0", header_style="bold")
    table.add_column("collective")
    table.add_column("bytes sent", justify="right")
    table.add_column("per step", justify="right")
    sent = (metrics.parallel or {}).get("bytes_sent_per_rank")
    if sent is None:
        table.add_row("not counted with --compile", "—", "—")
        return table
    for kind, nbytes in sorted(sent.items()):
        table.add_row(kind, format_bytes(nbytes), format_bytes(nbytes // max(1, metrics.steps)))
    table.add_row("total", format_bytes(sum(sent.values())), format_bytes(sum(sent.values()) // max(1, metrics.steps)))
    return table


def cache_calls_table(metrics: Metrics) -> Table:
    """Per-call decisions of the cache, for --verbose."""
    table = Table(title="First Block Cache calls", header_style="bold")
    for column in ("step", "branch", "relative change", "cached"):
        table.add_column(column, justify="right")
    for call in (metrics.cache or {}).get("calls", []):
        change = "—" if call["change"] is None else f"{call['change']:.4f}"
        table.add_row(str(call["step"]), str(call["branch"]), change, "yes" if call["cached"] else "")
    return table


def write_json(document: dict[str, Any], path: Path, *, replace: bool = False, hint: str = OVERWRITE_HINT) -> Path:
    """JSON with inf/nan written as strings so every reader can parse it. Written whole
    (accel.files); an existing file is refused (UserError) unless `replace`."""
    text = json.dumps(_finite(document), indent=2) + "\n"
    return write_file(path, by_descriptor(lambda file: file.write(text.encode())), replace=replace, hint=hint)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def family_features(family: Family) -> list[str]:
    """What accel can do for a family today, derived from its data."""
    features = ["fbcache"] if family.blocks else []
    own = next((variant for variant in family.variants if variant.pipeline_class == family.pipeline_class), None)
    if family.parallel is not None and (own is None or own.not_split is None):  # Qwen-Image 2.1's sequence is not cut
        features.append("ulysses/ring/usp")
    if family.parallel is not None and family.cfg is not None:
        features.append(f"cfg: {'batched' if family.cfg == 'batch' else 'two calls'}")
    features.append("vae-tiling")
    methods = dict.fromkeys(
        plan.method for plan in map(vae_plan, family.vaes) if plan is not None
    )  # its variants' VAEs too
    features += [f"vae: {method}-parallel" for method in methods]
    if family.blocks:
        features += ["quant", "compile"]
    return features


# Under `accel models`: where to look for a pipeline the registry does not list.
INSPECT_HINT = (
    "tested: a family accel was taught and tests; for any other pipeline, accel inspect MODEL says what accel finds"
)


def models_table(families: list[Family]) -> Fit:
    """One row a family where the terminal is wide enough for whole names, else a block a family."""
    return Fit(lambda _width: _models_wide(families), lambda width: _models_blocks(families, width))


def _models_wide(families: list[Family]) -> Table:
    table = Table(title="accel models", header_style="bold", caption=INSPECT_HINT)
    for column in ("alias", "tested", "tiny", "pipeline", "default repo", "kind", "accelerators"):
        table.add_column(column, no_wrap=True)
    for family in families:
        table.add_row(
            family.name,
            "tested",
            family.tiny_alias or "—",
            "\n".join(family.pipeline_classes),
            family.repo,
            "\n".join(_kinds(family)),
            "\n".join(family_features(family)),
        )
    return table


def _kinds(family: Family) -> list[str]:
    return [*family.outputs, *(["+ audio"] if family.audio is not None else [])]


def _models_blocks(families: list[Family], width: int) -> Table:
    """A narrow terminal's registry: the alias, then its tiny alias, outputs and default repo, its
    pipelines and its accelerators, each list broken only between names."""
    table = Table.grid(padding=(0, 1, 1, 0))
    table.title = "accel models"
    table.caption = INSPECT_HINT
    alias_width = max(len(family.name) for family in families)
    table.add_column("alias", style="bold", no_wrap=True, width=alias_width)
    rest = max(20, width - alias_width - 2)  # each column is padded by one on its right
    table.add_column("what", no_wrap=True)
    for family in families:
        head = packed(
            ["tested", f"tiny: {family.tiny_alias or '—'}", ", ".join(_kinds(family)), family.repo], rest, " · "
        )
        lines = [head, packed(family.pipeline_classes, rest, ", "), packed(family_features(family), rest, " · ")]
        table.add_row(family.name, Text("\n".join(lines)))
    return table


def environment() -> dict[str, Any]:
    """Versions, devices and attention kernels, as `accel env` prints them."""
    import torch

    from accel.preflight import cpu_cores
    from accel.threads import cpu_threads

    with cpu_threads(torch.device("cpu")) as threads:  # what a CPU run here would use
        pass
    plural = "s" if threads.count > 1 else ""
    devices = [
        f"cpu ({platform.machine()}, {cpu_cores()} cores; {threads.count} thread{plural} per run: {threads.source})"
    ]
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            devices.append(
                f"cuda:{index} {props.name} ({props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor})"
            )
    return {"versions": versions(), "devices": devices, "attention_kernels": attention_kernels()}


def attention_kernels() -> dict[str, bool]:
    """The (out, lse) attention kernels this torch build offers; context parallelism picks from these."""
    import torch

    aten = torch.ops.aten
    kernels = {"cpu flash (out + lse)": hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu")}
    cuda = torch.cuda.is_available()
    backends = torch.backends.cuda
    kernels["cuda flash"] = cuda and bool(getattr(backends, "is_flash_attention_available", lambda: False)())
    kernels["cuda memory-efficient"] = cuda and bool(backends.mem_efficient_sdp_enabled())
    kernels["cuda cuDNN"] = cuda and bool(getattr(backends, "cudnn_sdp_enabled", lambda: False)())
    return kernels


def environment_table(env: dict[str, Any]) -> Table:
    table = Table(title="accel env", header_style="bold", show_header=False)
    table.add_column("what")
    table.add_column("value")
    for name, version in env["versions"].items():
        table.add_row(name, version)
    for index, device in enumerate(env["devices"]):
        table.add_row("devices" if index == 0 else "", device)
    for index, (kernel, present) in enumerate(env["attention_kernels"].items()):
        table.add_row("attention kernels" if index == 0 else "", f"{kernel}: {'yes' if present else 'no'}")
    return table
