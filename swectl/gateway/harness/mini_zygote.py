"""mini-swe-agent's `mini` command, started by fork from one warm interpreter instead of a fresh process per episode.

Importing mini and litellm costs seconds of CPU (docs/results.md, "Figures the code relies on"), paid by every
episode when each runs ``mini`` anew, and more than the episode itself for short ones. This program
runs in the harness's own interpreter (.venv-harness: the standard library and mini alone), imports mini's entry
point once, and for each request forks a child that runs mini's own ``app`` (the same typer app the ``mini`` console
script calls, unmodified) with the request's arguments, environment and working folder. The child starts its own
session (``setsid``), so the caller can kill its process group at a time limit.

Protocol, one JSON object per line: on stdin ``{"id", "argv", "env", "cwd", "log"}`` (``log``: where the child's
stdout and stderr go); on stdout ``{"ready": true, "not_prewarmed": [...]}`` once imported (PREWARM: what mini imports
only when an episode runs, litellm among it), then ``{"id", "pid"}`` when a child is forked and
``{"id", "exit"}`` when it ends (its exit status; a signal ``n`` is ``-n``). The program ends when stdin closes; its
children are then killed.

The environment that mini reads at import (``MSWEA_GLOBAL_CONFIG_DIR``, ``LITELLM_LOCAL_MODEL_COST_MAP``,
``MSWEA_CONFIGURED``) is the zygote's own; the rest of a request's ``env`` replaces the child's environment.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

_out = threading.Lock()
_children: dict[int, str] = {}  # pid -> request id


def _say(message: dict) -> None:
    line = json.dumps(message) + "\n"
    with _out:
        os.write(1, line.encode())


def _child(request: dict) -> None:
    """In the forked child: become mini with the request's arguments; never returns."""
    code = 1
    try:
        os.setsid()
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdin = open(0, closefd=False)  # the child's own streams
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["mini", *request["argv"]]
        from minisweagent.run.mini import app

        try:
            app(args=request["argv"], prog_name="mini")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # reported in the log; the status says it failed
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap() -> None:
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            threading.Event().wait(0.05)
            continue
        with _out:
            rid = _children.pop(pid, None)
        if rid is not None:
            _say({"id": rid, "exit": os.waitstatus_to_exitcode(status)})


# What mini imports only once an episode runs (its model, agent and environment classes, litellm under the model):
# imported here, before any fork, so that no child pays for them. litellm alone costs seconds of CPU (docs/results.md,
# "Figures the code relies on"). None of them starts a thread at import (checked with litellm 1.x and mini 2.4), so
# forking after them is safe. A module that is missing is left to the child, which reports it as mini would.
PREWARM = ("litellm", "minisweagent.models.litellm_model", "minisweagent.models.litellm_textbased_model",
           "minisweagent.agents.default", "minisweagent.environments.local", "swectl_mini")


def prewarm() -> list[str]:
    """Import PREWARM; the ones that could not be imported."""
    import importlib

    missing = []
    for name in PREWARM:
        try:
            importlib.import_module(name)
        except Exception:
            missing.append(name)
    return missing


def main() -> int:
    import minisweagent.run.mini  # noqa: F401 - the import that every child then shares

    missing = prewarm()
    _say({"ready": True, "not_prewarmed": missing})
    threading.Thread(target=_reap, name="reaper", daemon=True).start()
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            request = json.loads(line)
            with _out:  # the reaper must not report a child before it is recorded
                pid = os.fork()
                if pid == 0:
                    _child(request)
                _children[pid] = request["id"]
            _say({"id": request["id"], "pid": pid})
    finally:
        for pid in list(_children):
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
