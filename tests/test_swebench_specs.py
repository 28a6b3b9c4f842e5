"""swectl.tasks.specs: loading SWE-bench 4.1.0's spec table, lookups, errors, the repo -> log parser map."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from swectl.errors import SpecError, SwectlError
from swectl.tasks import specs as specs_mod
from swectl.tasks.specs import REPO_LOG_PARSERS, RepoSpec, SpecTable, load_specs, log_parser_name

ROOT = Path(__file__).resolve().parents[1]
FETCH = ROOT / "scripts" / "fetch_swebench_specs.sh"


def _verified_rows(verified_path: Path) -> list[dict]:
    return [json.loads(line) for line in verified_path.read_text().splitlines() if line.strip()]


@pytest.fixture
def no_specs_anywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(specs_mod.SPECS_ENV, raising=False)
    monkeypatch.setattr(specs_mod, "default_spec_paths", lambda: [tmp_path / "absent.py"])


def _write_table(path: Path, table: dict) -> Path:
    path.write_text(f"{specs_mod.SPECS_TABLE_NAME} = {table!r}\n")
    return path


def test_default_file_loads_and_has_the_known_shape(specs: SpecTable) -> None:
    assert specs.source.endswith("constants_python.py")
    django = specs.get("django/django", "3.0")
    assert isinstance(django, RepoSpec)
    assert (django.repo, django.version, django.python) == ("django/django", "3.0", "3.6")
    assert "tests/runtests.py" in django.test_cmd
    assert any(cmd.startswith("export LANG=") for cmd in django.eval_commands)
    assert django.install
    assert django.extra == {}
    sklearn = specs.get("scikit-learn/scikit-learn", "0.20")
    assert sklearn.pip_packages
    assert sklearn.packages
    assert sklearn.test_cmd.startswith("pytest")


def test_every_python_spec_converts(specs: SpecTable) -> None:
    for repo in specs.repos():
        for version in specs.versions(repo):
            spec = specs.get(repo, version)
            assert spec.extra == {}, (repo, version, spec.extra)


def test_every_verified_row_has_a_spec(specs: SpecTable, verified_path: Path) -> None:
    pairs = {(row["repo"], row["version"]) for row in _verified_rows(verified_path)}
    for repo, version in sorted(pairs):
        assert specs.get(repo, version).test_cmd, (repo, version)


def test_unknown_repo_and_version_errors_list_what_is_known(specs: SpecTable) -> None:
    with pytest.raises(SpecError, match=r"known repos: .*django/django"):
        specs.get("nobody/nothing", "1.0")
    with pytest.raises(SpecError, match=r"version '0\.1'.*known: .*1\.11, 2\.0, 2\.1, 2\.2, 3\.0") as info:
        specs.get("django/django", "0.1")
    assert isinstance(info.value, SwectlError)
    assert not specs.has("django/django", "0.1")
    assert specs.has("django/django", "3.0")


def test_versions_sort_numerically(specs: SpecTable) -> None:
    versions = specs.versions("django/django")
    assert versions.index("1.9") < versions.index("1.10") < versions.index("2.0")


def test_explicit_path_and_env_var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = {"acme/widgets": {"1.0": {"python": "3.9", "test_cmd": "pytest -rA", "future_key": 1}}}
    path = _write_table(tmp_path / "specs.py", table)
    spec = load_specs(path).get("acme/widgets", "1.0")
    assert (spec.python, spec.test_cmd, spec.extra) == ("3.9", "pytest -rA", {"future_key": 1})
    monkeypatch.setenv(specs_mod.SPECS_ENV, str(path))
    assert load_specs().source == str(path.resolve())
    assert "_swectl_swebench4_specs" not in sys.modules


def test_missing_file_tells_how_to_fetch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SpecError, match=r"fetch_swebench_specs\.sh"):
        load_specs(tmp_path / "nope.py")
    monkeypatch.setenv(specs_mod.SPECS_ENV, str(tmp_path / "also-nope.py"))
    with pytest.raises(SpecError, match=r"also-nope\.py does not exist.*fetch_swebench_specs\.sh"):
        load_specs()


def test_file_without_the_table_or_broken(tmp_path: Path) -> None:
    empty = tmp_path / "empty.py"
    empty.write_text("OTHER = {}\n")
    with pytest.raises(SpecError, match="MAP_REPO_VERSION_TO_SPECS_PY"):
        load_specs(empty)
    broken = tmp_path / "broken.py"
    broken.write_text("MAP_REPO_VERSION_TO_SPECS_PY = {\n")
    with pytest.raises(SpecError, match="failed to load"):
        load_specs(broken)


def test_nothing_found_is_a_clear_error(no_specs_anywhere: None) -> None:
    # swebench 5.x (installed) has no MAP_REPO_VERSION_TO_SPECS, so nothing is left to fall back to.
    with pytest.raises(SpecError, match=r"not found .*fetch_swebench_specs\.sh"):
        load_specs()


def test_installed_swebench_4_table_is_used(no_specs_anywhere: None, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("swebench.harness.constants")
    fake.MAP_REPO_VERSION_TO_SPECS = {"acme/widgets": {"2.0": {"python": "3.11", "test_cmd": ["a", "b"]}}}
    monkeypatch.setitem(sys.modules, "swebench.harness.constants", fake)
    table = load_specs()
    assert table.source.startswith("installed")
    assert table.versions("acme/widgets") == ["2.0"]
    with pytest.raises(SpecError, match="not a Python-repo spec"):
        table.get("acme/widgets", "2.0")  # a non-Python (list) test_cmd


def test_log_parser_names_exist_in_swebench_5(verified_path: Path) -> None:
    from swebench.harness.log_parsers import PARSER_REGISTRY

    assert set(REPO_LOG_PARSERS.values()) <= set(PARSER_REGISTRY)
    for repo in {row["repo"] for row in _verified_rows(verified_path)}:
        assert log_parser_name(repo) in PARSER_REGISTRY, repo
    with pytest.raises(SpecError, match="must carry `log_parser`"):
        log_parser_name("nobody/nothing")
