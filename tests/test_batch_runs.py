"""`accel batch` as a user runs it, on tiny-flux: interrupted by Ctrl-C, killed, rerun, each item
ends done exactly once and equals `accel run`; the README's Slurm array script, as two tasks (one
with two replicas), covers every item once with the same outputs; bad input is one line before any
rank starts; the README's Kubernetes manifests validate against the API's schemas and their
commands parse as accel's options."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import kubernetes_validate
import pytest
import commands
import typer.main
import yaml
from cli_runs import accel_run
from typer.testing import CliRunner

from accel.cli import app

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SECTION = README.split("## Batch jobs: `accel batch`", 1)[1].split("\n## ", 1)[0]
ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
BIN = str(Path(sys.executable).parent)
RUN_S = 300  # loading and eight tiny generations on a busy 2-core machine
STEPS = "6"
# Eight requests: a custom_id, an OpenAI batch line, two images from one line, a bad line in the middle.
REQUESTS = [
    {"custom_id": "fox", "prompt": "a red fox in the snow", "seed": 7, "size": "64x48"},
    {"prompt": "a boat at dawn", "n": 2},
    {"custom_id": "city", "method": "POST", "url": "/v1/images/generations", "body": {"prompt": "a city at night"}},
    {"prompt": "a field of tulips", "colour": "red"},
    {"prompt": "a lighthouse"},
    {"prompt": "a mountain lake", "seed": 3},
    {"custom_id": "owl", "prompt": "an owl"},
    {"prompt": "a desert road"},
    {"prompt": "a snowy forest", "size": "64x64"},
]
FILES = {
    "fox": ["fox.png"],
    "000002": ["000002_0.png", "000002_1.png"],
    "city": ["city.png"],
    "000005": ["000005.png"],
    "000006": ["000006.png"],
    "owl": ["owl.png"],
    "000008": ["000008.png"],
    "000009": ["000009.png"],
}


def _requests(folder: Path) -> Path:
    path = folder / "requests.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in REQUESTS))
    return path


def _batch(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return commands.popen(
        [sys.executable, "-m", "accel.cli", "batch", *args],
        cwd=cwd,
        env=env or ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _records(out: Path) -> list[dict[str, object]]:
    return [json.loads(line) for path in sorted(out.glob("manifest*.jsonl")) for line in path.open()]


def _stop_after_new_records(process: subprocess.Popen[str], out: Path, sig: int, past: int) -> tuple[str, str]:
    """Send `sig` as soon as the manifest has a record more than `past`, while items are left."""
    deadline = time.monotonic() + RUN_S
    while time.monotonic() < deadline and process.poll() is None:
        if (out / "manifest.jsonl").exists() and len(_records(out)) > past:
            process.send_signal(sig)
            break
        time.sleep(0.02)
    stdout, stderr = process.communicate(timeout=RUN_S)
    assert len(_records(out)) < len(FILES), "the batch ended before it was stopped"
    return stdout, stderr


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The batch on one process, stopped by Ctrl-C, then killed, then rerun to its end."""
    folder = tmp_path_factory.mktemp("batch")
    requests = _requests(folder)
    out = folder / "out"
    args = (str(requests), "tiny-flux", "--out", str(out), "--steps", STEPS)
    interrupted = _batch(*args, cwd=folder)
    stdout, stderr = _stop_after_new_records(interrupted, out, signal.SIGINT, 0)
    assert interrupted.returncode == 130, stderr[-3000:]
    assert "interrupted: the items left are not recorded; rerun the same command to resume" in stdout
    killed = _batch(*args, cwd=folder)
    _stop_after_new_records(killed, out, signal.SIGKILL, len(_records(out)))
    assert killed.returncode == -signal.SIGKILL
    finished = _batch(*args, cwd=folder)
    stdout, stderr = finished.communicate(timeout=RUN_S)
    assert finished.returncode == 0, stderr[-3000:]
    before = len(_records(out)) - int(re.search(r"batch: 8 items: (\d+) done", stdout).group(1))  # type: ignore[union-attr]
    assert f"batch: 8 items: {8 - before} done, {before} done before, 1 bad line skipped; outputs in {out}" in stdout
    assert f"skipped {requests} line 4: colour: not a field of this endpoint" in stdout
    return out


def test_a_batch_stopped_and_killed_midway_ends_with_each_item_done_once(one_process: Path) -> None:
    records = _records(one_process)
    assert sorted(record["key"] for record in records) == sorted(FILES)  # once each, nothing failed
    assert all(record["status"] == "done" for record in records)
    assert {record["key"]: record["files"] for record in records} == FILES
    # What the killed run was writing is gone: the folder holds the outputs and the manifest.
    assert sorted(p.name for p in one_process.iterdir()) == sorted(
        ["manifest.jsonl", *(name for names in FILES.values() for name in names)]
    )
    seeds = {record["key"]: record["seeds"] for record in records}
    assert seeds["fox"] == [7] and seeds["000002"] == [4, 5] and seeds["city"] == [8]


def test_a_batch_output_equals_accel_run(one_process: Path, tmp_path: Path) -> None:
    out = tmp_path / "fox.png"
    result = accel_run(
        *["tiny-flux", "--prompt", "a red fox in the snow", "--seed", "7"],
        *["--width", "64", "--height", "48", "--steps", STEPS, "--out", str(out)],
        threads=1,  # as the batch's process (OMP_NUM_THREADS=1): the bytes are compared
    )
    assert result.exit_code == 0, result.output[-3000:]
    assert out.read_bytes() == (one_process / "fox.png").read_bytes()


def _slurm_script() -> str:
    return SECTION.split("```bash\n#!/bin/bash\n", 1)[1].split("```", 1)[0]


def test_the_readme_slurm_array_covers_every_item_once_and_replicas_equal_one_process(
    one_process: Path, tmp_path: Path
) -> None:
    script = tmp_path / "accel-batch.sbatch"
    script.write_text("#!/bin/bash\n" + _slurm_script())
    requests = _requests(tmp_path)
    out = tmp_path / "results"
    tasks = []
    for task, gpus, extra in ((0, "2", ["--replicas", "2"]), (1, "1", [])):
        env = dict(
            ENV,
            PATH=f"{BIN}:{ENV['PATH']}",
            SLURM_ARRAY_TASK_ID=str(task),
            SLURM_ARRAY_TASK_COUNT="2",
            REQUESTS=str(requests),
            MODEL="tiny-flux",
            OUT=str(out),
            GPUS=gpus,
        )
        tasks.append(
            subprocess.Popen(
                ["bash", str(script), "--steps", STEPS, *extra],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for task in tasks:
        stdout, stderr = task.communicate(timeout=RUN_S)
        assert task.returncode == 0, stderr[-3000:]
    shards = {path.name: [json.loads(line)["key"] for line in path.open()] for path in out.glob("manifest*.jsonl")}
    # The file's non-blank lines 0, 2, 4, 6, 8 for task 0; 1, 3 (the bad one), 5, 7 for task 1.
    assert shards == {
        "manifest.shard-0-of-2.jsonl": shards["manifest.shard-0-of-2.jsonl"],
        "manifest.shard-1-of-2.jsonl": shards["manifest.shard-1-of-2.jsonl"],
    }
    assert sorted(shards["manifest.shard-0-of-2.jsonl"]) == ["000005", "000009", "city", "fox", "owl"]
    assert sorted(shards["manifest.shard-1-of-2.jsonl"]) == ["000002", "000006", "000008"]
    for names in FILES.values():  # two replicas and one process: the bytes of the one-process batch
        for name in names:
            assert (out / name).read_bytes() == (one_process / name).read_bytes(), name
    header = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", _slurm_script(), re.M))
    assert header["array"] == "0-7" and "gpus-per-task" in header


runner = CliRunner()


STRICT = "; fix the file, or run without --strict to skip such lines"
BAD_INPUT = [
    (["{requests}", "tiny-flux"], "--out is required: the folder the outputs and the manifest go to"),
    (["-o", "{folder}/x", "--shard", "2/2"], "--shard 2/2: the index counts from 0, so it must be below 2"),
    (["-o", "{folder}/x", "--retries", "-1"], "--retries must be >= 0, got -1"),
    (
        ["-o", "{folder}/x", "--gpus", "3", "--replicas", "2"],
        "--gpus 3: it must be a multiple of --replicas (2), each replica gets --gpus / --replicas",
    ),
    (
        ["{folder}/missing.jsonl", "tiny-flux", "-o", "{folder}/x"],
        "REQUESTS {folder}/missing.jsonl: cannot read it (no such file or directory)",
    ),
    (["{folder}/empty.jsonl", "tiny-flux", "-o", "{folder}/x"], "REQUESTS {folder}/empty.jsonl: no request in it"),
    (["-o", "{folder}/x", "--strict"], "{requests} line 4: colour: not a field of this endpoint" + STRICT),
    (
        ["{requests}", "tiny-wan", "-o", "{folder}/x", "--strict"],
        "{requests} line 2: n: not a field of this endpoint (and 2 more)" + STRICT,
    ),
]


@pytest.mark.parametrize(("args", "message"), BAD_INPUT)
def test_bad_input_is_one_line_before_any_rank_starts(args: list[str], message: str, tmp_path: Path) -> None:
    requests = _requests(tmp_path)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    if args[0] == "-o":  # the file and the model as the first case gives them
        args = ["{requests}", "tiny-flux", *args]
    given = [arg.format(requests=requests, folder=tmp_path) for arg in args]
    result = runner.invoke(app, ["batch", *given], env={"COLUMNS": "400"})
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1] == "error: " + message.format(requests=requests, folder=tmp_path)
    assert not (tmp_path / "x").exists()  # nothing written


def _manifests() -> list[dict[str, object]]:
    blocks = re.findall(r"```yaml\n(.*?)```", SECTION, re.S)
    return [document for block in blocks for document in yaml.safe_load_all(block)]


def _parses(argv: list[str]) -> dict[str, object]:
    """accel's own parser over a command line (no run): every flag real, every value its type."""
    assert argv[0] == "accel"
    command = typer.main.get_command(app).commands[argv[1]]  # type: ignore[attr-defined]
    with command.make_context(argv[1], list(argv[2:]), resilient_parsing=False) as context:
        return dict(context.params)


def test_the_readme_kubernetes_manifests_validate_and_their_commands_parse() -> None:
    documents = _manifests()
    assert [document["kind"] for document in documents] == ["Job", "Deployment", "Service"]
    for document in documents:
        kubernetes_validate.validate(document, "1.30", strict=True)  # raises naming the field
    job, deployment, service = documents
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["parallelism"] <= spec["completions"]
    (container,) = spec["template"]["spec"]["containers"]
    assert container["command"] == ["sh", "-c"]
    line = container["args"][0].removeprefix("exec ")
    for index in range(spec["completions"]):  # as sh expands it in pod `index`
        argv = line.replace('"${JOB_COMPLETION_INDEX}', f'"{index}').replace('"', "").split()
        params = _parses(argv)
        assert params["shard"] == f"{index}/{spec['completions']}" and params["out"] is not None
    (server,) = deployment["spec"]["template"]["spec"]["containers"]
    params = _parses([str(arg) for arg in server["args"]])
    port = server["ports"][0]
    assert params["port"] == port["containerPort"] and params["host"] == "0.0.0.0"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[probe]["httpGet"] == {"path": "/health", "port": port["name"]}
    # The grace period outlasts the drain (and the cancel after it): accepted requests finish on a rollout.
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= params["drain"] + 20
    assert service["metadata"]["name"] in params["trusted_hosts"]
    assert service["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]
