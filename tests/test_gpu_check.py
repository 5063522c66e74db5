"""`make gpu-check` (benchmarks/gpu_check.py) on a CPU machine: its plan covers every benchmark with a
CUDA section and the CUDA-only tests within one borrowed command's time, and without a GPU it
refuses in one line. The GPU figures are owed until someone runs it; a benchmark that is not in
its plan would silently never be measured on a GPU."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def check(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120
    )


def cuda_benchmarks() -> list[str]:
    """Benchmark scripts that take a --device option, i.e. have a CUDA section to measure."""
    return sorted(
        path.name
        for path in (ROOT / "benchmarks").glob("*.py")
        if re.search(r"add_argument\(\s*\"--device\"", path.read_text())
    )


def test_dry_run_plans_every_cuda_benchmark_and_the_cuda_tests_within_the_limit() -> None:
    result = check("--dry-run")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    step_lines = [line for line in lines if re.match(r"\s*\d+ s  ", line)]
    commands = [line.split("python ", 1)[1] for line in step_lines]
    assert len(cuda_benchmarks()) >= 4  # the scan itself finds the scripts
    for script in cuda_benchmarks():
        runs = [c for c in commands if c.startswith(f"benchmarks/{script} ")]
        assert runs, f"benchmarks/{script} has a --device option but gpu_check.py does not run it"
        assert all("--device cuda" in c for c in runs)
    assert any("pytest" in c and "tests/test_gpu.py" in c for c in commands)
    # What runs on one GPU fits one borrowed command: the budgets add up to the stated total, ≤ 9 min.
    one_gpu = [int(line.split()[0]) for line in step_lines if "needs " not in line]
    total = re.fullmatch(r"total budget (\d+) s of (\d+) s", lines[-1])
    assert total and int(total[1]) == sum(one_gpu) <= int(total[2]) <= 540
    assert any("--gpus 2" in line and "[needs 2 GPUs]" in line for line in step_lines)


def test_only_selects_steps_and_refuses_unknown_names() -> None:
    result = check("--dry-run", "--only", "tests,optimize")
    steps = [line for line in result.stdout.splitlines() if re.match(r"\s*\d+ s  ", line)]
    assert [line.split()[2] for line in steps] == ["tests", "optimize"]
    refused = check("--dry-run", "--only", "nope")
    assert refused.returncode == 2 and "unknown step nope" in refused.stderr


def test_without_cuda_it_exits_2_with_one_line() -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU even on a machine that has one
    result = check(env=env)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "gpu-check needs an NVIDIA GPU: torch sees no CUDA device here (--dry-run prints the plan)"
    ]


def load_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def alive(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def test_a_step_past_its_budget_is_stopped_with_its_children_and_reported(tmp_path: Path) -> None:
    """A benchmark that spawns ranks and overruns must not leave them holding the GPU for the next step."""
    check_module = load_check()
    Step, Result = check_module.Step, check_module.Result
    code = (
        "import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; "
        "time.sleep(60)']); "
        "print('child', child.pid, flush=True); time.sleep(60)"
    )
    slow = check_module.run_step(Step("slow", ("-c", code), 3, "outlives its budget"), tmp_path)
    failing = check_module.run_step(
        Step("failing", ("-c", "import sys; print('partial'); sys.exit('broken here')"), 30, "fails"), tmp_path
    )
    assert slow.status == "stopped at its budget" and 3 <= slow.seconds < 30
    child = int(slow.stdout.split()[1])
    for _ in range(50):
        if not alive(child):
            break
        time.sleep(0.1)
    assert not alive(child), "the step's own child process outlived the step"
    assert failing.status == "failed (exit 1)" and failing.stdout == "partial\n"
    assert f"child {child}" in (tmp_path / "slow.log").read_text()

    skipped = Result(Step("two", ("-c", "pass"), 9, "needs two", gpus=2), "skipped: needs 2 GPUs, 1 visible")
    block = check_module.markdown([slow, failing, skipped], "GPU X, torch Y")
    assert "GPU X, torch Y" in block
    assert re.search(r"^\| slow \| `python -c .*` \| 3 s \| \d+ s \| stopped at its budget \|$", block, re.M)
    assert "| two | `python -c pass` | 9 s | — | skipped: needs 2 GPUs, 1 visible |" in block
    assert f"```text\nchild {child}\n```" in block  # what it printed before it was stopped
    assert "partial\n--- stderr (last 20 lines) ---\nbroken here\n```" in block
    assert "#### two" not in block
