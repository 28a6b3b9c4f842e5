"""Any swectl task set out as Harbor task folders, which Harbor runs unmodified (`swectl tasks export --harbor DIR`).

Per task, a folder named after its instance id:

- ``task.toml``: its metadata (repo, base commit, source), the grading timeout as ``[verifier] timeout_sec`` (not
  ``allow_internet = false``, which Harbor's podman environment refuses to run);
- ``instruction.md``: the problem statement and where the repository is;
- ``environment/Dockerfile``: ``FROM`` the task's image as this machine has it (the same image swectl grades in),
  its setup patch applied and committed (factory tasks carry their bug there), ``WORKDIR /testbed``;
- ``tests/test.sh``: the task's eval script (as swectl's grader builds it), then ``tests/judge.py`` (the standard
  library only) reads the log's pytest results and writes 1 to ``/logs/verifier/reward.txt`` when every FAIL_TO_PASS
  test passes and no PASS_TO_PASS test fails (SWE-bench's rule), else 0; ``tests/tests.json`` lists them;
- ``solution/solve.sh``: applies the gold patch.

A Harbor task (``source = "harbor"``) is copied as its own folder, its Dockerfile (kept as ``Dockerfile.orig``)
replaced by one ``FROM`` the image swectl built from it, so that Harbor runs it on a machine that pulls nothing, and
its ``allow_internet = false`` commented out (Harbor's podman environment refuses that mode).
What is not exported, with the reason, is a
TaskDataError per task: rows graded by a log parser other than pytest's (judge.py reads pytest's ``-rA`` summary
only), and rows without an image. swectl's own grading defences (the patch policy, canaries, runner-section checks)
are not part of an exported task: Harbor grades it as the official harness would.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import textwrap
from pathlib import Path

from swectl.config import toml_value
from swectl.errors import TaskDataError
from swectl.grading.eval_script import eval_script_for
from swectl.tasks.harbor import harbor_meta, is_harbor
from swectl.tasks.record import TESTBED, Task

NO_NETWORK_NOTE = ("# swectl export: Harbor's podman environment refuses allow_internet = false; the run's compose "
                   "overlay (network_mode: none) or an offline host keeps the network out")
PYTEST_PARSERS = frozenset({"parse_log_pytest", "parse_log_pytest_v2", "parse_log_pytest_options"})

JUDGE = '''\
"""The exported task's judge (written by swectl): pytest's -rA results in the eval log -> reward 1 or 0."""
import json
import re
import sys

START, END = ">>>>> Start Test Output", ">>>>> End Test Output"
STATUSES = ("PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL", "XPASS")


def statuses(log):
    if START in log:
        log = log.split(START, 1)[1].split(END, 1)[0]
    found = {}
    for line in log.splitlines():
        line = re.sub(r"\\x1b\\[[0-9;]*m", "", line).strip()
        word, _, rest = line.partition(" ")
        if word in STATUSES and rest:
            if word in ("FAILED", "ERROR") and " - " in rest:
                rest = rest.split(" - ", 1)[0]
            found[rest.strip()] = word
    return found


def main():
    log = open(sys.argv[1], encoding="utf-8", errors="replace").read()
    tests = json.load(open(sys.argv[2]))
    seen = statuses(log)
    passed = lambda t: seen.get(t) in ("PASSED", "XFAIL")
    failed = lambda t: t not in seen or seen[t] in ("FAILED", "ERROR")
    f2p = [t for t in tests["FAIL_TO_PASS"] if not passed(t)]
    p2p = [t for t in tests["PASS_TO_PASS"] if failed(t)]
    if tests.get("eval_type") == "fail_only":
        p2p = []
    for t in f2p:
        print("FAIL_TO_PASS not passing:", t, file=sys.stderr)
    for t in p2p:
        print("PASS_TO_PASS failing:", t, file=sys.stderr)
    print(1 if seen and not f2p and not p2p else 0)


main()
'''


def _task_toml(task: Task, timeout_s: float) -> str:
    meta = {"source": task.source, "repo": task.repo, "base_commit": task.base_commit, "version": task.version,
            "exported_by": "swectl"}
    lines = ["schema_version = \"1.1\"", "", "[metadata]"]
    lines += [f"{k} = {toml_value(v)}" for k, v in meta.items() if v]
    lines += ["", "[verifier]", f"timeout_sec = {float(timeout_s)}", "", "[agent]", "timeout_sec = 3600.0", "",
              "[environment]", "build_timeout_sec = 600.0",
              "# no allow_internet = false: Harbor's podman environment refuses the no-network mode; the run's own",
              "# compose overlay (network_mode: none) or an offline host keeps the network out", ""]
    return "\n".join(lines)


def _dockerfile(image: str, has_setup: bool) -> str:
    lines = [f"FROM {image}"]
    if has_setup:
        git = "git -c user.name=swectl -c user.email=swectl@localhost"
        lines += ["COPY setup.diff /tmp/swectl-setup.diff",
                  f"RUN cd {TESTBED} && git apply /tmp/swectl-setup.diff && {git} add -A && "
                  f"{git} commit -q --no-gpg-sign -m 'swectl: task setup' && rm -f /tmp/swectl-setup.diff"]
    lines += [f"WORKDIR {TESTBED}", ""]
    return "\n".join(lines)


def _test_sh() -> str:
    return textwrap.dedent(f"""\
        #!/bin/bash
        # Written by swectl: the task's eval script, then its pytest results judged by SWE-bench's rule.
        mkdir -p /logs/verifier
        cd {TESTBED}
        bash /tests/eval.sh > /logs/verifier/eval.log 2>&1
        echo "eval script exit $?"
        reward=$(python3 /tests/judge.py /logs/verifier/eval.log /tests/tests.json) || reward=0
        echo "${{reward:-0}}" > /logs/verifier/reward.txt
        echo "reward ${{reward:-0}}"
        """)


def _solve_sh(patch: str) -> str:
    encoded = base64.b64encode(patch.encode("utf-8", errors="surrogateescape")).decode()
    body = "\n".join(encoded[i:i + 76] for i in range(0, len(encoded), 76))
    return (f"#!/bin/bash\n# Written by swectl: the task's gold patch.\nset -euo pipefail\ncd {TESTBED}\n"
            f"base64 -d > /tmp/swectl-gold.diff <<'SWECTL_GOLD_END'\n{body}\nSWECTL_GOLD_END\n"
            "git apply --verbose /tmp/swectl-gold.diff\n")


def export_task(task: Task, image: str, out: Path, *, specs: object | None = None, timeout_s: float = 1800.0) -> Path:
    """Write ``task`` as a Harbor task folder under ``out``; its path. TaskDataError when it cannot be exported."""
    folder = out / task.instance_id
    if is_harbor(task):  # its own folder, the environment pinned to the image swectl built from it (offline)
        meta = harbor_meta(task)
        shutil.copytree(meta.folder, folder, dirs_exist_ok=True)
        dockerfile = folder / "environment" / "Dockerfile"
        dockerfile.rename(dockerfile.with_name("Dockerfile.orig"))
        dockerfile.write_text(f"# swectl: the image built from Dockerfile.orig on this machine\nFROM {image}\n"
                              f"WORKDIR {meta.workdir}\n")
        toml = folder / "task.toml"
        toml.write_text(re.sub(r"(?m)^(\s*allow_internet\s*=\s*false.*)$", NO_NETWORK_NOTE + r"\n# \1",
                               toml.read_text()))
        return folder
    if task.log_parser and task.log_parser not in PYTEST_PARSERS:
        raise TaskDataError(f"{task.instance_id}: graded by {task.log_parser!r}; the exported judge reads pytest's "
                            "results only")
    if not image:
        raise TaskDataError(f"{task.instance_id}: no image to build the Harbor environment FROM")
    script = eval_script_for(task, specs)
    (folder / "environment").mkdir(parents=True, exist_ok=True)
    (folder / "tests").mkdir(exist_ok=True)
    (folder / "solution").mkdir(exist_ok=True)
    (folder / "task.toml").write_text(_task_toml(task, timeout_s))
    (folder / "instruction.md").write_text(
        f"{task.problem_statement.rstrip()}\n\nThe repository is at {TESTBED}. Change its non-test source files so "
        "that the problem above is fixed.\n")
    (folder / "environment" / "Dockerfile").write_text(_dockerfile(image, bool(task.setup_patch)))
    if task.setup_patch:
        (folder / "environment" / "setup.diff").write_text(task.setup_patch, errors="surrogateescape")
    (folder / "tests" / "eval.sh").write_text(script, errors="surrogateescape")
    (folder / "tests" / "judge.py").write_text(JUDGE)
    (folder / "tests" / "tests.json").write_text(json.dumps(
        {"FAIL_TO_PASS": task.FAIL_TO_PASS, "PASS_TO_PASS": task.PASS_TO_PASS, "eval_type": task.eval_type},
        indent=1))
    test_sh = folder / "tests" / "test.sh"
    test_sh.write_text(_test_sh())
    test_sh.chmod(0o755)
    if task.patch:
        solve = folder / "solution" / "solve.sh"
        solve.write_text(_solve_sh(task.patch))
        solve.chmod(0o755)
    return folder
