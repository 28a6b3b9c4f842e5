"""swectl.images.names: official names per project, templates, mapping files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from swectl.errors import ConfigError, TaskDataError
from swectl.images.names import ImageResolver, check_template, docker_id, load_image_map, official_image
from swectl.tasks.record import Task


def _task(instance_id: str = "django__django-11099", **fields: Any) -> Task:
    defaults: dict[str, Any] = {"repo": "django/django", "problem_statement": "", "FAIL_TO_PASS": ["t"]}
    return Task(instance_id=instance_id, **{**defaults, **fields})


def test_swe_bench_official_name() -> None:
    assert official_image(_task()) == "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    assert docker_id("Project-MONAI__MONAI-5") == "project-monai_1776_monai-5"


def test_swe_bench_name_matches_the_swebench_harness() -> None:
    image_spec = pytest.importorskip("swebench.image_builder.image_spec")
    for instance_id in ("django__django-11099", "sphinx-doc__sphinx-8721", "Project-MONAI__MONAI-5"):
        spec = image_spec.ImageSpec(instance_id=instance_id, dockerfile="FROM x", namespace="swebench")
        assert official_image(_task(instance_id)) == spec.name


def test_swe_gym_official_name() -> None:
    task = _task("Project-MONAI__MONAI-6975", repo="Project-MONAI/MONAI", source="swe-gym")
    assert official_image(task) == "xingyaoww/sweb.eval.x86_64.project-monai_s_monai-6975:latest"


def test_swe_smith_name_from_image_name_or_repo() -> None:
    iid = "oauthlib__oauthlib.1fd52536.combine_file__09vlzwgc"
    from_repo = _task(iid, repo="swesmith/oauthlib__oauthlib.1fd52536", source="swe-smith")
    assert official_image(from_repo) == "jyangballin/swesmith.x86_64.oauthlib_1776_oauthlib.1fd52536"
    with pytest.raises(TaskDataError, match="image_name"):
        official_image(_task(iid, repo="oauthlib/oauthlib", source="swe-smith"))


def test_a_tasks_own_image_wins_and_factory_tasks_need_one() -> None:
    assert official_image(_task(image="ghcr.io/me/x:1", source="swe-gym")) == "ghcr.io/me/x:1"
    with pytest.raises(TaskDataError, match="must carry its image"):
        official_image(_task(source="swectl-synth"))


def test_template_placeholders() -> None:
    task = _task(version="3.0")
    template = "reg:5000/{repo_slug}/{id_docker}:{version}|{instance_id}|{repo}|{official}"
    resolved = ImageResolver(template=template).resolve(task)
    assert resolved == (
        "reg:5000/django__django/django_1776_django-11099:3.0|django__django-11099|django/django|"
        "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    )
    assert (
        ImageResolver(template="mirror.local/{official}")
        .resolve(_task(source="swe-gym"))
        .startswith("mirror.local/xingyaoww/")
    )


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("reg/{instance}:x", r"unknown placeholder \{instance\} \(did you mean \{instance_id\}\?\)"),
        ("reg/{nope}", r"unknown placeholder \{nope\}; known placeholders: \{instance_id\}"),
        ("reg/{}", r"unknown placeholder \{\}"),
        ("reg/{repo!r}", "no format spec or conversion"),
        ("reg/{version:>5}", "no format spec or conversion"),
        ("reg/{repo", "literal brace"),
        ("  ", "empty template"),
    ],
)
def test_bad_templates_name_the_problem(template: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ImageResolver(template=template)


def test_check_template_lists_placeholders_and_allows_literal_braces() -> None:
    assert check_template("x/{{literal}}/{repo}") == ["repo"]


def test_template_official_placeholder_raises_for_factory_task_without_image() -> None:
    with pytest.raises(TaskDataError):
        ImageResolver(template="m/{official}").resolve(_task(source="swectl-synth"))
    # A template that does not use {official} does not need it.
    assert ImageResolver(template="m/{id_docker}").resolve(_task(source="swectl-synth")) == (
        "m/django_1776_django-11099"
    )


def test_mapping_file_json_and_toml_with_fallback(tmp_path: Path) -> None:
    as_json = tmp_path / "images.json"
    as_json.write_text(json.dumps({"django__django-11099": "local/django:1"}))
    as_toml = tmp_path / "images.toml"
    as_toml.write_text('[images]\n"django__django-11099" = "local/django:2"\n')
    other = _task("astropy__astropy-12907", repo="astropy/astropy")
    for path, expected in ((as_json, "local/django:1"), (as_toml, "local/django:2")):
        resolver = ImageResolver.from_options(map_file=path)
        assert resolver.resolve(_task()) == expected
        assert resolver.resolve(other) == "swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest"
    both = ImageResolver.from_options(template="t/{id_docker}", map_file=as_json)
    assert (both.resolve(_task()), both.resolve(other)) == ("local/django:1", "t/astropy_1776_astropy-12907")


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("bad.json", '{"a": 3}', r"'a': expected an image name \(a non-empty string\), got int"),
        ("bad.json", "[1, 2]", "expected an object"),
        ("bad.json", "{", "invalid JSON"),
        ("bad.toml", "a = ", "invalid TOML"),
        ("bad.yaml", "a: b", r"expected a \.json or \.toml file"),
    ],
)
def test_bad_mapping_files(tmp_path: Path, name: str, text: str, match: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_image_map(path)


def test_missing_mapping_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        ImageResolver.from_options(map_file=tmp_path / "absent.json")


def test_short_names_are_qualified_like_docker() -> None:
    from swectl.remote.nodes.podman import qualify_image

    assert qualify_image("swebench/sweb.eval.x86_64.django_1776_django-11099:latest") == (
        "docker.io/swebench/sweb.eval.x86_64.django_1776_django-11099:latest")
    assert qualify_image("localhost/swectl-proj.toolz:1.0.0") == "localhost/swectl-proj.toolz:1.0.0"
    assert qualify_image("mirror.local:5000/sweb/x") == "mirror.local:5000/sweb/x"
    assert qualify_image("quay.io/a/b:1") == "quay.io/a/b:1"
    assert qualify_image("plain") == "plain"


def test_listing_images_is_tried_again_when_an_image_vanishes_while_podman_lists(monkeypatch: Any) -> None:
    """`podman images -a` exits 125 ("image not known") when a build or another removal changes the store while it
    lists: a validation run with --prune died of it (pylint, 2026-12-07). The listing is tried again; a failure
    that stays is still raised."""
    from swectl.errors import CommandError
    from swectl.images import instance
    from swectl.schema import CommandOutput

    calls: list[bool] = []

    def flaky(*args: str, check: bool = True, **_: Any) -> CommandOutput:
        calls.append(check)
        if len(calls) == 1:
            return CommandOutput(exit_code=125, stdout=b"", stderr=b"Error: image not known")
        return CommandOutput(exit_code=0, stdout=b'[{"Id": "a", "Names": ["x"], "ParentId": "p"}]', stderr=b"")

    monkeypatch.setattr(instance, "run_local_podman", flaky)
    monkeypatch.setattr(instance.time, "sleep", lambda s: None)
    assert instance._ancestors_of_named_images() == {"p"} and calls == [False, False]

    def broken(*args: str, check: bool = True, **_: Any) -> CommandOutput:
        if check:
            raise CommandError("local", ["podman", *args], 125, "image not known")
        return CommandOutput(exit_code=125, stdout=b"", stderr=b"image not known")

    monkeypatch.setattr(instance, "run_local_podman", broken)
    with pytest.raises(CommandError):
        instance._all_images()
