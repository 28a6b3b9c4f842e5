"""The image tests' fleet: two sshd test nodes with Podman stores of their own, and the small two-layer images the
image-sync tests move (one environment image of random bytes, so its compressed layer is about that big, and thin
instance images on it, labelled the way swectl's builds label them)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from swectl.testing import nodes as testnodes
from swectl.testing.registry import can_run_registry

from .conftest import podman


def build_thin_images(work: Path, base: str, images: dict[str, str]) -> None:
    """For each ``name -> image`` of ``images``, a one-layer image on ``base`` holding ``/own`` ("image NAME")."""
    for name, image in images.items():
        ctx = work / name
        ctx.mkdir()
        (ctx / "own").write_text(f"image {name}\n")
        (ctx / "Containerfile").write_text(f"FROM {base}\nCOPY own /own\n")
        done = podman("build", "--network", "none", "-q", "-t", image, str(ctx), timeout=120)
        assert done.returncode == 0, done.stderr


def build_env_and_instances(work: Path, env_image: str, instances: Sequence[str], env_bytes: int,
                            own: Callable[[int], bytes]) -> None:
    """``env_image`` of ``env_bytes`` random bytes, and ``instances[i]`` on it adding a file of ``own(i)``."""
    env_dir = work / "env-root"
    env_dir.mkdir()
    (env_dir / "blob").write_bytes(os.urandom(env_bytes))
    tar = subprocess.run(["tar", "-C", str(env_dir), "-c", "."], capture_output=True, check=True, timeout=60).stdout
    done = podman("import", "--change", "LABEL swectl.image=env", "-", env_image, input=tar)
    assert done.returncode == 0, done.stderr
    for i, image in enumerate(instances):
        ctx = work / f"inst{i}"
        ctx.mkdir()
        (ctx / "own").write_bytes(own(i))
        (ctx / "Containerfile").write_text(
            f"FROM {env_image}\nCOPY own /own\n"
            f'LABEL swectl.image=instance swectl.instance=o__r-{i} swectl.env="{env_image}"\n'
        )
        done = podman("build", "--network", "none", "-q", "-t", image, str(ctx), timeout=120)
        assert done.returncode == 0, done.stderr


@contextlib.contextmanager
def own_store_fleet(build: Callable[[], None], images: Sequence[str], *, prefix: str, base_index: int
                    ) -> Iterator[testnodes.TestNodes]:
    """Two test nodes with their own stores, after ``build()`` made ``images`` here (removed again at the end); skips
    where test nodes or the registry cannot run."""
    for reason in (testnodes.can_run_test_nodes(), can_run_registry()):
        if reason is not None:
            pytest.skip(reason)
    try:
        build()
        with testnodes.test_nodes(2, prefix=prefix, base_index=base_index, own_store=True) as started:
            yield started
    finally:
        podman("rmi", "--force", *images)
