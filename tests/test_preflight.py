"""Model-free refusals come first: one line, exit 2, before torch is imported and before any rank starts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from accel import preflight
from accel.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "tiny-flux.toml")  # device = "cpu"
CORES = preflight.cpu_cores()
MANY = max(64, CORES + 1)  # more processes than this machine has cores
PORT_HINT = "choose a free port or leave --master-port out to pick one"
NO_LAUNCHER = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
# main() as the console script calls it; then whether torch was imported, and the exit code.
PROBE = (
    "import sys\nfrom accel.cli import main\ntry: main(sys.argv[1:])\nexcept SystemExit as e: print('torch' in "
    "sys.modules, e.code)"
)


def _accel(*args: str, cwd: Path, **env: str) -> tuple[str, str]:
    """(stdout, stderr) of `accel ARGS` in a fresh interpreter with no GPU visible and no launcher around."""
    environ = {k: v for k, v in os.environ.items() if k not in NO_LAUNCHER}
    environ.update(CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", **env)
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args], cwd=cwd, env=environ, capture_output=True, text=True, timeout=120
    )
    return done.stdout.strip(), done.stderr.strip()


def _refused_early(args: list[str], message: str, cwd: Path, **env: str) -> None:
    stdout, stderr = _accel(*args, cwd=cwd, **env)
    assert stderr == f"error: {message}"
    assert stdout == "False 2"  # torch never imported


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port some other job listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _cores(n: int) -> str:
    return f"{n} CPU core{'s' if n > 1 else ''}"


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "adir.png").mkdir()
    (tmp_path / "reports").mkdir()
    (tmp_path / "afile").write_text("not a folder")
    (tmp_path / "taken.png").write_bytes(b"keep me")
    (tmp_path / "taken.json").write_text("{}")
    (tmp_path / "script.py").write_text("print('ran')\n")
    return tmp_path


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["run", "tiny-flux", "--out", "adir.png", "--overwrite"],
            "--out adir.png is a directory; give a file name such as adir.png/out.png",
        ),
        (
            ["run", "tiny-flux", "--out", "adir.png", "--gpus", "2"],
            "--out adir.png is a directory; give a file name such as adir.png/out.png",
        ),
        (["run", "tiny-flux", "--out", "x.jpg"], "--out x.jpg: FLUX.1 makes images, so the name must end in .png"),
        (
            ["run", "tiny-ltx2", "--pipeline", "LTX2HDRPipeline", "--out", "x.exr"],
            "--out x.exr: LTX2HDRPipeline makes linear HDR videos, so the name must end in .mp4 (an SDR preview) or "
            ".npy (the linear float32 frames)",
        ),
        (["run", "tiny-ltx2", "--out", "x.npy"], "--out x.npy: LTX-2 makes videos, so the name must end in .mp4"),
        (
            ["run", "org/model", "--out", "x.jpg"],  # a hub repo's family is known only once it loads
            "--out x.jpg: accel writes .png images, .mp4 videos, .npy linear HDR frames and .pt latents (of a "
            "multi-pass pipeline); "
            "end the name in .png, .mp4, .npy or .pt",
        ),
        (
            ["run", "tiny-flux", "--out", "afile/x.png"],
            "--out afile/x.png: afile is a file, not a folder; choose another --out",
        ),
        (
            ["run", "tiny-flux", "--out", "taken.png"],
            "taken.png already exists; pass --overwrite to replace it or choose another --out",
        ),
        (
            ["run", "tiny-flux", "--out", "taken.png", "--gpus", "2"],
            "taken.png already exists; pass --overwrite to replace it or choose another --out",
        ),
        (
            ["run", "tiny-flux", "--json", "reports", "--overwrite"],
            "--json reports is a directory; give a file name such as reports/metrics.json",
        ),
        (
            ["run", "tiny-flux", "--json", "afile/m.json"],
            "--json afile/m.json: afile is a file, not a folder; choose another --json",
        ),
        (
            ["run", "tiny-flux", "--json", "taken.json"],
            "taken.json already exists; pass --overwrite to replace it or choose another --json",
        ),
        # Unwritable: refused before the model loads, not in a traceback after the generation.
        (
            ["run", "tiny-flux", "--out", "/proc/x.png"],
            "--out /proc/x.png: cannot create files in /proc (no such file or directory); choose another --out",
        ),
        (
            ["run", "tiny-flux", "--out", "/proc/new/x.png"],
            "--out /proc/new/x.png: cannot create files in /proc (no such file or directory); choose another --out",
        ),
        (
            ["run", "tiny-flux", "--json", "/proc/x.json", "--gpus", "2"],
            "--json /proc/x.json: cannot create files in /proc (no such file or directory); choose another --json",
        ),
        (
            ["bench", RECIPE, "--markdown", "/proc/b.md"],
            "--markdown /proc/b.md: cannot create files in /proc (no such file or directory); "
            "choose another --markdown",
        ),
        (
            ["bench", RECIPE, "--json", "reports"],
            "--json reports is a directory; give a file name such as reports/bench.json",
        ),
        (
            ["bench", RECIPE, "--markdown", "taken.json"],
            "taken.json already exists; bench never overwrites, choose another name",
        ),
        (
            ["bench", RECIPE, "--out", "afile/bench"],
            "--out afile/bench: afile is a file, not a folder; choose another --out",
        ),
        (
            ["bench", RECIPE, "--out", "afile"],
            "--out afile already exists and is not an empty folder; bench never overwrites, choose another",
        ),
        (
            ["run", "tiny-flux", "--gpus", "2", "--master-port", "0"],
            "--master-port 0 is not a port number; use one from 1 to 65535 or leave --master-port out to pick one",
        ),
        (
            ["launch", "--master-port", "70000", "script.py"],
            "--master-port 70000 is not a port number; use one from 1 to 65535 or leave --master-port out to pick one",
        ),
        (["launch", "--timeout", "0", "script.py"], "--timeout must be > 0 seconds, got 0"),
    ],
)
def test_bad_paths_and_ports_are_refused_before_torch_loads(args: list[str], message: str, tree: Path) -> None:
    _refused_early(args, message, tree)
    assert (tree / "taken.png").read_bytes() == b"keep me" and (tree / "taken.json").read_text() == "{}"


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes in a read-only folder")
def test_a_read_only_folder_is_refused_before_torch_loads(tree: Path) -> None:
    (tree / "locked").mkdir(mode=0o555)
    _refused_early(
        ["run", "tiny-flux", "--out", "locked/sub/x.png"],
        "--out locked/sub/x.png: cannot create files in locked (permission denied); choose another --out",
        tree,
    )
    assert list((tree / "locked").iterdir()) == []


def test_more_processes_than_cores_are_refused_without_a_gpu(tree: Path) -> None:
    tail = f"{_cores(CORES)}; use --gpus {CORES} or fewer, or pass --oversubscribe"
    _refused_early(
        ["run", "tiny-flux", "--gpus", str(MANY)],
        f"--gpus {MANY} starts {MANY} processes, but this machine has no GPU and {tail}",
        tree,
    )
    _refused_early(
        ["run", "tiny-flux", "--gpus", str(MANY), "--device", "cpu"],
        f"--gpus {MANY} starts {MANY} processes, but they run on the CPU (device cpu) and this machine has {tail}",
        tree,
    )
    _refused_early(
        ["run", "tiny-flux", "--ring", str(MANY)],
        f"the [parallel] layout starts {MANY} processes, but this machine has no GPU and {tail}",
        tree,
    )
    _refused_early(
        ["launch", "--gpus", str(MANY), "script.py"],
        f"--gpus {MANY} starts {MANY} processes, but this machine has no GPU and {tail}",
        tree,
    )
    _refused_early(
        ["bench", RECIPE, "--gpus", str(MANY)],
        f"--gpus {MANY} starts {MANY} processes, but they run on the CPU (device cpu) and this machine has {tail}",
        tree,
    )
    per_node = (
        f"--gpus {2 * MANY} starts {MANY} processes on each node, but this machine has no GPU and "
        f"{_cores(CORES)}; use --gpus {2 * CORES} or fewer"
    )
    _refused_early(
        [
            "launch",
            "--gpus",
            str(2 * MANY),
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "192.0.2.1",
            "script.py",
        ],
        per_node + ", or pass --oversubscribe",
        tree,
    )


def test_a_port_in_use_is_refused_on_the_machine_that_hosts_the_rendezvous(tree: Path, busy_port: int) -> None:
    message = f"--master-port {busy_port} is in use on this machine (another job?); {PORT_HINT}"
    for where in (
        [],
        ["--master-addr", "127.0.0.1"],
        ["--master-addr", "localhost"],
        ["--master-addr", socket.gethostname()],
    ):
        _refused_early(["run", "tiny-flux", "--gpus", "2", *where, "--master-port", str(busy_port)], message, tree)
    _refused_early(["launch", "--master-port", str(busy_port), "script.py"], message, tree)
    # --oversubscribe lets more ranks than cores through to the next check.
    _refused_early(
        ["run", "tiny-flux", "--gpus", str(CORES + 1), "--oversubscribe", "--master-port", str(busy_port)],
        message,
        tree,
    )


def test_ranks_leave_the_launch_checks_and_existing_files_to_the_launcher(tree: Path, busy_port: int) -> None:
    """Under a launcher the port is the job's own and rank 0 may have written the outputs: a rank
    goes on to the job's own checks (here: a layout that does not fit the job, refused before torch)."""
    launcher = dict(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(busy_port))
    args = [
        "run",
        "tiny-flux",
        "--gpus",
        str(MANY),
        "--master-port",
        str(busy_port),
        "--out",
        "taken.png",
        "--json",
        "taken.json",
    ]
    misfit = (
        f"[parallel] asks for {MANY} processes, but this torchrun job has 2; make them match (--gpus 2) or run "
        "without torchrun"
    )
    stdout, stderr = _accel(*args, cwd=tree, RANK="1", **launcher)
    assert stdout == "False 2" and stderr.startswith("error: ") and stderr.endswith(misfit) and "\n" not in stderr
    stdout, stderr = _accel(*args, cwd=tree, RANK="0", **launcher)  # rank 0 still refuses to overwrite
    assert stdout == "False 2" and stderr.endswith(
        "taken.png already exists; pass --overwrite to replace it or choose another --out"
    )


def test_visible_gpus_follows_cuda_visible_devices_capped_by_the_driver(tmp_path: Path) -> None:
    none = tmp_path / "absent"
    for value, count in (
        ("", 0),
        ("-1", 0),
        ("0", 1),
        ("0,1,2", 3),
        ("0,-1,2", 1),
        (" 1 , 0 ", 2),
        ("GPU-aa,GPU-bb", 2),
        ("0,,1", 1),
    ):
        assert preflight.visible_gpus({"CUDA_VISIBLE_DEVICES": value}, none) == count, value
    assert preflight.visible_gpus({}, none) == 0
    driver = tmp_path / "gpus"
    for bus in ("0000:01:00.0", "0000:02:00.0"):
        (driver / bus).mkdir(parents=True)
    assert preflight.visible_gpus({}, driver) == 2
    assert preflight.visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, driver) == 2
    assert preflight.visible_gpus({"CUDA_VISIBLE_DEVICES": "1"}, driver) == 1
    assert preflight.visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}, driver) == 0


def test_process_count_against_gpus_and_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preflight, "cpu_cores", lambda: 2)
    monkeypatch.setattr(preflight, "_torch_build_has_gpu", lambda: True)
    monkeypatch.setattr(preflight, "visible_gpus", lambda: 0)
    preflight.check_process_count(2, "auto")
    preflight.check_process_count(64, "auto", oversubscribe=True)
    preflight.check_process_count(8, "cuda")  # no GPU for an explicit cuda: resolving the device says so
    with pytest.raises(
        UserError,
        match=r"^--gpus 3 starts 3 processes, but this machine has no GPU and 2 CPU cores; use --gpus 2 or fewer, or "
        r"pass --oversubscribe$",
    ):
        preflight.check_process_count(3, "auto")

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(preflight, "visible_gpus", lambda: 1)
    preflight.check_process_count(1, "auto")
    message = (
        r"^--gpus 8 needs 8 GPUs on this node, but 1 is visible \(CUDA_VISIBLE_DEVICES=0\); use --gpus 1 or fewer$"
    )
    with pytest.raises(UserError, match=message):
        preflight.check_process_count(8, "cuda", oversubscribe=True)  # no oversubscribing GPUs
    with pytest.raises(
        UserError, match=r"^--gpus 16 needs 8 GPUs on each node, but 1 is visible .*; use --gpus 2 or fewer$"
    ):
        preflight.check_process_count(8, "auto", nnodes=2)
    with pytest.raises(UserError, match=r"they run on the CPU \(device cpu\) and this machine has 2 CPU cores"):
        preflight.check_process_count(3, "cpu")  # GPUs here, but the run asked for the CPU

    monkeypatch.setattr(preflight, "_torch_build_has_gpu", lambda: False)  # a CPU-only torch on a GPU machine
    preflight.check_process_count(2, "auto")
    with pytest.raises(UserError, match=r"this machine has no GPU and 2 CPU cores"):
        preflight.check_process_count(3, "auto")


def test_ports_and_local_addresses(busy_port: int) -> None:
    assert not preflight.port_free(busy_port)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    assert preflight.port_free(free)
    preflight.check_master_port(None, None)
    preflight.check_master_port("192.0.2.1", busy_port)  # another machine hosts the rendezvous
    preflight.check_master_port(None, busy_port, node_rank=1)  # this node only connects to it
    for address in (None, "127.0.0.1", "localhost", "0.0.0.0", "::1", "[::1]", socket.gethostname()):
        assert preflight.is_local_address(address), address
    assert not preflight.is_local_address("192.0.2.1")  # TEST-NET-1: never this machine's
