"""Instance images for classic SWE-bench rows, built offline from a local clone of each task's repository.

One image per task, on swectl's base image (Debian with python3.11, no conda):

- ``/testbed`` is the task's repository at ``base_commit``, with its history up to there and nothing later
  (clones.py).
- ``/opt/venv`` is a virtual environment (first on PATH) filled in stages: the test runner, the spec's
  ``packages``, the project's build requirements, the spec's ``pip_packages`` (requirements.py); every
  distribution is downloaded on the host into a shared cached pool (wheels.py) and installed offline.
- pip stays offline in the image, ``/opt/miniconda3/bin/activate`` is a conda shim, and the spec's
  ``pre_install`` and ``install`` run at build time (recipe.py), so the official eval scripts run unchanged.

The spec's ``python`` is not honoured: every image runs the base image's Python 3.11, so pins that never got a
3.11 build are built from source or dropped, with warnings. This module plans a build (the content hash over
everything that goes into the image), writes the build context and runs ``podman build --network none``;
images carry the label ``swectl.content`` and are rebuilt only when it changes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

import msgspec

from swectl.errors import CommandError, SwectlError
from swectl.images.clones import Say, Testbed, ancestor_tags, find_clone, resolve_commit
from swectl.images.names import docker_id
from swectl.images.project import DEFAULT_BASE, BuiltImage, ImageBuildError, cache_dir, image_id, image_label
from swectl.images.recipe import (
    WARNING_TAG,
    conda_shim,
    containerfile_body,
    install_deps_script,
    setup_script,
    stage_file,
)
from swectl.images.requirements import Requirements, spec_requirements
from swectl.images.wheels import StageWheels, cache_key, fetch_project_dependencies, fetch_stage, wheel_pool
from swectl.remote.nodes.podman import run_local_podman
from swectl.tasks.record import Task
from swectl.tasks.specs import RepoSpec, SpecTable

INSTANCE_PREFIX = "localhost/swectl-inst."

BuildStatus = Literal["built", "cached", "failed", "skipped"]


class InstanceOutcome(msgspec.Struct, kw_only=True):
    """The outcome of building one task's image (``build_instance_images``)."""

    instance_id: str
    status: BuildStatus
    image: str = ""
    message: str = ""
    warnings: list[str] = []
    seconds: float = 0.0
    built: BuiltImage | None = None

    @property
    def ok(self) -> bool:
        return self.status in ("built", "cached")


def instance_image_name(task: Task) -> str:
    """``localhost/swectl-inst.<id>:latest`` with the id lowercased and ``__`` written ``_1776_``."""
    return f"{INSTANCE_PREFIX}{docker_id(task.instance_id)}:latest"


def _label(task: Task, content: str) -> str:
    return (f"LABEL swectl.image=instance swectl.instance={json.dumps(task.instance_id)} "
            f"swectl.content={content}\n")


class _Plan(msgspec.Struct, frozen=True):
    """Everything one build writes into its context but the testbed, and the content hash of the image."""

    image: str
    commit: str
    stages: list[StageWheels]
    files: dict[str, str]  # build-context path -> text
    content: str
    warnings: list[str]


def _fetch_all(reqs: Requirements, testbed: Testbed, log: Path) -> list[StageWheels]:
    stages = [fetch_stage(stage, log) for stage in reqs.stages]
    if reqs.project_extras is not None:
        stages.append(fetch_project_dependencies(testbed, reqs.project_extras, log))
    return stages


def _plan(task: Task, spec: RepoSpec, testbed: Testbed, base: str, allow_network: bool, log: Path,
          say: Say) -> _Plan:
    base_id = image_id(base)
    if base_id is None:
        raise ImageBuildError(f"base image {base} is missing; run scripts/setup.sh")
    reqs = spec_requirements(task, spec, testbed.clone, testbed.commit)
    say(f"{task.instance_id}: wheels for {', '.join(s.name for s in reqs.stages)}"
        + (", project dependencies" if reqs.project_extras is not None else ""))
    stages = _fetch_all(reqs, testbed, log)
    setup, setup_warnings = setup_script(spec, allow_network=allow_network)
    files = {
        "tools/install-deps.sh": install_deps_script(stages),
        "tools/conda-activate": conda_shim(),
        "tools/setup.sh": setup,
        "Containerfile": containerfile_body(base),
        **{f"wheels/{stage_file(i, s.name)}": "".join(f"{r}\n" for r in s.install) for i, s in enumerate(stages)},
    }
    recipe = [base_id, testbed.commit, testbed.tags, files, [(s.name, s.files) for s in stages], allow_network]
    content = cache_key("content", msgspec.to_builtins(recipe))
    warnings = [*reqs.notes, *(n for s in stages for n in s.notes), *setup_warnings]
    return _Plan(image=instance_image_name(task), commit=testbed.commit, stages=stages, files=files,
                 content=content, warnings=warnings)


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _write_context(task: Task, plan: _Plan, ctx: Path, testbed: Testbed) -> None:
    testbed.get()
    wheels = ctx / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    for name in sorted({f for s in plan.stages for f in s.files}):
        _link(wheel_pool() / name, wheels / name)
    for rel, text in plan.files.items():
        (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
        (ctx / rel).write_text(text)
    with (ctx / "Containerfile").open("a") as f:
        f.write(_label(task, plan.content))


def _podman_build(image: str, ctx: Path, log: Path, allow_network: bool) -> str:
    args = ["build", "--pull=never", "-t", image, "-f", str(ctx / "Containerfile")]
    args += [] if allow_network else ["--network", "none"]
    try:
        out = run_local_podman(*args, str(ctx), timeout=3600, check=False, log=log)
    except CommandError as exc:
        raise ImageBuildError(f"podman build of {image} did not finish; log: {log}\n{exc}") from exc
    output = (out.stdout + out.stderr).decode(errors="replace")
    if out.exit_code != 0:
        _drop_failed_layers(output)
        raise ImageBuildError(f"podman build of {image} failed (exit {out.exit_code}); log: {log}; "
                              f"build context kept at {ctx}\n{output[-1500:]}")
    return output


def _drop_failed_layers(output: str) -> None:
    """A failed build leaves the images of the steps it committed, untagged; remove the last one (podman then
    removes its parents that nothing else uses), so failed tasks do not pile up gigabytes of layers."""
    committed = re.findall(r"^--> ([0-9a-f]{7,64})$", output, flags=re.MULTILINE)
    if committed:
        # not forced: a layer another image uses stays
        run_local_podman("rmi", committed[-1], timeout=300, check=False)


def _build(task: Task, spec: RepoSpec, repo_cache: Path, *, base: str, say: Say, force: bool,
           allow_network: bool) -> tuple[BuiltImage, list[str]]:
    log = cache_dir() / "logs" / f"build-inst-{task.instance_id}.log"
    clone = find_clone(Path(repo_cache), task.repo)
    commit = resolve_commit(clone, task.base_commit)
    ctx = cache_dir() / "build" / f"inst-{task.instance_id}"
    shutil.rmtree(ctx, ignore_errors=True)
    testbed = Testbed(clone, commit, ancestor_tags(clone, commit), ctx / "testbed",
                       lambda line: say(f"{task.instance_id}: {line}"))
    plan = _plan(task, spec, testbed, base, allow_network, log, say)
    for warning in plan.warnings:
        say(f"{task.instance_id}: warning: {warning}")
    if not force and image_label(plan.image, "swectl.content") == plan.content:
        shutil.rmtree(ctx, ignore_errors=True)
        say(f"{task.instance_id}: {plan.image} is up to date")
        return BuiltImage(plan.image, plan.content, plan.commit, cached=True), plan.warnings
    _write_context(task, plan, ctx, testbed)
    say(f"{task.instance_id}: building {plan.image} (log: {log})")
    output = _podman_build(plan.image, ctx, log, allow_network)
    shutil.rmtree(ctx, ignore_errors=True)
    build_warnings = [line.strip() for line in output.splitlines() if line.startswith(WARNING_TAG)]
    for warning in build_warnings:
        say(f"{task.instance_id}: {warning}")
    return BuiltImage(plan.image, plan.content, plan.commit, cached=False), [*plan.warnings, *build_warnings]


def build_instance_image(
    task: Task, spec: RepoSpec, repo_cache: Path, *, base: str = DEFAULT_BASE, say: Say = print,
    force: bool = False, allow_network: bool = False,
) -> BuiltImage:
    """Build (or reuse, when its content label matches) the instance image of one classic SWE-bench task."""
    return _build(task, spec, repo_cache, base=base, say=say, force=force, allow_network=allow_network)[0]


def _skip_reason(task: Task) -> str:
    if task.image or task.eval_script:
        return "the row carries its own image / eval script"
    if not (task.test_patch and task.version and task.base_commit):
        return "not a classic SWE-bench row (needs test_patch, version and base_commit)"
    return ""


def _outcome(task: Task, specs: SpecTable, repo_cache: Path, *, base: str, say: Say, force: bool,
             allow_network: bool) -> InstanceOutcome:
    started = time.monotonic()
    skip = _skip_reason(task)
    if skip:
        return InstanceOutcome(instance_id=task.instance_id, status="skipped", message=skip)
    try:
        spec = specs.get(task.repo, task.version)
        built, warnings = _build(task, spec, repo_cache, base=base, say=say, force=force,
                                 allow_network=allow_network)
    except (SwectlError, OSError, subprocess.SubprocessError) as exc:
        say(f"{task.instance_id}: FAILED: {exc}")
        return InstanceOutcome(instance_id=task.instance_id, status="failed", message=str(exc),
                               seconds=round(time.monotonic() - started, 1))
    return InstanceOutcome(
        instance_id=task.instance_id, status="cached" if built.cached else "built", image=built.image,
        warnings=warnings, seconds=round(time.monotonic() - started, 1), built=built,
    )


def build_instance_images(
    tasks: Iterable[Task], specs: SpecTable, repo_cache: Path, *, base: str = DEFAULT_BASE, say: Say = print,
    force: bool = False, allow_network: bool = False,
) -> list[InstanceOutcome]:
    """Build every task's image in turn, going on past failures; one outcome per task, in order."""
    return [
        _outcome(t, specs, Path(repo_cache), base=base, say=say, force=force, allow_network=allow_network)
        for t in tasks
    ]


def remove_instance_image(image: str) -> bool:
    """Remove ``image``; podman removes with it the intermediate images of its build that nothing else uses
    (the dependency layers stay while another task's image shares them). Whether it was removed."""
    return run_local_podman("rmi", "-f", image, timeout=300, check=False).exit_code == 0

def write_image_map(results: Iterable[InstanceOutcome], path: Path) -> dict[str, str]:
    """Write ``{instance_id: image}`` of the images built or reused (JSON, for ``swectl eval --image-map``)."""
    mapping = {r.instance_id: r.image for r in results if r.ok and r.image}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(mapping, indent=2, sort_keys=True) + "\n")
    return mapping
