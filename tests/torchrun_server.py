"""torchrun without paying for its import at every launch (tests/conftest.py: torchrun).

Started once per test session; reads one launch per line on stdin (JSON: args, env, cwd, stdout,
stderr) and answers on stdout with the agent's pid, then its exit status. Each launch is a fork
of this process, which has imported ``torch.distributed.run`` once: the child is torchrun's own
agent (``torch.distributed.run.main``, the function ``python -m torch.distributed.run`` calls),
with the launch's environment, working directory and output files, in a process group of its
own. Its workers are forked from the agent too (``_ForkedWorker``): under plain torchrun each is
a fresh interpreter, and importing torch and DCP again cost each one about 4 s of CPU, most of a
multi-rank test on 2 cores (tests/test_multirank_roundtrip.py: 170 s with fresh interpreters,
78 s forked). A forked worker runs its script as ``python -u script.py`` would: its argv,
``sys.path[0]``, ``__main__`` and environment, only its standard streams open, a session of its
own, the interpreter's default signal handlers, torch's thread count from OMP_NUM_THREADS, random
seeds of its own, no faulthandler, an unconfigured root logger, ``sys.excepthook`` for what it
does not catch, its non-daemon threads joined and atexit handlers run at its end, a script's
exit status. It starts with what the launcher imported (torch, DCP), nothing of dcp_tiered. What
it skips is the interpreter's teardown (modules, C++ destructors): the examples are run fresh
for that (conftest.run_example). A launch whose environment sets a ``PYTHON*`` variable
otherwise than the server's (a ``sitecustomize`` on PYTHONPATH, say), whose command is not a
plain script, or that runs where CUDA is available (it cannot start in a fork), starts fresh
interpreters, as does every launch with DCP_TIERED_TEST_FRESH_WORKERS=1.
"""

from __future__ import annotations

import atexit
import builtins
import faulthandler
import importlib.machinery
import io
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import types
import warnings
from typing import NoReturn

import torch
import torch.distributed.checkpoint  # imported once, for every forked worker
import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

_SERVER_ENV = dict(os.environ)
_THREADS = torch.get_num_threads()  # a fresh interpreter's, without OMP_NUM_THREADS


def _exit_code(e: SystemExit) -> int:
    """The exit status the interpreter gives a SystemExit (printing a non-int code)."""
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1


class _ForkedWorker:
    """What torchrun's agent keeps of a worker (a ``subprocess.Popen``'s pid, poll, wait and
    signals), for a worker forked from the agent that runs its script in place."""

    def __init__(self, script: str, argv: list[str], env: dict, out, err) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        ready, started = os.pipe()  # closed by the worker once it is set up, as exec would
        with warnings.catch_warnings():  # 3.12: fork() of a process with threads (ours: none)
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            os.close(ready)
            _run_worker(script, argv, env, out, err)
        os.close(started)
        os.read(ready, 1)  # until the worker has its own session and signal handlers
        os.close(ready)
        self.pid = pid
        self.returncode: int | None = None
        self.args = [sys.executable, "-u", script, *argv]

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _run_worker(script: str, argv: list[str], env: dict, out, err) -> NoReturn:
    """In the forked worker: ``python -u script argv...`` from here on, then its exit."""
    code = 1
    try:
        os.setsid()  # as torchrun's start_new_session
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)  # the agent's handlers are not the worker's
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for f, fd in ((out, 1), (err, 2)):
            if f is not None:
                os.dup2(f.fileno(), fd)
        # Nothing of the agent's stays open (its store's sockets, say), as with close_fds; this
        # closes the pipe the agent waits on, too
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        errors = sys.__stdout__.errors if sys.__stdout__ is not None else "strict"
        sys.stdout = io.TextIOWrapper(
            io.FileIO(1, "w", closefd=False), write_through=True, errors=errors
        )
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace"
        )
        os.environ.clear()
        os.environ.update(env)
        _fresh_process_state(env)
        sys.argv = [script, *argv]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        try:
            _run_main(script)
            code = 0
        except SystemExit as e:
            code = _exit_code(e)
        except BaseException as e:  # noqa: BLE001 - uncaught: sys.excepthook, status 1
            _uncaught(os.path.abspath(script))
            # an interrupt: the interpreter ends by the signal itself (below)
            code = -signal.SIGINT if isinstance(e, KeyboardInterrupt) else 1
        # the interpreter's own end: non-daemon threads joined, then the atexit handlers
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            if code == -signal.SIGINT:
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
            os._exit(code)


def _fresh_process_state(env: dict) -> None:
    """What a fresh interpreter has and the fork inherited otherwise: torch's thread count
    from OMP_NUM_THREADS (torch fixed it when the server imported it), random generator seeds
    of its own, no faulthandler (torchrun's agent enables it), an unconfigured root logger."""
    threads = env.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else _THREADS)
    torch.seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    if not env.get("PYTHONFAULTHANDLER"):
        faulthandler.disable()
    logging.root.handlers.clear()
    logging.root.setLevel(logging.WARNING)


def _run_main(script: str) -> None:
    """The script as ``__main__``, as the interpreter runs it: the module stays
    ``sys.modules["__main__"]`` to the end (atexit handlers and threads see it there)."""
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=script,
        __cached__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", script),
        __package__=None,
        __spec__=None,
        __builtins__=builtins,
    )
    sys.modules["__main__"] = main
    with io.open_code(script) as f:
        code = compile(f.read(), script, "exec")
    exec(code, main.__dict__)  # noqa: S102 - the worker script the test launches


def _uncaught(script: str) -> None:
    """What the interpreter does with an exception the script did not catch: hand it to
    ``sys.excepthook`` (torch.distributed's prefixes each line with the rank), its traceback
    from the script's own frame on, as ``python script.py`` would show it."""
    kind, value, tb = sys.exc_info()
    first = tb
    while first is not None and os.path.abspath(first.tb_frame.f_code.co_filename) != script:
        first = first.tb_next
    assert kind is not None and value is not None
    sys.excepthook(kind, value, first or tb)


def _forks(args: tuple, env: dict) -> bool:
    """Whether a worker command can be forked (see the module's docstring)."""
    if os.environ.get("DCP_TIERED_TEST_FRESH_WORKERS") == "1":
        return False
    if torch.cuda.is_available():  # torchrun's agent asked: CUDA cannot start in a fork
        return False
    plain = len(args) >= 3 and args[0] == sys.executable and args[1] == "-u"
    if not plain or not str(args[2]).endswith(".py"):
        return False
    return _python_vars(env) == _python_vars(_SERVER_ENV)


def _python_vars(env: dict) -> dict:
    """The variables the interpreter reads as it starts (-u aside: set for every worker)."""
    return {k: v for k, v in env.items() if k.startswith("PYTHON") and k != "PYTHONUNBUFFERED"}


_fresh_popen = getattr(subprocess_handler.SubprocessHandler, "_popen", None)


def _popen(self, args: tuple, env: dict):  # type: ignore[no-untyped-def]
    """SubprocessHandler's way to start a worker: forked where it can be."""
    if not _forks(args, env):
        return _fresh_popen(self, args, env)
    return _ForkedWorker(str(args[2]), [str(a) for a in args[3:]], env, self._stdout, self._stderr)


if _fresh_popen is not None:  # torch versions whose handler starts workers there
    subprocess_handler.SubprocessHandler._popen = _popen  # type: ignore[method-assign]


def agent(request: dict) -> int:
    """In the forked child: run torchrun's main as ``python -m torch.distributed.run`` would."""
    os.setpgid(0, 0)  # the launch is one group: the test can stop the agent and its workers
    os.chdir(request["cwd"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for fd, target in ((devnull, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [torchrun.__file__, *request["args"]]
    try:
        torchrun.main(request["args"])
        code = 0
    except SystemExit as e:  # as the interpreter does with SystemExit
        code = _exit_code(e)
    except BaseException:  # noqa: BLE001 - an uncaught exception: traceback, status 1
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = agent(request)
            finally:
                os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
