"""Harbor task folders in: ``task.toml``, ``instruction.md``, ``environment/Dockerfile``, ``tests/test.sh`` and an
optional ``solution/solve.sh`` become swectl ``Task``s (``source = "harbor"``).

A folder of Harbor tasks (each a subfolder with a task.toml; or one task folder itself) is read here, without
building anything: each task's image name is a hash of its environment folder and of swectl's layer on top
(swectl.images.harbor builds it, offline, and makes the gold patch by running solve.sh). The task's verifier is its
``eval_script``: a self-contained bash script that recreates ``/tests`` from the task's tests folder (carried inside
the script, so a Task row travels whole), empties ``/logs/verifier``, and runs ``/tests/test.sh`` in the
environment's work folder as Harbor does; the grader (actors/grader.py) then reads ``/logs/verifier/reward.json``, else
``reward.txt`` (Harbor's order). The agent never sees the tests: they are not in the image, only in the grading
sandbox, which is fresh and holds the agent's final state as its patch of the work folder (applied like any patch,
under the Harbor patch policy), so nothing the agent wrote elsewhere (a reward file, a test script)
reaches the verifier.

What swectl does not take (a clear problem per task, the task skipped): multi-step tasks (``steps``), a
docker-compose environment, MCP servers, GPUs or TPUs, Windows tasks, a verifier in a separate environment, and a
Dockerfile without a WORKDIR (the work folder is what is diffed and graded) or with the work folder at ``/``.
"""

from __future__ import annotations

import base64
import hashlib
import io
import re
import shlex
import tarfile
import tomllib
from pathlib import Path
from typing import Any

import msgspec

from swectl.errors import TaskDataError
from swectl.tasks.record import Task

TASK_FILE = "task.toml"
REWARD_TXT = "/logs/verifier/reward.txt"
REWARD_JSON = "/logs/verifier/reward.json"
TESTS_DIR = "/tests"
MAX_TESTS_BYTES = 8 << 20  # a task's tests folder travels inside its eval script (gzip, base64)
LOG_PARSER = "harbor"
# Bump when swectl's layer on the environment image or the verifier script changes (both are in the content hash).
HARBOR_RECIPE = "2"  # 2: a /testbed of the base image moved aside


class HarborVerifier(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """task.toml's [verifier] section."""
    timeout_sec: float = 600.0
    env: dict[str, str] = {}
    environment_mode: str | None = None
    environment: dict[str, Any] | None = None


class HarborAgent(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """task.toml's [agent] section."""
    timeout_sec: float | None = None


class HarborEnvironment(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """task.toml's [environment] section."""
    build_timeout_sec: float = 600.0
    docker_image: str | None = None
    os: str = "linux"
    cpus: float | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None
    gpus: int | None = None
    tpu: dict[str, Any] | None = None
    mcp_servers: list[dict[str, Any]] = []
    env: dict[str, str] = {}
    workdir: str | None = None
    allow_internet: bool | None = None


class HarborSolution(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """task.toml's [solution] section."""
    env: dict[str, str] = {}


class HarborTaskConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """The parts of Harbor's task.toml (schema 1.x) that swectl reads; other keys are kept in the row's extra."""
    schema_version: str = "1.0"
    metadata: dict[str, Any] = {}
    verifier: HarborVerifier = msgspec.field(default_factory=HarborVerifier)
    agent: HarborAgent = msgspec.field(default_factory=HarborAgent)
    environment: HarborEnvironment = msgspec.field(default_factory=HarborEnvironment)
    solution: HarborSolution = msgspec.field(default_factory=HarborSolution)
    steps: list[dict[str, Any]] | None = None


class HarborMeta(msgspec.Struct, kw_only=True):
    """What a harbor Task carries in ``extra["harbor"]``: where it came from and the settings swectl honours."""
    folder: str  # the task folder (absolute) it was read from
    environment_content: str  # the hash of its environment folder and swectl's layer (names the image)
    workdir: str  # the environment's WORKDIR: where the agent works and what is diffed
    base_image: str  # the Dockerfile's FROM (before swectl's stand-in for it)
    verifier_timeout_s: float
    agent_timeout_s: float | None = None
    build_timeout_s: float = 600.0
    cpus: float | None = None
    memory_mb: int | None = None
    allow_internet: bool = False
    has_solution: bool = False
    solution_content: str = ""  # the hash of the solution folder ("" when none)


class HarborTaskError(TaskDataError):
    """A Harbor task folder swectl cannot use; the message names the folder and the field."""


def is_harbor_dir(path: Path) -> bool:
    """A Harbor task folder, or a folder holding Harbor task folders."""
    return path.is_dir() and ((path / TASK_FILE).is_file() or any(path.glob(f"*/{TASK_FILE}")))


def task_folders(path: Path) -> list[Path]:
    """The task folders under ``path`` (itself, when it is one), sorted by name."""
    return [path] if (path / TASK_FILE).is_file() else sorted(p.parent for p in path.glob(f"*/{TASK_FILE}"))


def folder_hash(folder: Path) -> str:
    """A hash of a folder's files (relative paths, modes' executable bit and bytes), in sorted order."""
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(folder)).encode() + b"\0" + (b"x" if p.stat().st_mode & 0o111 else b"-"))
            h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


_FROM = re.compile(r"^\s*FROM\s+(?:--\S+\s+)*(\S+)", re.IGNORECASE | re.MULTILINE)
_WORKDIR = re.compile(r"^\s*WORKDIR\s+(\S+)\s*$", re.IGNORECASE | re.MULTILINE)


def dockerfile_facts(text: str, where: str) -> tuple[str, str]:
    """(FROM image, last WORKDIR) of a Dockerfile; HarborTaskError when it has no FROM, several stages, or no
    absolute WORKDIR other than /."""
    froms = _FROM.findall(text)
    if not froms:
        raise HarborTaskError(f"{where}: no FROM line")
    if len(froms) > 1:
        raise HarborTaskError(f"{where}: {len(froms)} FROM stages; swectl builds single-stage environments only")
    workdirs = _WORKDIR.findall(text)
    if not workdirs:
        raise HarborTaskError(f"{where}: no WORKDIR; swectl needs the agent's work folder (it is what is diffed and "
                              "graded): add e.g. WORKDIR /app")
    workdir = workdirs[-1].rstrip("/") or "/"
    if not workdir.startswith("/") or workdir == "/":
        raise HarborTaskError(f"{where}: WORKDIR {workdirs[-1]!r}: swectl needs an absolute folder other than /")
    return froms[0], workdir


def _unsupported(config: HarborTaskConfig, folder: Path) -> list[str]:
    env = config.environment
    out = []
    if config.steps:
        out.append("steps: multi-step tasks")
    if any((folder / "environment" / name).exists() for name in ("docker-compose.yaml", "docker-compose.yml")):
        out.append("environment/docker-compose.yaml: multi-container environments")
    if env.mcp_servers:
        out.append("environment.mcp_servers: MCP servers")
    if env.gpus or env.tpu:
        out.append("environment.gpus / tpu: accelerators in the sandbox")
    if env.os != "linux":
        out.append(f"environment.os = {env.os!r}: only linux")
    if config.verifier.environment_mode not in (None, "shared") or config.verifier.environment:
        out.append("verifier.environment / environment_mode: a verifier in an environment of its own")
    return out


def tests_archive(tests: Path) -> bytes:
    """The tests folder as a gzip tar (sorted, owner root, mtime 0: the same bytes for the same files)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        for p in sorted(tests.rglob("*")):
            info = tar.gettarinfo(str(p), arcname=str(p.relative_to(tests)))
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            info.mtime = 0
            if p.is_file():
                with p.open("rb") as f:
                    tar.addfile(info, f)
            elif p.is_dir():
                tar.addfile(info)
    return buf.getvalue()


def verifier_script(tests: Path, workdir: str, env: dict[str, str]) -> str:
    """The grading sandbox's verifier: /tests from the task's files (never the sandbox's), /logs/verifier emptied,
    then ``/tests/test.sh`` from the work folder as Harbor runs it (its output also in
    /logs/verifier/test-stdout.txt), its exit code printed last (Harbor ignores it; the reward file decides)."""
    archive = tests_archive(tests)
    if len(archive) > MAX_TESTS_BYTES:
        raise HarborTaskError(f"{tests}: {len(archive)} bytes compressed; a task's tests may be at most "
                              f"{MAX_TESTS_BYTES >> 20} MiB")
    encoded = base64.b64encode(archive).decode()
    lines = "\n".join(encoded[i:i + 76] for i in range(0, len(encoded), 76))
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(env.items()) if _is_name(k))
    return (
        "#!/bin/bash\n"
        "# swectl: the Harbor task's verifier (tests/ recreated from the task, never from the sandbox)\n"
        f"rm -rf {TESTS_DIR} /logs/verifier && mkdir -p {TESTS_DIR} /logs/verifier /logs/agent || exit 90\n"
        f"base64 -d > /tmp/swectl-tests.tgz <<'SWECTL_TESTS_END' || exit 91\n{lines}\nSWECTL_TESTS_END\n"
        f"tar -xzf /tmp/swectl-tests.tgz -C {TESTS_DIR} --no-same-owner && rm -f /tmp/swectl-tests.tgz || exit 92\n"
        f"{exports}"
        f"cd {shlex.quote(workdir)} || exit 93\n"
        f"chmod +x {TESTS_DIR}/test.sh && ({TESTS_DIR}/test.sh) 2>&1 | tee /logs/verifier/test-stdout.txt\n"
        "code=${PIPESTATUS[0]}\n"
        'echo "SWECTL_HARBOR_TEST_EXIT=$code"\n'
    )


def _is_name(key: str) -> bool:
    return re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) is not None


def parse_reward(text: str, name: str) -> float:
    """The reward in a reward.txt (one number) or reward.json (``{"reward": x}``, or one number among its values);
    a HarborTaskError (for the grader: no reward) when it holds none."""
    if name.endswith(".txt"):
        try:
            return float(text.strip())
        except ValueError:
            raise HarborTaskError(f"{name}: {text.strip()[:80]!r} is not a number") from None
    try:
        data = msgspec.json.decode(text.encode())
    except msgspec.DecodeError as exc:
        raise HarborTaskError(f"{name}: not JSON ({exc})") from None
    if isinstance(data, int | float) and not isinstance(data, bool):
        return float(data)
    if isinstance(data, dict):
        if "reward" in data:
            if isinstance(data["reward"], int | float) and not isinstance(data["reward"], bool):
                return float(data["reward"])
            raise HarborTaskError(f"{name}: 'reward' is {data['reward']!r}, not a number")
        numbers = [v for v in data.values() if isinstance(v, int | float) and not isinstance(v, bool)]
        if len(numbers) == 1:
            return float(numbers[0])
    raise HarborTaskError(f"{name}: no 'reward' number in it")


def image_name(name: str, content: str) -> str:
    slug = re.sub(r"[^a-z0-9_.-]+", "-", name.lower()).strip("-.") or "task"
    return f"localhost/swectl-harbor.{slug}:{content[:16]}"


def read_task(folder: Path) -> Task:
    """One Harbor task folder as a Task (its image not built, its gold patch not made yet); a HarborTaskError
    naming the folder and what is wrong or unsupported."""
    folder = folder.resolve()
    where = str(folder)
    try:
        raw = tomllib.loads((folder / TASK_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise HarborTaskError(f"{where}/{TASK_FILE}: cannot read: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise HarborTaskError(f"{where}/{TASK_FILE}: not TOML: {exc}") from exc
    try:
        config = msgspec.convert(raw, HarborTaskConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise HarborTaskError(f"{where}/{TASK_FILE}: {exc}") from exc
    if missing := _unsupported(config, folder):
        raise HarborTaskError(f"{where}: swectl does not support {'; '.join(missing)}")
    try:
        instruction = (folder / "instruction.md").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise HarborTaskError(f"{where}/instruction.md: cannot read: {exc}") from exc
    if not instruction.strip():
        raise HarborTaskError(f"{where}/instruction.md: empty")
    dockerfile = folder / "environment" / "Dockerfile"
    if not dockerfile.is_file():
        raise HarborTaskError(f"{where}/environment/Dockerfile: missing (swectl builds the environment from it)")
    base, workdir = dockerfile_facts(dockerfile.read_text(encoding="utf-8", errors="replace"),
                                     f"{where}/environment/Dockerfile")
    if config.environment.workdir:
        workdir = config.environment.workdir.rstrip("/") or "/"
    tests = folder / "tests"
    if not (tests / "test.sh").is_file():
        raise HarborTaskError(f"{where}/tests/test.sh: missing (the verifier swectl runs)")
    env = {**config.environment.env, **config.verifier.env}
    script = verifier_script(tests, workdir, env)
    content = hashlib.sha256("\0".join([HARBOR_RECIPE, folder_hash(folder / "environment"), workdir,
                                        config.environment.docker_image or ""]).encode()).hexdigest()
    solution = folder / "solution"
    has_solution = (solution / "solve.sh").is_file()
    name = folder.name
    meta = HarborMeta(
        folder=where, environment_content=content, workdir=workdir, base_image=base,
        verifier_timeout_s=config.verifier.timeout_sec, agent_timeout_s=config.agent.timeout_sec,
        build_timeout_s=config.environment.build_timeout_sec, cpus=config.environment.cpus,
        memory_mb=config.environment.memory_mb, allow_internet=bool(config.environment.allow_internet),
        has_solution=has_solution, solution_content=folder_hash(solution) if has_solution else "")
    return Task(instance_id=name, repo=f"harbor/{name}", problem_statement=instruction, FAIL_TO_PASS=[],
                image=image_name(name, content), eval_script=script, log_parser=LOG_PARSER, eval_type="reward",
                source="harbor", extra={"harbor": msgspec.to_builtins(meta), "harbor_metadata": config.metadata})


def harbor_meta(task: Task) -> HarborMeta:
    """The Harbor settings a harbor Task carries (a TaskDataError when it is not one)."""
    try:
        return msgspec.convert(task.extra["harbor"], HarborMeta)
    except (KeyError, msgspec.ValidationError) as exc:
        raise TaskDataError(f"{task.instance_id}: not a Harbor task (no valid extra.harbor: {exc})") from exc


def is_harbor(task: Task) -> bool:
    return task.source == "harbor"


def sandbox_limits(task: Task) -> dict[str, Any]:
    """The env pool's lease limits a task asks for (``EnvPool.lease(image, **sandbox_limits(task))``): a Harbor task's
    ``[environment] cpus`` and ``memory_mb``; nothing for other tasks (the ``[sandbox]`` section's limits)."""
    if not is_harbor(task):
        return {}
    meta = harbor_meta(task)
    out: dict[str, Any] = {}
    if meta.cpus:
        out["cpus"] = float(meta.cpus)
    if meta.memory_mb:
        out["memory"] = f"{int(meta.memory_mb)}m"
    return out
