"""A command that reports how it was started: `python -m command_probe MODE ...`, run by
tests/test_commands.py both as a fork (tests/commands.py) and as a new interpreter, which must agree."""

import atexit
import os
import signal
import sys
import threading
import time

if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "report":  # what a test reads of a command's start: folder, environment, arguments, stdin
        print("cwd", os.getcwd())
        print("env", os.environ.get("PROBE_VALUE"), "HOME" in os.environ)
        print("argv", sys.argv[1:])
        print("stdin", sys.stdin.read().strip())
        print("session", os.getsid(0) == os.getpid())
        print("sigint", signal.getsignal(signal.SIGINT) is signal.default_int_handler)
        print("to stderr", file=sys.stderr)
        sys.exit(int(sys.argv[2]))
    if mode == "exit":  # an interpreter's exit: non-daemon threads joined, then the atexit handlers
        atexit.register(lambda: print("atexit", flush=True))
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", flush=True))).start()
        sys.exit("a message as the exit code")
    if mode == "wait":  # until a signal ends it
        print("waiting", flush=True)
        time.sleep(120)
    if mode == "raise":
        raise ValueError("probe failed")
    if mode == "inductor":  # the compile threads torch set when it was imported, and who started this process
        import torch._inductor.config

        print(torch._inductor.config.compile_threads, os.getppid())
