"""torchrun without paying for its import at every launch (tests/conftest.py: torchrun).

Started once per test session; reads one launch per line on stdin (JSON: args, env, cwd, stdout,
stderr) and answers on stdout with the agent's pid, then its exit status. Each launch is a fork
of this process, which has imported ``torch.distributed.run`` once: the child is torchrun's own
agent (``torch.distributed.run.main``, the function ``python -m torch.distributed.run`` calls),
with the launch's environment, working directory and output files, in a process group of its
own. The workers it starts are fresh interpreters, as under ``python -m torch.distributed.run``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch.distributed.run as torchrun


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
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
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
