"""One GPU check: the CUDA-only tests and every benchmark's --device cuda section, in one command.

No GPU is lent to development or CI machines, so the GPU figures in BENCHMARKS.md are taken in one
short session on a borrowed one (an H100, at most about 9 minutes a command). This runs each step
as a subprocess with its own time budget (sizes and repeats chosen so the budgets add up to less
than 9 minutes; a step that runs past its budget is stopped and what it printed is kept), then
prints one Markdown block to paste into BENCHMARKS.md (device, versions, date, each step's
output) and writes it to --out. Steps that need more GPUs than are visible are skipped with the
reason. Exit status: 0 all ran, 1 a step failed or ran out of time, 2 no CUDA device here.

    python benchmarks/gpu_check.py [--dry-run] [--only tests,optimize] [--out outputs/gpu-check.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT_S = 540  # a borrowed GPU machine runs one command for about 9 minutes
NO_GPU = "gpu-check needs an NVIDIA GPU: torch sees no CUDA device here (--dry-run prints the plan)"


@dataclass(frozen=True)
class Step:
    name: str
    args: tuple[str, ...]  # after `python`
    budget_s: int
    what: str
    gpus: int = 1


# Budgets: what each step took on the lent H100s (2026-11-27 and -28, cold caches: 57, 13, 39, 26, 38, 45, 33, 48 s
# in plan order) with room to spare; sizes and repeats are cut from the
# scripts' defaults only where the default would not fit (each flag is named in its script).
PLAN: tuple[Step, ...] = (
    Step(
        "tests",
        ("-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu.py"),
        80,
        "CUDA-only tests: attention kernels vs the reference, cache, int8wo / fp8dq, compile on tiny-flux",
    ),
    Step(
        "context_parallel",
        ("benchmarks/context_parallel.py", "--device", "cuda", "--skip-cpu-ranks", "--repeats", "3"),
        40,
        "per-rank attention time, fake process group, FLUX-1024 shapes bf16 (sections 1-2 are CPU figures, skipped)",
    ),
    Step(
        "vae_parallel",
        ("benchmarks/vae_parallel.py", "--device", "cuda", "--repeats", "1"),
        60,
        "per-rank VAE decode time and peak memory, fake process group, FLUX 2048² and Wan 720p×81",
    ),
    Step(
        "family_parallel-flux",
        (
            "benchmarks/family_parallel.py",
            "--device",
            "cuda",
            "--skip-cpu-ranks",
            "--families",
            "flux",
            "--repeats",
            "2",
        ),
        50,
        "per-rank transformer forward, fake process group, FLUX.1-dev 1024² bf16",
    ),
    Step(
        "family_parallel-wan",
        (
            "benchmarks/family_parallel.py",
            "--device",
            "cuda",
            "--skip-cpu-ranks",
            "--families",
            "wan",
            "--repeats",
            "1",
        ),
        60,
        "per-rank transformer forward, fake process group, Wan 2.1 14B 720p×33 bf16",
    ),
    Step(
        "optimize",
        ("benchmarks/optimize.py", "--device", "cuda", "--repeats", "3", "--no-whole-compile"),
        100,
        "FLUX.1-dev step: eager, regional compile, cached step, fp8dq (+ compile)",
    ),
    Step(
        "plan_check",
        ("benchmarks/plan_check.py",),
        60,
        "accel plan's fake-CUDA estimate against torch.cuda.max_memory_allocated: FLUX.1-dev and Wan 14B forward, VAE "
        "decodes",
    ),
    Step(
        "offload",
        ("benchmarks/offload.py", "--device", "cuda"),
        90,
        "[memory] offload none / model / group: GPU peak and time, a 2.5 GB FLUX-class transformer in bf16",
    ),
    Step(
        "tiny-flux-2gpus",
        (
            "-m",
            "accel.cli",
            "run",
            "tiny-flux",
            "--device",
            "cuda",
            "--gpus",
            "2",
            "--ulysses",
            "2",
            "--parallel-vae",
            "--compare",
            "--out",
            "outputs/gpu-check/tiny-flux-ulysses2.png",
            "--overwrite",
        ),
        60,
        "real NCCL ranks: Ulysses 2 + parallel VAE against one GPU",
        gpus=2,
    ),
)


@dataclass
class Result:
    step: Step
    status: str  # "ok", "failed (exit N)", "stopped at its budget", "skipped: …"
    seconds: float = 0.0
    stdout: str = ""
    stderr: str = ""


def command(step: Step) -> str:
    return " ".join(["python", *step.args])


def plan_text(steps: tuple[Step, ...], gpus: int | None) -> str:
    """The plan as printed by --dry-run: budget, name and command per step, and the total that runs."""
    lines = []
    for step in steps:
        skip = skip_reason(step, gpus)
        lines.append(f"{step.budget_s:>5} s  {step.name:<22} {command(step)}" + (f"   [{skip}]" if skip else ""))
    total = sum(step.budget_s for step in steps if skip_reason(step, gpus) is None)
    lines.append(f"total budget {total} s of {LIMIT_S} s")
    return "\n".join(lines)


def skip_reason(step: Step, gpus: int | None) -> str | None:
    """Why a step cannot run with `gpus` visible (None: it can; gpus None: not known, dry run)."""
    if gpus is None:
        return f"needs {step.gpus} GPUs" if step.gpus > 1 else None
    return f"skipped: needs {step.gpus} GPUs, {gpus} visible" if step.gpus > gpus else None


def run_step(step: Step, log_dir: Path) -> Result:
    """Run one step in its own process group, so a step stopped at its budget takes its spawned ranks with it."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, *step.args],
        cwd=ROOT,
        env=env,
        text=True,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        stdout, stderr = process.communicate(timeout=step.budget_s)
        status = "ok" if process.returncode == 0 else f"failed (exit {process.returncode})"
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        status = "stopped at its budget"
    result = Result(step, status, time.perf_counter() - start, stdout, stderr)
    (log_dir / f"{step.name}.log").write_text(f"$ {command(step)}\n{stdout}\n--- stderr ---\n{stderr}")
    return result


def environment() -> str:
    """Device and versions, the line a reader needs to compare figures."""
    import torch

    def version(package: str) -> str:
        try:
            return __import__(package).__version__
        except ImportError:
            return "not installed"

    props = torch.cuda.get_device_properties(0)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return (
        f"{props.name} (compute capability {props.major}.{props.minor}, {props.total_memory / 2**30:.0f} GiB), "
        f"{torch.cuda.device_count()} visible; torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {cudnn}, "
        f"diffusers {version('diffusers')}, torchao {version('torchao')}, Python {platform.python_version()}"
    )


def summary(result: Result) -> str:
    """pytest's last line for the tests; the status for the rest."""
    if result.step.name == "tests" and result.stdout.strip():
        return f"{result.status}: {result.stdout.strip().splitlines()[-1].strip('= ')}"
    return result.status


def markdown(results: list[Result], env: str) -> str:
    today = datetime.date.today().isoformat()
    out = [
        f"### GPU check ({today}, `make gpu-check`)",
        "",
        env,
        "",
        "| step | command | budget | took | result |",
        "|---|---|--:|--:|---|",
    ]
    for r in results:
        took = f"{r.seconds:.0f} s" if r.seconds else "—"
        out.append(f"| {r.step.name} | `{command(r.step)}` | {r.step.budget_s} s | {took} | {summary(r)} |")
    for r in results:
        if r.status.startswith("skipped"):
            continue
        out += ["", f"#### {r.step.name}: {r.step.what}", "", "```text", r.stdout.rstrip()]
        if r.status != "ok" and r.stderr.strip():  # the reason is at the end of stderr
            out += ["--- stderr (last 20 lines) ---", *r.stderr.rstrip().splitlines()[-20:]]
        out.append("```")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="print the plan (commands, budgets) and run nothing")
    parser.add_argument("--only", default="", help="comma-separated step names (default: all)")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "gpu-check.md")
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(names) - {step.name for step in PLAN})
    if unknown:
        parser.error(f"--only: unknown step {', '.join(unknown)}; steps are: {', '.join(step.name for step in PLAN)}")
    steps = tuple(step for step in PLAN if not names or step.name in names)
    if args.dry_run:
        print(plan_text(steps, None))
        return 0

    import torch

    if not torch.cuda.is_available():
        print(NO_GPU, file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count()
    env = environment()
    log_dir = args.out.parent / "gpu-check"
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"gpu-check: {env}\n{plan_text(steps, gpus)}", file=sys.stderr, flush=True)
    results = []
    for step in steps:
        reason = skip_reason(step, gpus)
        if reason:
            results.append(Result(step, reason))
            continue
        print(f"gpu-check: {step.name} (budget {step.budget_s} s) …", file=sys.stderr, flush=True)
        results.append(run_step(step, log_dir))
        print(
            f"gpu-check: {step.name}: {results[-1].status} in {results[-1].seconds:.0f} s", file=sys.stderr, flush=True
        )
    block = markdown(results, env)
    args.out.write_text(block)
    print(block)
    print(f"gpu-check: written to {args.out}; full logs in {log_dir}/", file=sys.stderr)
    return 0 if all(r.status == "ok" or r.status.startswith("skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
