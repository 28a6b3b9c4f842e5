"""Container image names for tasks. Pure: nothing here talks to podman or a registry.

Official names, as the projects publish them (all lowercase; Docker Hub forbids ``__`` in names):

- SWE-bench: ``swebench/sweb.eval.x86_64.<id>:latest`` with ``__`` written ``_1776_`` (the swebench harness's
  ``ImageSpec.name``), e.g. ``swebench/sweb.eval.x86_64.django_1776_django-11099:latest``;
- SWE-Gym: ``xingyaoww/sweb.eval.x86_64.<id>:latest`` with ``__`` written ``_s_``;
- SWE-smith: rows carry ``image_name``; without one, ``jyangballin/swesmith.x86_64.<owner>_1776_<name>.<commit>``
  from the row's ``repo`` (``swesmith/<owner>__<name>.<commit>``);
- swectl factory tasks always carry their image.

``ImageResolver`` overrides these for a whole set: an instance_id -> image mapping file (JSON or TOML), and/or a
name template such as ``registry.local:5000/{official}`` or ``myorg/sweb.{id_docker}:v1``.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import string
import tomllib
from pathlib import Path
from typing import Any

import msgspec

from swectl.errors import ConfigError, TaskDataError
from swectl.tasks.record import Task

SWEBENCH_PREFIX = "swebench/sweb.eval.x86_64."
SWEGYM_PREFIX = "xingyaoww/sweb.eval.x86_64."
SWESMITH_PREFIX = "jyangballin/swesmith.x86_64."
SWEBENCH_DUNDER = "_1776_"
SWEGYM_DUNDER = "_s_"

PLACEHOLDERS: dict[str, str] = {
    "instance_id": "the instance id as written in the row",
    "id_docker": "the instance id lowercased with __ written _1776_ (SWE-bench's Docker Hub form)",
    "repo": "owner/name",
    "repo_slug": "owner__name",
    "version": "the task's version (may be empty)",
    "official": "the official image name (see swectl.images.names)",
}

_SMITH_REPO = re.compile(r"^(?:swesmith/)?([\w.-]+__[\w.-]+\.[0-9a-f]{7,40})$")


def docker_id(instance_id: str, dunder: str = SWEBENCH_DUNDER) -> str:
    """``instance_id`` as Docker Hub accepts it: lowercase, ``__`` replaced by ``dunder``."""
    return instance_id.replace("__", dunder).lower()


def official_image(task: Task) -> str:
    """The image the task's project publishes; ``task.image`` when the row names one."""
    if task.image:
        return task.image
    match task.source:
        case "swe-gym":
            return f"{SWEGYM_PREFIX}{docker_id(task.instance_id, SWEGYM_DUNDER)}:latest"
        case "swe-smith":
            return _smith_image(task)
        case "swectl-synth":
            raise TaskDataError(f"{task.instance_id}: a swectl-synth task must carry its image; this one has none")
        case _:
            return f"{SWEBENCH_PREFIX}{docker_id(task.instance_id)}:latest"


def _smith_image(task: Task) -> str:
    match = _SMITH_REPO.match(task.repo)
    if not match:
        raise TaskDataError(
            f"{task.instance_id}: SWE-smith task without image_name, and its repo {task.repo!r} is not of the form "
            "swesmith/<owner>__<name>.<commit>\n  hint: add image_name to the row or pass --image-map"
        )
    return SWESMITH_PREFIX + match.group(1).replace("__", SWEBENCH_DUNDER).lower()


def check_template(template: str) -> list[str]:
    """The placeholders ``template`` uses; ConfigError naming any unknown or malformed one."""
    where = f"image template {template!r}"
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}\n  hint: write a literal brace as {{{{ or }}}}") from exc
    used: list[str] = []
    for _literal, name, spec, conversion in parsed:
        if name is None:
            continue
        if name not in PLACEHOLDERS:
            close = difflib.get_close_matches(name, list(PLACEHOLDERS), n=1)
            suggestion = f" (did you mean {{{close[0]}}}?)" if close else ""
            known = ", ".join(f"{{{p}}}" for p in PLACEHOLDERS)
            raise ConfigError(f"{where}: unknown placeholder {{{name}}}{suggestion}; known placeholders: {known}")
        if spec or conversion:
            raise ConfigError(f"{where}: placeholder {{{name}}} takes no format spec or conversion")
        used.append(name)
    if not template.strip():
        raise ConfigError(f"{where}: empty template")
    return used


def placeholder_values(task: Task, names: list[str] | None = None) -> dict[str, str]:
    """Values of the template placeholders for ``task`` (only ``names`` when given; ``{official}`` may raise)."""
    values = {
        "instance_id": lambda: task.instance_id,
        "id_docker": lambda: docker_id(task.instance_id),
        "repo": lambda: task.repo,
        "repo_slug": lambda: task.repo.replace("/", "__"),
        "version": lambda: task.version,
        "official": lambda: official_image(task),
    }
    return {name: values[name]() for name in (names if names is not None else list(values))}


class ImageResolver(msgspec.Struct, frozen=True, kw_only=True):
    """Image name per task: the mapping first, then the template, then ``official_image``."""

    template: str = ""
    mapping: dict[str, str] = {}
    # Where the mapping came from (a file path), for messages.
    mapping_origin: str = ""

    def __post_init__(self) -> None:
        if self.template:
            check_template(self.template)

    @classmethod
    def from_options(cls, template: str | None = None, map_file: str | os.PathLike[str] | None = None) -> ImageResolver:
        """Build from ``--image-template`` / ``--image-map`` values (either, both or neither)."""
        mapping = load_image_map(map_file) if map_file is not None else {}
        return cls(template=template or "", mapping=mapping, mapping_origin=str(map_file or ""))

    def resolve(self, task: Task) -> str:
        mapped = self.mapping.get(task.instance_id)
        if mapped:
            return mapped
        if self.template:
            names = check_template(self.template)
            return self.template.format(**placeholder_values(task, names))
        return official_image(task)


def load_image_map(path: str | os.PathLike[str]) -> dict[str, str]:
    """Read an instance_id -> image mapping from JSON or TOML (flat, or under an ``images`` table)."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"image map {path}: cannot read: {exc}") from exc
    document = _parse_map(text, file)
    if isinstance(document.get("images"), dict):
        document = document["images"]
    for key, value in document.items():
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(
                f"image map {path}: {key!r}: expected an image name (a non-empty string), got {type(value).__name__}"
            )
    return dict(document)


def _parse_map(text: str, file: Path) -> dict[str, Any]:
    suffix = file.suffix.lower()
    try:
        if suffix == ".toml":
            document: Any = tomllib.loads(text)
        elif suffix == ".json":
            document = json.loads(text)
        else:
            raise ConfigError(f"image map {file}: expected a .json or .toml file")
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"image map {file}: invalid {suffix[1:].upper()}: {exc}") from exc
    if not isinstance(document, dict):
        raise ConfigError(f"image map {file}: expected an object of instance_id = image, got {type(document).__name__}")
    return document
