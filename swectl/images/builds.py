"""Podman builds of swectl's derived images, one way for all of them (apt, python, environment, instance images).

An image is made from a build context and named after a hash of everything that goes into it, its *content*, which
its ``swectl.content`` label carries. ``ensure_image`` builds it only when no image of that name carries that label:
under a lock per content (threads and processes alike: two builds of one environment build it once), with a disk
check before podman starts, and a failure that names the Containerfile step it stopped in, drops the half-made
layers and never leaves an image that a later build would take as done (the label is the last layer).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from swectl.errors import CommandError
from swectl.images.clones import Say
from swectl.images.project import ImageBuildError, cache_dir, drop_failed_layers, image_label
from swectl.remote.nodes.podman import run_local_podman

# How long a build waits for another one building the same image (seconds).
LOCK_TIMEOUT_S = 3600.0
# Free disk a build must leave at least (bytes; $SWECTL_BUILD_MIN_FREE overrides): below it the build stops before
# podman starts, rather than filling the disk halfway through a layer.
MIN_FREE_BYTES = 2 << 30
BUILD_TIMEOUT_S = 3600.0
KEPT_FOR_A_LOOK = ("install_deps", "setup")  # a build that failed in these RUN steps keeps its context


class BuildStepError(ImageBuildError):
    """A build that failed in a known step (swectl.images.instance.BUILD_STEPS)."""

    def __init__(self, step: str, message: str) -> None:
        super().__init__(message)
        self.step = step


def ensure_image(image: str, content: str, fill: Callable[[Path], None], *, what: str, log: Path, network: bool,
                 say: Say | None = None, timeout: float = BUILD_TIMEOUT_S) -> bool:
    """Build ``image`` unless an image of that name is labelled ``swectl.content=content``; whether it was built.
    ``fill(ctx)`` writes the build context (a Containerfile that labels the image with ``content`` last, and its
    files) into an empty folder; ``what`` says what the image is, in messages. The context is removed afterwards,
    except when a RUN step failed (kept for a look). BuildStepError (disk, podman_build, install_deps or setup)
    when it does not build."""
    with build_lock(content):
        if image_label(image, "swectl.content") == content:
            return False
        ctx = cache_dir() / "build" / content
        shutil.rmtree(ctx, ignore_errors=True)
        ctx.mkdir(parents=True)
        try:
            fill(ctx)
            check_disk(ctx)
            if say is not None:
                say(f"building {image}, {what} (log: {log})")
            podman_build(image, ctx, log, network=network, timeout=timeout)
        except BuildStepError as exc:
            if exc.step not in KEPT_FOR_A_LOOK:
                shutil.rmtree(ctx, ignore_errors=True)
            raise
        except BaseException:
            shutil.rmtree(ctx, ignore_errors=True)
            raise
        shutil.rmtree(ctx, ignore_errors=True)
        return True


@contextlib.contextmanager
def build_lock(key: str, timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold an exclusive lock named ``key`` in the cache (threads and processes alike), waiting at most
    ``timeout`` seconds for it."""
    path = cache_dir() / "locks" / f"{key}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ImageBuildError(f"waited {timeout:.0f} s for another build holding {path}; "
                                          "is one hung?") from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def podman_build(image: str, ctx: Path, log: Path, *, network: bool, timeout: float = BUILD_TIMEOUT_S) -> str:
    """``podman build`` of ``ctx`` (its Containerfile) as ``image``, without pulling and, unless ``network``,
    without a network; its output. BuildStepError naming the step that failed, with the output's tail."""
    args = ["build", "--pull=never", "-t", image, "-f", str(ctx / "Containerfile")]
    args += [] if network else ["--network", "none"]
    try:
        out = run_local_podman(*args, str(ctx), timeout=timeout, check=False, log=log)
    except CommandError as exc:
        raise BuildStepError("podman_build", f"podman build of {image} did not finish; log: {log}\n{exc}") from exc
    output = (out.stdout + out.stderr).decode(errors="replace")
    if out.exit_code != 0:
        drop_failed_layers(output)
        if "no space left on device" in output.lower():
            shutil.rmtree(ctx, ignore_errors=True)  # the context is what can be given back at once
            root = storage_root()
            raise BuildStepError("disk", f"podman build of {image} ran out of disk (no space left on device): "
                                         f"{gib(shutil.disk_usage(root).free)} free in {root} now; free some "
                                         f"(swectl image prune --instances) and build again; log: {log}")
        step = failed_run_step(output)
        raise BuildStepError(step, f"podman build of {image} failed in {step} (exit {out.exit_code}); log: {log}; "
                                   f"build context kept at {ctx}\n{output[-1500:]}")
    return output


def failed_run_step(output: str) -> str:
    """Which of the Containerfile's RUN steps a failed ``podman build``'s output stopped in: ``install_deps``
    (the venv's dependencies), ``setup`` (the spec's pre_install / install) or ``podman_build`` (elsewhere)."""
    steps = re.findall(r"^STEP \d+/\d+: (.*)$", output, flags=re.MULTILINE)
    last = steps[-1] if steps else ""
    if "install-deps.sh" in last:
        return "install_deps"
    if "setup.sh" in last:
        return "setup"
    return "podman_build"


def storage_root() -> Path:
    """Where podman keeps image layers on this node (its graph root)."""
    out = run_local_podman("info", "--format", "{{.Store.GraphRoot}}", timeout=60, check=False)
    root = out.stdout.decode().strip()
    return Path(root) if out.exit_code == 0 and root else Path("/var/lib/containers/storage")


def gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (links not followed; a file that vanishes meanwhile counts 0)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
    return total


def check_disk(ctx: Path) -> None:
    """Stop a build that would not fit: it needs about three times its build context (the context copied into a
    layer, the wheels installed, the testbed's install) on podman's storage, and MIN_FREE_BYTES left after that.
    Raises BuildStepError("disk") saying how much is needed and how much there is."""
    root = storage_root()
    context = tree_bytes(ctx)
    need = 3 * context + int(os.environ.get("SWECTL_BUILD_MIN_FREE") or MIN_FREE_BYTES)
    free = shutil.disk_usage(root).free
    if free < need:
        shutil.rmtree(ctx, ignore_errors=True)
        raise BuildStepError("disk", f"not enough disk for this build: it needs about {gib(need)} free in {root} "
                                     f"(three times its {gib(context)} context plus a reserve), {gib(free)} is; "
                                     "free some (swectl image prune --instances) or lower the reserve "
                                     "($SWECTL_BUILD_MIN_FREE, bytes)")
