"""Harbor task environments, built offline, and their gold patches (swectl.tasks.harbor reads the task folders).

The image is the task's ``environment/Dockerfile`` built with podman (its folder as the build context, the network
of this machine for its RUN steps: PyPI and the apt mirror reach; nothing else does), with two changes:

- its ``FROM``: an image on this machine is used as it is; Debian 12 (``debian:bookworm``, ``-slim``, ``debian:12``)
  is swectl's own offline base, ``localhost/swectl-base:bookworm``; any other is a clear error for that task (this
  machine pulls from no registry);
- swectl's layer on top, as root: git (from apt when the image lacks it), ``/logs/verifier`` and ``/logs/agent``, the
  work folder committed as a git repository (the agent's final state is its diff) and ``/testbed`` a link to it
  (where swectl's agents and grader work).

The image is named after a hash of all that (``swectl.content``), so a build happens once per environment. The gold
patch is what ``solution/solve.sh`` changes in the work folder: run once in a container of the image (no network,
``/solution`` mounted read-only), the diff kept in the cache under the hash of the image and the solution.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec

from swectl.errors import CommandError
from swectl.images.builds import BuildStepError, ensure_image
from swectl.images.clones import Say
from swectl.images.project import DEFAULT_BASE, ImageBuildError, cache_dir, image_id
from swectl.remote.nodes.podman import run_local_podman
from swectl.tasks.harbor import HarborMeta, harbor_meta, is_harbor
from swectl.tasks.record import TESTBED, Task
from swectl.tasks.sources import LoadResult, RowProblem

# Images Harbor tasks start FROM that swectl's offline base stands in for (Debian 12; names without a registry are
# Docker Hub's library images).
DEBIAN_12 = frozenset({"debian:bookworm", "debian:bookworm-slim", "debian:12", "debian:12-slim"})
SOLVE_TIMEOUT_S = 900.0


def _normal(ref: str) -> str:
    ref = ref.split("@", 1)[0]
    for prefix in ("docker.io/library/", "docker.io/", "index.docker.io/library/"):
        if ref.startswith(prefix):
            return ref[len(prefix):]
    return ref


def stand_in(ref: str, base: str = DEFAULT_BASE) -> str:
    """The image this machine builds ``FROM ref`` on; an ImageBuildError saying what to do when there is none."""
    if image_id(ref) is not None:
        return ref
    if _normal(ref) in DEBIAN_12:
        if image_id(base) is None:
            raise ImageBuildError(f"FROM {ref}: swectl's offline Debian 12 base {base} is not here; run "
                                  "`bash scripts/setup.sh` (it builds it)")
        return base
    raise ImageBuildError(f"FROM {ref}: not on this machine and no offline stand-in for it (this machine pulls from no "
                          f"registry; swectl stands in for {', '.join(sorted(DEBIAN_12))} with {base}): load the image "
                          "into podman (podman load / build it here) or start FROM one of those")


def containerfile(dockerfile: str, base_ref: str, base: str, meta: HarborMeta) -> str:
    """The task's Dockerfile with its FROM on ``base`` and swectl's layer after its last line."""
    lines = dockerfile.splitlines()
    for i, line in enumerate(lines):
        if line.strip().upper().startswith("FROM "):
            lines[i] = line.replace(base_ref, base, 1)
            break
    workdir = meta.workdir
    # /testbed a link to the work folder; a /testbed the base image has (an image of another task) is moved aside
    link = (f" && {{ [ -L {TESTBED} ] || [ ! -e {TESTBED} ] || mv {TESTBED} {TESTBED}.base; }} && "
            f"ln -sfn {workdir} {TESTBED}" if workdir != TESTBED else "")
    git = "git -c user.name=swectl -c user.email=swectl@localhost -c init.defaultBranch=main"
    return "\n".join([
        *lines, "",
        "# swectl's layer: git, the log folders, the work folder as a repository (its diff is the agent's final state)",
        "USER root",
        "RUN command -v git >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive "
        "apt-get install -y -qq --no-install-recommends git >/dev/null && rm -rf /var/lib/apt/lists/*)",
        f"RUN mkdir -p /logs/verifier /logs/agent {workdir} && cd {workdir} && {git} init -q && "
        f"{git} add -A && {git} commit -q --allow-empty -m 'swectl: the harbor task environment'{link}",
        f"WORKDIR {workdir}",
        f"LABEL swectl.image=harbor swectl.content={meta.environment_content}",
        "",
    ])


def build_environment(task: Task, meta: HarborMeta, *, say: Say | None = None, base: str = DEFAULT_BASE) -> bool:
    """Build the task's image unless it is built; whether it was. ImageBuildError naming the step otherwise."""
    folder = Path(meta.folder) / "environment"
    dockerfile = (folder / "Dockerfile").read_text(encoding="utf-8", errors="replace")
    ref = meta.base_image
    from_image = stand_in(ref, base)

    def fill(ctx: Path) -> None:
        shutil.copytree(folder, ctx, dirs_exist_ok=True)
        (ctx / "Containerfile").write_text(containerfile(dockerfile, ref, from_image, meta))

    log = cache_dir() / "logs" / f"build-harbor-{task.instance_id}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    return ensure_image(task.image, meta.environment_content, fill, what=f"the Harbor task {task.instance_id}",
                        log=log, network=True, say=say, timeout=max(meta.build_timeout_s, 60.0))


def gold_patch(task: Task, meta: HarborMeta) -> str:
    """What ``solution/solve.sh`` changes in the work folder (cached); ImageBuildError when it fails."""
    cached = cache_dir() / "harbor" / f"gold-{meta.environment_content[:16]}-{meta.solution_content[:16]}.diff"
    if cached.is_file():
        return cached.read_text(encoding="utf-8", errors="surrogateescape")
    solution = Path(meta.folder) / "solution"
    script = (f"cd {meta.workdir} && bash /solution/solve.sh > /tmp/swectl-solve.log 2>&1; code=$?; "
              "if [ $code -ne 0 ]; then tail -c 2000 /tmp/swectl-solve.log >&2; exit $code; fi; "
              "git add -A && git diff --cached --binary")
    try:
        out = run_local_podman("run", "--rm", "--network", "none", "-v", f"{solution}:/solution:ro", task.image,
                               "bash", "-c", script, timeout=SOLVE_TIMEOUT_S)
    except CommandError as exc:
        raise ImageBuildError(f"{task.instance_id}: solution/solve.sh failed in the task's image: {exc}") from exc
    patch = out.stdout.decode("utf-8", errors="surrogateescape")
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(patch, encoding="utf-8", errors="surrogateescape")
    return patch


def prepare_harbor_tasks(tasks: list[Task], *, say: Say | None = None,
                         base: str = DEFAULT_BASE) -> tuple[list[Task], list[RowProblem]]:
    """Every Harbor task of ``tasks`` with its image built and its gold patch made (other tasks as they are); a
    task whose image does not build is left out, with a problem naming it and the step."""
    out: list[Task] = []
    problems: list[RowProblem] = []
    for task in tasks:
        if not is_harbor(task):
            out.append(task)
            continue
        meta = harbor_meta(task)
        try:
            build_environment(task, meta, say=say, base=base)
        except (ImageBuildError, BuildStepError, CommandError) as exc:
            problems.append(RowProblem(meta.folder, "environment", f"the image does not build: {exc}"))
            continue
        patch = ""
        if meta.has_solution:
            try:
                patch = gold_patch(task, meta)
            except ImageBuildError as exc:
                problems.append(RowProblem(meta.folder, "solution", str(exc)))
        out.append(msgspec.structs.replace(task, patch=patch))
    return out, problems


def with_harbor_prepared(loaded: LoadResult, *, say: Say | None = None) -> LoadResult:
    """``loaded`` (swectl.tasks.sources.load_tasks's result) with its Harbor tasks' images built and gold patches
    made (``prepare_harbor_tasks``), the tasks that failed moved to its problems; as it is without Harbor tasks."""
    if any(is_harbor(t) for t in loaded.tasks):
        loaded.tasks, problems = prepare_harbor_tasks(loaded.tasks, say=say)
        loaded.problems += problems
    return loaded
