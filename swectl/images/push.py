"""`swectl image push`: publish the images a task set runs in to a registry the fleet pulls from.

Which images: with a task set, each task's image (as ``swectl eval`` resolves it: ``--image-map``,
``--image-template``, the row's own or the official name) and, for instance images built here
(``swectl image build --repo-cache``), the environment image under each (its ``swectl.env`` label), pushed first;
without one, every environment and instance image built here. One ``podman push`` at a time, environment images
first: the registry then has the shared layers when an instance image's turn comes, and podman sends only its own
layer. An image that is not on this machine is reported and the rest goes on. ``push_with`` is one push through a
PodmanCli, asynchronously (`image sync` from the controller pushes to its own registry with it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import msgspec

from swectl.errors import CommandError
from swectl.images.names import ImageResolver
from swectl.images.project import image_label
from swectl.images.registry import Registry
from swectl.remote.nodes.podman import PodmanCli, qualify_image, run_local_podman
from swectl.tasks.record import Task

PUSH_TIMEOUT_S = 3600.0


class PushOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """One image pushed, or not."""

    image: str
    ref: str  # its name in the registry
    ok: bool
    seconds: float = 0.0
    error: str = ""


def task_images(tasks: Iterable[Task], resolver: ImageResolver | None = None) -> list[str]:
    """The images ``tasks`` run in, each once, in the order of the tasks (names as podman qualifies them)."""
    resolver = resolver if resolver is not None else ImageResolver()
    return list(dict.fromkeys(qualify_image(resolver.resolve(task)) for task in tasks))


def built_images() -> list[str]:
    """Every environment image, then every instance image, built on this machine (by their ``swectl.image`` label)."""
    names: list[str] = []
    for kind in ("env", "instance"):
        out = run_local_podman("images", "--filter", f"label=swectl.image={kind}", "--format",
                               "{{.Repository}}:{{.Tag}}", timeout=120)
        names += [n for n in out.stdout.decode().split() if n and not n.startswith("<none>")]
    return list(dict.fromkeys(names))


def with_environments(images: Iterable[str]) -> list[str]:
    """``images`` with the environment image of each instance image placed before it (once)."""
    ordered: list[str] = []
    for image in images:
        env = image_label(image, "swectl.env")
        if env:
            ordered.append(qualify_image(env))
        ordered.append(image)
    return list(dict.fromkeys(ordered))


def push_image(image: str, registry: Registry, *, timeout: float = PUSH_TIMEOUT_S) -> PushOutcome:
    ref = registry.ref(image)
    start = time.monotonic()
    try:
        run_local_podman("push", *registry.tls_args(), image, f"docker://{ref}", timeout=timeout)
    except CommandError as exc:
        return PushOutcome(image=image, ref=ref, ok=False, seconds=time.monotonic() - start,
                           error=_last_error(exc.stderr) or str(exc))
    return PushOutcome(image=image, ref=ref, ok=True, seconds=time.monotonic() - start)


async def push_with(cli: PodmanCli, image: str, registry: Registry) -> PushOutcome:
    """``podman push`` of ``image`` to ``registry`` through ``cli`` (the controller's podman, asynchronously:
    cancelling it kills the push). The caller bounds the wait."""
    ref = registry.ref(image)
    start = time.monotonic()
    await cli.ensure_ready()
    out = await cli.run("push", *registry.tls_args(), image, f"docker://{ref}", check=False)
    error = "" if out.exit_code == 0 else (_last_error(out.stderr.decode(errors="replace")) or
                                           f"podman push exited {out.exit_code}")
    return PushOutcome(image=image, ref=ref, ok=not error, seconds=time.monotonic() - start, error=error)


def push_images(images: list[str], registry: Registry, *, say: Callable[[str], None] = print) -> list[PushOutcome]:
    """Push ``images`` one after the other (missing ones are failed outcomes that say so)."""
    outcomes = []
    for i, image in enumerate(images, 1):
        if run_local_podman("image", "exists", image, timeout=60, check=False).exit_code != 0:
            outcome = PushOutcome(image=image, ref=registry.ref(image), ok=False,
                                  error="not on this machine (build it first: swectl image build)")
        else:
            outcome = push_image(image, registry)
        state = f"pushed in {outcome.seconds:.1f}s" if outcome.ok else f"FAILED: {outcome.error}"
        say(f"[{i}/{len(images)}] {image} -> {outcome.ref}: {state}")
        outcomes.append(outcome)
    return outcomes


def _last_error(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("Error:")]
    return (errors or lines or [""])[-1]
