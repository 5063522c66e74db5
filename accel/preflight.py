"""Checks that need no model, run by the CLI before torch is imported and before any rank starts.

Each one turns a failure that used to come late (an IsADirectoryError after the whole generation,
torchrun's 30 s of rendezvous retries on a taken port, 64 ranks exhausting a 2-core machine's memory)
into one line at start-up. Standard library only: importing torch alone takes seconds.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import re
import socket
import tempfile
from collections.abc import Mapping
from pathlib import Path

from accel.errors import UserError

OUTPUT_SUFFIXES = (
    ".png",
    ".mp4",
    ".npy",
    ".pt",
)  # what some pipeline writes (accel.models.base.OUTPUT_FILES; .pt: a pass's latents); outputs.check_out matches it
LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "0.0.0.0", "::1", "::"})
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # one entry per GPU where the NVIDIA driver is loaded


# --- output paths ---------------------------------------------------------------------------


def check_out(out: Path | None, overwrite: bool) -> None:
    """`accel run --out`. Whether the model makes images or videos is known only once it resolves,
    so outputs.check_out refuses the wrong one of .png / .mp4; here, names no family could use."""
    if out is None:
        return
    _check_file_target(out, "--out", "out.png")
    if out.suffix.lower() not in OUTPUT_SUFFIXES:
        raise UserError(
            f"--out {out}: accel writes .png images, .mp4 videos, .npy linear HDR frames and .pt latents (of a "
            "multi-pass "
            "pipeline); end the name in .png, .mp4, .npy or .pt"
        )
    if os.path.lexists(out) and not overwrite:
        raise UserError(f"{_existing(out)} already exists; pass --overwrite to replace it or choose another --out")


def check_json(path: Path | None, overwrite: bool) -> None:
    """`accel run --json`: written after the generation, so a bad path must be refused before it."""
    if path is None:
        return
    _check_file_target(path, "--json", "metrics.json")
    if os.path.lexists(path) and not overwrite:
        raise UserError(f"{_existing(path)} already exists; pass --overwrite to replace it or choose another --json")


def check_report(path: Path | None, flag: str, check_exists: bool = True) -> None:
    """`accel bench --json / --markdown`: bench never overwrites a report."""
    if path is None:
        return
    _check_file_target(path, flag, "bench.json" if flag == "--json" else "bench.md")
    if check_exists and os.path.lexists(path):
        raise UserError(f"{_existing(path)} already exists; bench never overwrites, choose another name")


def check_bench_folder(out: Path | None, check_exists: bool = True) -> None:
    """`accel bench --out`: a new or empty folder, created only after the bench ran."""
    if out is None:
        return
    _check_parent(out, "--out")
    if check_exists and out.is_symlink():  # bench creates the folder itself; a link there could send its files anywhere
        raise UserError(
            f"--out {out} is a symbolic link (to {os.readlink(out)}); bench never writes through a link, give a new "
            "or empty folder"
        )
    if check_exists and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(
            f"--out {out} already exists and is not an empty folder; bench never overwrites, choose another"
        )


def _existing(path: Path) -> str:
    """`path` as an "already exists" message names it: a link (dangling ones included: the write
    would meet the name, not the target, and be refused after the long work) says so."""
    if not path.is_symlink():
        return str(path)
    return f"{path} (a symbolic link to {os.readlink(path)}{'' if path.exists() else ', which does not exist'})"


def _check_file_target(path: Path, flag: str, example: str) -> None:
    if path.is_dir():
        raise UserError(f"{flag} {path} is a directory; give a file name such as {path / example}")
    _check_parent(path, flag)


def _check_parent(path: Path, flag: str) -> None:
    """The nearest existing ancestor must be a folder (missing ones are created when writing) that
    takes a new file: the write comes after the generation, and its failure would lose the result."""
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"{flag} {path}: {parent} is a file, not a folder; choose another {flag}")
            _check_writable(path, parent, flag)
            return


def _check_writable(path: Path, folder: Path, flag: str) -> None:
    """Create and remove a hidden file in `folder`, as writing will (accel.files.publish.write_file's temporary
    name): the only test that tells /proc, a read-only mount or a folder of another user's apart
    from a writable one, whoever runs it (os.access says yes to root on /proc)."""
    try:
        descriptor, probe = tempfile.mkstemp(prefix=".accel-probe-", dir=folder)
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise UserError(
            f"{flag} {path}: cannot create files in {folder} ({reason.lower()}); choose another {flag}"
        ) from None
    os.close(descriptor)
    os.unlink(probe)


# --- the rendezvous port --------------------------------------------------------------------


def check_master_port(master_addr: str | None, master_port: int | None, node_rank: int = 0) -> None:
    """A taken --master-port surfaces in torchrun only after 30 s of retries, as a long traceback.
    Only the machine that hosts the rendezvous (node rank 0 at a local address) binds the port."""
    if master_port is None:
        return
    if not 1 <= master_port <= 65535:
        raise UserError(
            f"--master-port {master_port} is not a port number; use one from 1 to 65535 or leave --master-port out to "
            "pick one"
        )
    if node_rank != 0 or not is_local_address(master_addr):
        return
    problem = _bind_error(master_port)
    if problem == errno.EACCES:
        raise UserError(
            f"--master-port {master_port} needs root on this machine (ports below 1024 are privileged); "
            f"choose one above 1023 or leave --master-port out to pick one"
        )
    if problem == errno.EADDRINUSE:
        raise UserError(
            f"--master-port {master_port} is in use on this machine (another job?); "
            f"choose a free port or leave --master-port out to pick one"
        )


def is_local_address(address: str | None) -> bool:
    """None (the launcher's 127.0.0.1), a loopback or wildcard name, or a name or address this machine
    can bind: one of its own."""
    if address is None or address.strip("[]").lower() in LOCAL_NAMES:
        return True
    try:
        found = socket.getaddrinfo(address.strip("[]"), None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False  # torchrun reports an unknown host itself
    for family, _, _, _, sockaddr in found:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.bind((sockaddr[0], 0, *sockaddr[2:]))
                return True
        except OSError:
            continue
    return False


def port_free(port: int) -> bool:
    """Whether the rendezvous store could listen on `port` here now (on every interface, as it does)."""
    return _bind_error(port) is None


def _bind_error(port: int) -> int | None:
    """EADDRINUSE / EACCES where binding `port` on all interfaces fails, else None. SO_REUSEADDR is
    on, as in torch's TCPStore: a port in TIME_WAIT after the last job is free to it, a listening one is not."""
    for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 on this machine
        with sock:
            if os.name == "posix":  # on Windows the flag would let two sockets share a port
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as error:
                if error.errno in (errno.EADDRINUSE, errno.EACCES):
                    return error.errno
    return None


# --- process counts -------------------------------------------------------------------------


def visible_gpus(environ: Mapping[str, str] | None = None, driver: Path = NVIDIA_GPUS) -> int:
    """NVIDIA GPUs this process may use, without importing torch. CUDA_VISIBLE_DEVICES, when set,
    lists them (CUDA stops at the first invalid entry, so "" and "-1" hide them all); the driver's
    list caps that where it exists."""
    environ = os.environ if environ is None else environ
    installed = sum(1 for _ in driver.iterdir()) if driver.is_dir() else None
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return installed or 0
    listed = 0
    for entry in value.split(","):
        if not entry.strip() or entry.strip().startswith("-"):
            break
        listed += 1
    return listed if installed is None else min(listed, installed)


def cpu_cores() -> int:
    """The cores this process may run on (its affinity mask, not the machine's total)."""
    if hasattr(os, "process_cpu_count"):  # Python 3.13
        return os.process_cpu_count() or 1
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def check_process_count(
    nproc_per_node: int, device: str, oversubscribe: bool = False, nnodes: int = 1, asked: str | None = None
) -> None:
    """Ranks beyond the GPUs fail at start-up; beyond the CPU cores (no GPU) they thrash or exhaust
    memory. `device` is the recipe's auto / cpu / cuda; `asked` names what set the count (default
    --gpus); `oversubscribe` allows more CPU ranks than cores, for testing."""
    total = nproc_per_node * nnodes
    asked = asked or f"--gpus {total}"
    node = " on each node" if nnodes > 1 else ""
    gpus = visible_gpus() if device != "cpu" and _torch_build_has_gpu() else 0
    if gpus:
        if nproc_per_node > gpus:
            source = (
                f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']}"
                if "CUDA_VISIBLE_DEVICES" in os.environ
                else "nvidia driver"
            )
            raise UserError(
                f"{asked} needs {nproc_per_node} GPUs{node or ' on this node'}, but {gpus} "
                f"{'is' if gpus == 1 else 'are'} visible ({source}); use --gpus {gpus * nnodes} or fewer"
            )
        return
    if device == "cuda":
        return  # no GPU found here: resolving the device says so, in torch's own terms
    cores = cpu_cores()
    if nproc_per_node <= cores or oversubscribe:
        return
    have = f"{cores} CPU core{'s' if cores > 1 else ''}"
    why = (
        f"they run on the CPU (device cpu) and this machine has {have}"
        if device == "cpu"
        else f"this machine has no GPU and {have}"
    )
    raise UserError(
        f"{asked} starts {nproc_per_node} processes{node}, but {why}; use --gpus {cores * nnodes} or fewer, or pass "
        "--oversubscribe"
    )


def _torch_build_has_gpu() -> bool:
    """A CPU-only torch build computes on the CPU even where GPUs are installed; its version.py
    says which build it is without importing it (True when it cannot tell)."""
    try:
        spec = importlib.util.find_spec("torch")
        text = Path(spec.origin).with_name("version.py").read_text() if spec and spec.origin else ""
    except (OSError, ImportError, ValueError):
        return True
    cpu_only = bool(text) and all(re.search(rf"^{name}\b[^=\n]*=\s*None\s*$", text, re.M) for name in ("cuda", "hip"))
    return not cpu_only
