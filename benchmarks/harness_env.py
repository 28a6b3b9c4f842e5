"""`just bench harness_env`: two ways for mini-swe-agent's own SWE-bench config to drive a swectl sandbox (issue 58).

- **class**: mini loads swectl's environment class by dotted path (swectl/gateway/harness/swectl_mini.py,
  ``environment.environment_class=swectl_mini.SwectlEnvironment``); each ``execute`` is one HTTP POST to the
  gateway's ``/swectl/v1/exec`` from mini's own process.
- **shim**: mini's own, unmodified ``DockerEnvironment`` with ``environment.executable`` pointed at a docker shim
  (``SHIM`` below, written to a temp folder): each ``execute`` runs ``<shim> exec -w CWD -e K=V ... ID bash -c CMD``
  as a subprocess, and the shim makes the same POST. Its ``run`` prints a made-up container id (the sandbox is the
  episode's lease, already there) and its ``stop``/``rm`` do nothing.

Both talk to a real Gateway (actors/gateway.py) in this process, whose session holds a real namespace sandbox from
an EnvPool; a baseline runs ``lease.exec`` in-process on the same lease. Timed: ``--n`` ``execute({"command": "echo
hi"})`` calls of each, interleaved so the machine's drift hits both; the shim also with ``#!python -S`` (no site
import: what the interpreter's start costs); the setup (``DockerEnvironment``'s ``run`` call against the class's
constructor); lines of code of each approach. Checked in both: ``echo hi`` answers ``hi``, a failing command's
return code comes through, ``cwd`` and ``env`` reach the sandbox, and the submit command raises mini's
``Submitted`` with the rest of the output.

What the shim cannot do, shown here:

- it never learns mini's per-command timeout: mini enforces it by killing the shim, and the sandbox command runs on
  until the gateway's ``exec_timeout_s`` (``shim_timeout_runs_on``). The sandbox's exec agent serves one command at a
  time, so mini's next command waits behind it (``shim_next_after_timeout_ms``), and may time out in mini in turn.
  ``SWECTL_EXEC_TIMEOUT`` in mini's environment (the config's ``environment.timeout``, set by whoever starts mini)
  bounds it in the sandbox too (``shim_capped_*``); a per-call ``execute(timeout=...)`` still does not reach it;
- a lost sandbox (the gateway's 503) can only become an exit status (125) and text: mini takes it as the command's
  result, an observation for the policy, where the class raises and the episode is an infrastructure failure
  (shown with a refusal on the same path, a session without a sandbox: ``shim_refusal_returncode``,
  ``class_refusal_raises``);
- it pays a process start per command (the shim's interpreter), where the class pays none.

Run: ``.venv/bin/python benchmarks/harness_env.py [--n 50]``. Needs .venv-harness (``bash scripts/setup.sh
--with-harnesses``) and the namespace backend's image. Writes ``benchmarks/results/harness_env.json``.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import tokenize
import uuid
from pathlib import Path
from typing import Any

import anyio
from common import Progress, host_meta, report, summarize

from swectl.actors.env_pool import running_pool
from swectl.actors.gateway import Gateway, GatewayConfig
from swectl.actors.harness import HARNESS_DIR, default_mini, mini_env
from swectl.config import load_config

SUITE = "harness_env"
REPO = Path(__file__).resolve().parents[1]
CLASS_FILE = HARNESS_DIR / "swectl_mini.py"
RUN_ON_S = 3  # the timeout demo's command sleeps this long, past mini's 1 s timeout

SHIM = r'''"""docker, as far as mini-swe-agent's DockerEnvironment uses it, over a swectl gateway's /swectl/v1/exec.

Standard library only: it runs in the harness's interpreter. SWECTL_GATEWAY_URL (the gateway's base URL, http) and
SWECTL_API_KEY (the episode's key) come from mini's environment; SWECTL_EXEC_TIMEOUT optionally bounds each command
in the sandbox (mini's own timeout kills this process, never the sandbox's command).

- ``run ... IMAGE sleep T``: prints a container id; none is made, the sandbox is the episode's lease;
- ``exec [-w CWD] [-e K=V]... ID ARGV...``: runs ARGV (mini's interpreter and command) in the sandbox, prints its
  merged output and exits with its return code (124 when the sandbox timed it out, 125 when the gateway could not
  run it);
- ``stop``/``rm``: nothing to do.

HTTP by hand on a socket: urllib's and http.client's imports (the email package) cost more than the round trip, and
this process starts once per command.
"""

import json
import os
import shlex
import socket
import sys


def post(body):
    """POST body to the gateway's /swectl/v1/exec: (status, answer bytes)."""
    where, _, path = os.environ["SWECTL_GATEWAY_URL"].split("//", 1)[-1].partition("/")
    host, _, port = where.rpartition(":")
    prefix = ("/" + path).rstrip("/").removesuffix("/v1")
    data = json.dumps(body).encode()
    head = (f"POST {prefix}/swectl/v1/exec HTTP/1.1\r\nHost: {where}\r\nConnection: close\r\n"
            f"Authorization: Bearer {os.environ['SWECTL_API_KEY']}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n")
    with socket.create_connection((host.strip("[]"), int(port))) as sock:
        sock.sendall(head.encode() + data)
        answer = b"".join(iter(lambda: sock.recv(1 << 16), b""))
    status, _, rest = answer.partition(b"\r\n")
    return int(status.split()[1]), rest.partition(b"\r\n\r\n")[2]


def execute(args):
    cwd, env = "", {}
    while args and args[0] in ("-w", "-e"):
        flag, value, args = args[0], args[1], args[2:]
        if flag == "-w":
            cwd = value
        else:
            key, _, val = value.partition("=")
            env[key] = val
    if len(args) < 2:
        sys.exit("swectl docker shim: exec [-w CWD] [-e K=V]... CONTAINER COMMAND...")
    body = {"command": shlex.join(args[1:]), "cwd": cwd, "env": env,
            "timeout": float(os.environ.get("SWECTL_EXEC_TIMEOUT", "86400"))}  # the gateway caps it
    try:
        status, answer = post(body)
    except (OSError, ValueError, IndexError) as exc:
        print(f"swectl docker shim: no answer from the gateway: {exc}", file=sys.stderr)
        return 125
    if status != 200:
        print(f"swectl docker shim: the gateway could not run the command ({status}): {answer[:2000]!r}",
              file=sys.stderr)
        return 125
    result = json.loads(answer)
    sys.stdout.buffer.write(result["output"].encode())
    if result["returncode"] == -1:
        print(result["exception_info"], file=sys.stderr)
        return 124
    return result["returncode"]


def main(argv):
    match argv[:1]:
        case ["run"]:
            print(os.urandom(32).hex())
            return 0
        case ["exec"]:
            return execute(argv[1:])
        case ["stop"] | ["rm"]:
            return 0
    print(f"swectl docker shim: {shlex.join(argv)} is not supported", file=sys.stderr)
    return 125


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
'''

# Runs in .venv-harness's interpreter: mini's DockerEnvironment (over the shim) and swectl's class, side by side.
DRIVER = '''\
import json, os, sys, time
import minisweagent
from minisweagent.environments.docker import DockerEnvironment
from minisweagent.exceptions import Submitted
from swectl_mini import SwectlEnvironment

spec = json.loads(sys.argv[1])
ENV = {"PAGER": "cat", "SWECTL_BENCH": "on"}
MARK = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def shim(executable, timeout=60):  # interpreter as in mini's swebench.yaml
    return DockerEnvironment(image="unused", executable=executable, cwd="/tmp", env=ENV, interpreter=["bash", "-c"],
                             timeout=timeout)


def cls(timeout=60):
    return SwectlEnvironment(gateway_url=os.environ["SWECTL_GATEWAY_URL"], api_key=os.environ["SWECTL_API_KEY"],
                             cwd="/tmp", env=ENV, timeout=timeout)


def timed(make, k):
    out = []
    for _ in range(k):
        t0 = time.perf_counter()
        env = make()
        out.append((time.perf_counter() - t0) * 1000)
    return env, out


def checks(env):
    hi = env.execute({"command": "echo hi"})
    failed = env.execute({"command": "echo no >&2; exit 3"})
    where = env.execute({"command": "pwd; echo $SWECTL_BENCH"})
    try:
        env.execute({"command": f"echo {MARK} && echo the-patch"})
        submitted = None
    except Submitted as exc:
        submitted = exc.messages[0]["extra"]["submission"] if exc.messages else repr(exc)
    return {"echo_output": hi["output"], "echo_returncode": hi["returncode"], "failing_returncode":
            failed["returncode"], "failing_output": failed["output"], "cwd_env_output": where["output"],
            "submission": submitted}


def timeout_demo(env, tag):  # env's timeout is 1 s; then the next command, with time enough
    t0 = time.perf_counter()
    out = env.execute({"command": f"sleep {spec['run_on_s']}; echo ran-on > /tmp/ran-on-{tag}"})
    t1 = time.perf_counter()
    after = env.execute({"command": "echo next"}, timeout=60)
    t2 = time.perf_counter()
    return {"returncode": out["returncode"], "exception_info": out["exception_info"][:200],
            "returned_after_ms": round((t1 - t0) * 1000, 1), "next_output": after["output"],
            "next_command_ms": round((t2 - t1) * 1000, 1)}


envs = {}
setup_ms = {}
envs["shim"], setup_ms["shim"] = timed(lambda: shim(spec["shim"]), spec["setup_k"])
envs["shim_S"], setup_ms["shim_S"] = timed(lambda: shim(spec["shim_S"]), spec["setup_k"])
envs["class"], setup_ms["class"] = timed(cls, spec["setup_k"])
result = {"mini_version": minisweagent.__version__, "python": sys.version.split()[0], "setup_ms": setup_ms,
          "checks": {name: checks(env) for name, env in envs.items()}}
exec_ms = {name: [] for name in envs}
for i in range(spec["warmup"] + spec["n"]):
    for name, env in envs.items():
        t0 = time.perf_counter()
        out = env.execute({"command": "echo hi"})
        elapsed = (time.perf_counter() - t0) * 1000
        assert out["output"] == "hi\\n" and out["returncode"] == 0, (name, out)
        if i >= spec["warmup"]:
            exec_ms[name].append(elapsed)
result["exec_ms"] = exec_ms
result["timeouts"] = {"shim": timeout_demo(shim(spec["shim"], timeout=1), "shim"),
                      "class": timeout_demo(cls(timeout=1), "class")}
os.environ["SWECTL_EXEC_TIMEOUT"] = "1"
result["timeouts"]["shim_capped"] = timeout_demo(shim(spec["shim"], timeout=1), "shim_capped")
# The gateway refuses (a session without a sandbox: 409, the path a lost sandbox's 503 takes too).
os.environ["SWECTL_API_KEY"] = spec["refused_key"]
refused = shim(spec["shim"]).execute({"command": "echo hi"})
result["refusal"] = {"shim": {"returncode": refused["returncode"], "output": refused["output"][:300]}}
try:
    cls().execute({"command": "echo hi"})
    result["refusal"]["class"] = "returned"
except RuntimeError as exc:
    result["refusal"]["class"] = f"raised RuntimeError: {str(exc)[:300]}"
print(json.dumps(result))
'''


class _NoModel:
    """The gateway's engine and tokenizer here: its exec route uses neither, and any use would be a bug."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the exec route used the model ({name})")


def code_lines(source: str) -> int:
    """Lines holding code: no blank lines, comments or docstrings."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                            tokenize.ENDMARKER):
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - docstrings)


def write_shims(folder: Path, python: str) -> None:
    """``docker``: the shim as mini would be given it; ``docker-S``: the same under ``python -S`` (no site)."""
    for name, shebang in (("docker", f"#!{python}\n"), ("docker-S", f"#!{python} -S\n")):
        path = folder / name
        path.write_text(shebang + SHIM)
        path.chmod(0o755)


async def measure(args: argparse.Namespace, python: str, work: Path, progress: Progress) -> dict[str, Any]:
    shim, shim_s = work / "docker", work / "docker-S"
    gateway = Gateway(GatewayConfig(exec_timeout_s=args.exec_timeout_s), lambda name: _NoModel(), _NoModel())
    config = load_config(None, ["env_pool.warm=0"])
    out: dict[str, Any] = {"sandbox_backend": config.sandbox.backend, "image": config.sandbox.image}
    async with running_pool(config, "bhe" + uuid.uuid4().hex[:8], start_timeout_s=120, close_timeout_s=30) as pool, \
            anyio.create_task_group() as tg:
        await tg.start(gateway.run)
        progress("pool and gateway up; leasing a sandbox")
        lease = await pool.acquire()
        try:
            key = gateway.open_session("bench#harness_env", lease)
            direct: dict[str, list[float]] = {"direct": [], "direct_bash_c": []}

            async def baseline(n: int) -> None:  # the shim's command is its interpreter and the command
                for i in range(args.warmup + n):
                    for name, command in (("direct", "echo hi"), ("direct_bash_c", "bash -c 'echo hi'")):
                        t0 = time.perf_counter()
                        result = await lease.exec(command, 30, cwd="/tmp")
                        if i >= args.warmup:
                            direct[name].append((time.perf_counter() - t0) * 1000)
                        assert result.output == "hi\n" and result.exit_code == 0, result

            await baseline(args.n // 2)  # half before the driver, half after: the machine's drift hits it too
            progress(f"direct lease.exec x{args.n // 2}; now mini's two environments in {python}")
            spec = {"shim": str(shim), "shim_S": str(shim_s), "n": args.n, "warmup": args.warmup,
                    "setup_k": args.setup_k, "run_on_s": RUN_ON_S,
                    "refused_key": gateway.open_session("bench#no-sandbox")}
            env = {**mini_env(work / "mini-home"), "SWECTL_GATEWAY_URL": gateway.url, "SWECTL_API_KEY": key}
            with anyio.fail_after(150):
                done = await anyio.run_process([python, "-c", DRIVER, json.dumps(spec)], env=env, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"the driver failed:\n{done.stderr.decode(errors='replace')[-4000:]}")
            driven = json.loads(done.stdout.decode().strip().splitlines()[-1])
            progress("driver done; the rest of the baseline, then the timed-out commands' leftovers")
            await anyio.sleep(RUN_ON_S + 0.5)  # the shim's orphan would queue the baseline behind it
            await baseline(args.n - args.n // 2)
            left = await lease.exec("ls /tmp/ | grep ran-on- || true", 30)
            out["ran_on_files"] = left.output.split()
            gateway.end_session(key)
        finally:
            await pool.release(lease)
        tg.cancel_scope.cancel()
    out.update(direct_ms=direct, **driven)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=50, help="timed commands per path")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--setup-k", type=int, default=5, help="environments constructed per path (setup cost)")
    parser.add_argument("--exec-timeout-s", type=float, default=600.0, help="the gateway's exec_timeout_s")
    args = parser.parse_args()
    python = str(Path(default_mini()).with_name("python"))
    if not Path(python).exists():
        print(f"{python} is missing: run `bash scripts/setup.sh --with-harnesses`", file=sys.stderr)
        return 2
    progress = Progress(SUITE)
    meta: dict[str, Any] = {**host_meta(), "n": args.n, "warmup": args.warmup, "setup_k": args.setup_k}
    with tempfile.TemporaryDirectory(prefix="bench-harness-env-") as folder:
        write_shims(Path(folder), python)
        out = anyio.run(measure, args, python, Path(folder), progress)

    dist = {**{k: summarize(v) for k, v in out["direct_ms"].items()},
            **{k: summarize(v) for k, v in out["exec_ms"].items()}}
    setup = {k: summarize(v) for k, v in out["setup_ms"].items()}
    checks = out["checks"]
    ok = {name: c["echo_output"] == "hi\n" and c["echo_returncode"] == 0 and c["failing_returncode"] == 3
          and c["failing_output"] == "no\n" and c["cwd_env_output"] == "/tmp\non\n" and c["submission"] == "the-patch\n"
          for name, c in checks.items()}
    ran_on = set(out["ran_on_files"])
    metrics: dict[str, Any] = {
        "direct_exec_p50_ms": dist["direct"]["p50"], "direct_exec_p90_ms": dist["direct"]["p90"],
        "direct_bash_c_exec_p50_ms": dist["direct_bash_c"]["p50"],
        "class_exec_p50_ms": dist["class"]["p50"], "class_exec_p90_ms": dist["class"]["p90"],
        "shim_exec_p50_ms": dist["shim"]["p50"], "shim_exec_p90_ms": dist["shim"]["p90"],
        "shim_S_exec_p50_ms": dist["shim_S"]["p50"], "shim_S_exec_p90_ms": dist["shim_S"]["p90"],
        "shim_over_class_p50": round(dist["shim"]["p50"] / dist["class"]["p50"], 2),
        "shim_minus_class_p50_ms": round(dist["shim"]["p50"] - dist["class"]["p50"], 2),
        "class_setup_p50_ms": setup["class"]["p50"], "shim_setup_p50_ms": setup["shim"]["p50"],
        "class_loc": code_lines(CLASS_FILE.read_text()), "shim_loc": code_lines(SHIM),
        "class_lines": len(CLASS_FILE.read_text().splitlines()), "shim_lines": len(SHIM.splitlines()),
        "class_checks_ok": ok["class"], "shim_checks_ok": ok["shim"] and ok["shim_S"],
        "class_timeout_runs_on": "ran-on-class" in ran_on, "shim_timeout_runs_on": "ran-on-shim" in ran_on,
        "shim_capped_timeout_runs_on": "ran-on-shim_capped" in ran_on,
        **{f"{name}_next_after_timeout_ms": t["next_command_ms"] for name, t in out["timeouts"].items()},
        "shim_refusal_returncode": out["refusal"]["shim"]["returncode"],
        "class_refusal_raises": out["refusal"]["class"].startswith("raised"),
    }
    meta.update({
        "versions": {"mini_swe_agent": out["mini_version"], "harness_python": out["python"],
                     "swectl_python": platform.python_version(),
                     "swectl_commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                                     text=True).stdout.strip()},
        "sandbox_backend": out["sandbox_backend"], "image": out["image"], "loadavg_end": os.getloadavg(),
        "distributions_ms": dist, "setup_ms": setup, "checks": checks, "timeouts": out["timeouts"],
        "refusal": out["refusal"],
        "mini_config": {
            "class": ["environment.environment_class=swectl_mini.SwectlEnvironment", "environment.gateway_url=URL",
                      "environment.api_key=KEY", "PYTHONPATH=swectl/gateway/harness"],
            "shim": ["environment.executable=SHIM", "environment.image=unused", "SWECTL_GATEWAY_URL=URL",
                     "SWECTL_API_KEY=KEY", "(SWECTL_EXEC_TIMEOUT=environment.timeout)"]},
        "notes": ("direct: lease.exec in the gateway's process; class: SwectlEnvironment.execute in .venv-harness's "
                  "python (one HTTP POST); shim: mini's DockerEnvironment.execute over the shim (a process start and "
                  "the same POST, with `bash -c CMD` as the command, which direct_bash_c prices); shim_S: the same "
                  "shim under `python -S`. *_loc: lines of code without blanks, comments or docstrings; the shim's "
                  "counterpart of the class is the shim alone (DockerEnvironment is mini's own)."),
    })
    report(SUITE, metrics, meta, [])
    return 0 if all(ok.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
