"""`python -m MODULE ARGS` for the tests as a fork of the session's fork server, which has imported
torch, diffusers, transformers and accel already (tests/rank_preload.py): a new interpreter spends
6-9 s of CPU on those imports before a tiny model's second of work, and the suite starts about a
hundred `accel` commands.

`popen` and `run` take subprocess's arguments and hand back what subprocess's do (a Popen-like
handle: pid, poll, wait, communicate, send_signal, pipes; a CompletedProcess). The child becomes
what a new interpreter running the module is: the given environment, working folder and standard
streams, a session of its own when asked, a new interpreter's signal handlers, its exit code through the fork
server, its non-daemon threads joined and its `atexit` handlers run at the end. Any other command
line (a console script, `python -c`, a script path) starts a new process through subprocess, and so
does a module whose environment sets inductor otherwise than the fork server's did (a cold cache, the
compile threads): torch reads TORCHINDUCTOR_* once, when the fork server imported it, so a fork would
compile as the fork server's settings say. Tests of what a new process imports or prints before accel
is imported run their command through subprocess themselves.
"""

from __future__ import annotations

import atexit
import gc
import io
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing import reduction
from typing import IO, Any

import torch.multiprocessing as mp

import rankpool
from rankpool import start_fork_server

from accel.launch.reports import exit_code

PIPE, DEVNULL, STDOUT = subprocess.PIPE, subprocess.DEVNULL, subprocess.STDOUT
_STARTED: list[ForkedCommand] = []  # a hundred or so a session


@atexit.register
def _end_leftovers() -> None:
    """A command a failed test left running is killed when this process ends: multiprocessing's own
    exit handler (registered before this one, so it runs after) waits for every child it started,
    where a leftover subprocess would only have been orphaned."""
    for command in _STARTED:
        if command.poll() is None:
            command.kill()
            command.wait(timeout=30)


def popen(argv: Sequence[str], **options: Any) -> Any:
    """subprocess.Popen(argv, **options), as a fork for `python [-u] -m MODULE ARGS`."""
    module = _module_command(argv)
    if module is None or not _forkable(options):
        return subprocess.Popen(list(argv), **options)
    server = rankpool.SERVER_ENVIRONMENT  # None: the server is not started, and would start with this environment
    if _compile_settings(options.get("env")) != _compile_settings(server):
        return subprocess.Popen(list(argv), **options)
    return ForkedCommand(list(argv), *module, **options)


def run(
    argv: Sequence[str],
    *,
    input: str | bytes | None = None,
    capture_output: bool = False,
    timeout: float | None = None,
    check: bool = False,
    **options: Any,
) -> subprocess.CompletedProcess[Any]:
    """subprocess.run(argv, ...), as a fork for `python [-u] -m MODULE ARGS`."""
    if capture_output:
        options.update(stdout=PIPE, stderr=PIPE)
    if input is not None:
        options["stdin"] = PIPE
    with popen(argv, **options) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
    done = subprocess.CompletedProcess(list(argv), process.returncode, stdout, stderr)
    if check:
        done.check_returncode()
    return done


def _module_command(argv: Sequence[str]) -> tuple[str, list[str], bool] | None:
    """(module, its arguments, unbuffered) of `python [-u] -m MODULE ARGS` run by this interpreter."""
    if len(argv) < 3 or argv[0] != sys.executable:
        return None
    unbuffered = argv[1] == "-u"
    rest = list(argv[2:] if unbuffered else argv[1:])
    if len(rest) < 2 or rest[0] != "-m":
        return None
    return rest[1], rest[2:], unbuffered


_SUPPORTED = {"cwd", "env", "stdin", "stdout", "stderr", "text", "universal_newlines", "start_new_session"}


def _forkable(options: dict[str, Any]) -> bool:
    return set(options) <= _SUPPORTED


def _compile_settings(environment: dict[str, str] | None) -> dict[str, str]:
    """What inductor reads from the environment when torch is imported."""
    items = (os.environ if environment is None else environment).items()
    return {name: value for name, value in items if name.startswith("TORCHINDUCTOR_")}


class _Inherited:
    """A descriptor handed to the child through the fork server (pickled while the child starts)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup: Any) -> int:
    return dup.detach()


class ForkedCommand:
    """What a test reads of a subprocess.Popen, for a child of the fork server."""

    def __init__(
        self,
        argv: list[str],
        module: str,
        args: list[str],
        unbuffered: bool,
        *,
        cwd: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
        stdin: Any = None,
        stdout: Any = None,
        stderr: Any = None,
        text: bool = False,
        universal_newlines: bool = False,
        start_new_session: bool = False,
    ) -> None:
        self.args = argv
        self.returncode: int | None = None
        self._text = text or universal_newlines
        self._readers: dict[str, tuple[threading.Thread, list[bytes]]] = {}
        mine: list[int] = []  # the child's ends, closed here once it holds them
        ends = []
        kept: dict[str, int] = {}
        for name, option, default in (("stdin", stdin, 0), ("stdout", stdout, 1), ("stderr", stderr, 2)):
            if option is STDOUT:
                ends.append(ends[1])
                continue
            child_end, parent_end = _ends(option, default, reading=name == "stdin")
            if option is PIPE or option is DEVNULL:  # opened here for the child alone
                mine.append(child_end)
            if parent_end is not None:
                kept[name] = parent_end
            ends.append(child_end)
        environment = dict(os.environ if env is None else env)
        folder = os.fspath(cwd) if cwd is not None else os.getcwd()
        start_fork_server()
        self._process = mp.get_context("forkserver").Process(
            target=_become,
            args=(
                module,
                args,
                environment,
                folder,
                unbuffered,
                start_new_session,
                _ignored(),
                *(_Inherited(fd) for fd in ends),
            ),
            daemon=False,
        )
        self._process.start()
        self.pid = self._process.pid
        _STARTED.append(self)
        for fd in set(mine):
            os.close(fd)
        self.stdin = self._open(kept, "stdin", "w")
        self.stdout = self._open(kept, "stdout", "r")
        self.stderr = self._open(kept, "stderr", "r")

    def _open(self, kept: dict[str, int], name: str, mode: str) -> IO[Any] | None:
        if name not in kept:
            return None
        if self._text:
            return open(kept[name], mode, encoding="utf-8", errors="strict")
        return open(kept[name], mode + "b", buffering=0 if mode == "w" else -1)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._process.join(timeout)
            if self.poll() is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: str | bytes | None = None, timeout: float | None = None) -> tuple[Any, Any]:
        """As Popen's: both pipes read to their end, the child waited for; callable again after a
        timeout, keeping what was read."""
        if self.stdin is not None and not self.stdin.closed:
            try:
                if input:
                    self.stdin.write(input)
                self.stdin.close()
            except BrokenPipeError:
                pass
        for name in ("stdout", "stderr"):
            stream = getattr(self, name)
            if stream is not None and name not in self._readers:
                chunks: list[Any] = []
                reader = threading.Thread(target=lambda s=stream, c=chunks: c.append(s.read()), daemon=True)
                reader.start()
                self._readers[name] = (reader, chunks)
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader, _ in self._readers.values():
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        outputs = []
        for name in ("stdout", "stderr"):
            if name in self._readers:
                outputs.append(self._readers[name][1][0])
                getattr(self, name).close()
            else:
                outputs.append(None)
        return outputs[0], outputs[1]

    def __enter__(self) -> ForkedCommand:
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in (self.stdout, self.stderr, self.stdin):
            if stream is not None and not stream.closed:
                stream.close()
        self.wait()


INHERITED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _ignored() -> list[int]:
    """The signals this process ignores, which a new interpreter it started would ignore too (pytest-xdist's
    workers ignore SIGINT)."""
    return [sig for sig in INHERITED_SIGNALS if signal.getsignal(sig) == signal.SIG_IGN]


def _ends(option: Any, default: int, reading: bool) -> tuple[int, int | None]:
    """(the child's descriptor, this process's end of a pipe or None) for one stream option."""
    if option is None:
        return default, None  # this process's own, as a subprocess inherits it
    if option is PIPE:
        read_end, write_end = os.pipe()
        return (read_end, write_end) if reading else (write_end, read_end)
    if option is DEVNULL:
        return os.open(os.devnull, os.O_RDONLY if reading else os.O_WRONLY), None
    if isinstance(option, int):
        return option, None
    return option.fileno(), None


def _become(
    module: str,
    args: list[str],
    env: dict[str, str],
    folder: str,
    unbuffered: bool,
    new_session: bool,
    ignored: list[int],
    *fds: int,
) -> None:
    """The child's side: a new interpreter's streams, folder, environment and signal handlers (and
    session, when asked); the module run as `python -m` runs it; then an interpreter's exit."""
    import runpy

    for target, fd in enumerate(fds):
        if fd != target:
            os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    if new_session:
        os.setsid()
    for sig in INHERITED_SIGNALS:  # an ignored signal stays ignored across exec; a handler does not
        signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)
    if signal.SIGINT not in ignored:  # what Python installs at start, unless SIGINT came ignored
        signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(folder)
    os.environ.clear()
    os.environ.update(env)
    unbuffered = unbuffered or bool(env.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout = _output(1, line_buffered=os.isatty(1), unbuffered=unbuffered)
    sys.stderr = _output(2, line_buffered=True, unbuffered=unbuffered)
    threads = env.get("OMP_NUM_THREADS")
    if threads:  # torch read it once, in the fork server
        import torch

        torch.set_num_threads(int(threads))
    sys.argv = [module, *args]
    gc.freeze()  # the fork server's imports: the command's collections need not walk them
    code: int = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit:
        if exit.code is not None and not isinstance(exit.code, int):
            print(exit.code, file=sys.stderr)  # as Python prints a message exit
        code = exit_code(exit)
    except BaseException as error:  # noqa: BLE001 - as an interpreter does: the traceback, exit code 1
        import traceback

        traceback.print_exc()
        code = -signal.SIGINT if isinstance(error, KeyboardInterrupt) else 1
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code == -signal.SIGINT:  # an uncaught Ctrl-C ends an interpreter by the signal itself
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _output(fd: int, line_buffered: bool, unbuffered: bool) -> io.TextIOWrapper:
    raw = io.FileIO(fd, "w", closefd=False)
    if unbuffered:
        return io.TextIOWrapper(raw, encoding="utf-8", line_buffering=line_buffered, write_through=True)
    return io.TextIOWrapper(io.BufferedWriter(raw), encoding="utf-8", line_buffering=line_buffered)
