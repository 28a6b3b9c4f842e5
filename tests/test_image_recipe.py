"""Instance-image recipe decisions without podman: the date unpinned requirements resolve at, the pip
environment of the downloads, the spec's apt steps, Python version warnings and label quoting."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from swectl.images.instance import _label_value, env_image_name, python_warning
from swectl.images.project import ImageBuildError
from swectl.images.pythons import find_interpreter, nearest_newer_interpreter
from swectl.images.recipe import (
    ENV_WARNINGS,
    WARNING_TAG,
    apt_containerfile,
    bash_syntax_error,
    env_containerfile,
    install_deps_script,
    instance_containerfile,
    is_apt_step,
    setup_script,
    split_pre_install,
)
from swectl.images.requirements import (
    _build_requires,
    conda_era_caps,
    setup_py_install_requires,
    spec_requirements,
)
from swectl.images.wheels import OFFICIAL_CUTOFF, StageWheels, _attempt, check_date_policy, pip_env, prior_to
from swectl.tasks.record import Task
from swectl.tasks.specs import RepoSpec, SpecTable


def _task(**fields: object) -> Task:
    return Task(instance_id="x__y-1", repo="x/y", problem_statement="", FAIL_TO_PASS=["t"],
                **fields)  # type: ignore[arg-type]


def _git(cwd: Path, *args: str, date: str = "2019-05-06T07:08:09+02:00") -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@l", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@l", "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout.strip()


def _committed(repo: Path, files: dict[str, str]) -> str:
    """A new git repository at ``repo`` with ``files`` in one commit; its hash."""
    repo.mkdir(parents=True)
    for name, text in files.items():
        (repo / name).write_text(text)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "r")
    return _git(repo, "rev-parse", "HEAD")


# ------------------------------------------------------------------------------------------------ dates


def test_official_cutoff_unless_the_row_is_later(tmp_path: Path) -> None:
    notes: list[str] = []
    assert prior_to("official", _task(created_at="2015-02-03T04:05:06Z"), tmp_path, notes) == OFFICIAL_CUTOFF
    assert prior_to("official", _task(), tmp_path, notes) == OFFICIAL_CUTOFF
    later = _task(created_at="2025-03-01T10:00:00Z")
    assert prior_to("official", later, tmp_path, notes) == "2025-03-01T10:00:00Z"
    assert notes == []


def test_row_dates_iso_dates_and_none(tmp_path: Path) -> None:
    repo = tmp_path / "r"
    repo.mkdir()
    _git(repo, "init", "-q")
    _git(repo, "commit", "-q", "--allow-empty", "-m", "env")
    env_commit = _git(repo, "rev-parse", "HEAD")
    task = _task(created_at="2015-02-03T04:05:06Z", environment_setup_commit=env_commit)
    notes: list[str] = []
    assert prior_to("created_at", task, repo, notes) == "2015-02-03T04:05:06Z"
    assert prior_to("env-commit", task, repo, notes) == "2019-05-06T05:08:09Z"  # committer date, in UTC
    assert prior_to("2023-01-02", task, repo, notes) == "2023-01-02T00:00:00Z"
    assert prior_to("2023-01-02T03:04:05+01:00", task, repo, notes) == "2023-01-02T02:04:05Z"
    assert prior_to("none", task, repo, notes) == ""
    assert notes == []
    assert prior_to("env-commit", _task(environment_setup_commit="f" * 40), repo, notes) == OFFICIAL_CUTOFF
    assert prior_to("created_at", _task(), repo, notes) == OFFICIAL_CUTOFF
    assert len(notes) == 2 and all("using the official cut-off" in n for n in notes)


def test_bad_date_policy_names_the_choices() -> None:
    with pytest.raises(ImageBuildError, match="official, created_at, env-commit, none"):
        check_date_policy("yesterday")


def test_downloads_ignore_pip_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    """find-links folders and local indexes have no upload dates: pip would take today's releases from them."""
    monkeypatch.setenv("PIP_FIND_LINKS", "/opt/wheels")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "file:///opt/pypi/simple")
    monkeypatch.setenv("PIP_CERT", "/etc/ssl/certs/ca-certificates.crt")
    monkeypatch.delenv("PIP_DEFAULT_TIMEOUT", raising=False)
    env = pip_env()
    assert "PIP_FIND_LINKS" not in env and "PIP_EXTRA_INDEX_URL" not in env
    assert env["PIP_CERT"] == "/etc/ssl/certs/ca-certificates.crt"
    assert env["PIP_CONFIG_FILE"] == os.devnull
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"], env=env, capture_output=True, text=True,
                          check=True)
    assert [line.split("=")[0] for line in proc.stdout.split()] == [":env:.cert", ":env:.config-file"]


def test_pip_supports_uploaded_prior_to() -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--help"], capture_output=True, text=True,
                          check=True)
    assert "--uploaded-prior-to" in proc.stdout


# ------------------------------------------------------------------------------------------------ apt steps


def test_apt_steps_of_the_real_specs(specs: SpecTable) -> None:
    django = specs.get("django/django", "2.2").pre_install
    apt, other, warnings = split_pre_install(django)
    assert apt == ["apt-get update && apt-get install -y locales"]
    assert other == ["echo 'en_US UTF-8' > /etc/locale.gen", "locale-gen en_US.UTF-8"]
    assert warnings == []
    mpl = specs.get("matplotlib/matplotlib", "3.5").pre_install
    apt, other, _ = split_pre_install(mpl)
    assert len(apt) == 1 and "DEBIAN_FRONTEND=noninteractive apt-get install -y imagemagick" in apt[0]
    assert any(step.startswith("wget ") for step in other)
    # matplotlib 1.0's `... && && apt-get install` is not valid bash: skipped, named, never run
    apt, other, warnings = split_pre_install(specs.get("matplotlib/matplotlib", "1.0").pre_install)
    assert apt == [] and len(warnings) == 1 and "syntax error" in warnings[0]


def test_apt_step_shapes() -> None:
    assert is_apt_step("apt-get update && apt-get install -y graphviz")
    assert is_apt_step("DEBIAN_FRONTEND=noninteractive apt-get install -y x; apt clean")
    assert not is_apt_step("apt-get update && locale-gen")
    assert not is_apt_step("pip install apt-get")
    assert bash_syntax_error("echo ok && false") == ""


def test_setup_script_leaves_apt_steps_to_the_apt_image(specs: SpecTable) -> None:
    spec = specs.get("django/django", "2.2")
    script, warnings = setup_script(spec, allow_network=True, apt_layer=True)
    assert "apt-get" not in script and "locale-gen en_US.UTF-8" in script
    assert warnings == []
    script, warnings = setup_script(spec, allow_network=False)
    assert "apt-get" not in script
    assert [w.split(":", 1)[0] for w in warnings] == ["pre_install step skipped (apt"]
    file = apt_containerfile("localhost/b", ["apt-get update && apt-get install -y locales", "apt-get clean"])
    run = file.splitlines()[1]
    assert run.count("|| exit 1;") == 2 and "DEBIAN_FRONTEND=noninteractive" in run


def test_a_failing_apt_step_fails_the_apt_layer() -> None:
    run = apt_containerfile("b", ["false && true", "echo second"]).splitlines()[1].removeprefix("RUN ")
    proc = subprocess.run(["bash", "-c", run.replace("apt-get clean", "true").replace("rm -rf", "echo")],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 1 and "second" not in proc.stdout


# ------------------------------------------------------------------------------------------------ python, labels


def test_python_warning_says_where_it_looked(specs: SpecTable, monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    monkeypatch.setenv("SWECTL_PYTHONS", str(tmp_path / "pythons"))
    warning = python_warning(specs.get("psf/requests", "2.0"))
    assert warning.startswith("spec python 3.9 is not available offline on this node")
    assert str(tmp_path / "pythons") in warning and warning.endswith("the venv runs python 3.11")


def test_interpreters_are_found_by_version(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for version in ("3.9.1", "3.9.18", "3.10.2", "3.9.7-broken"):
        (tmp_path / version / "bin").mkdir(parents=True)
        short = ".".join(version.split("-")[0].split(".")[:2])
        (tmp_path / version / "bin" / f"python{short}").write_text("")
        (tmp_path / version / "lib" / f"python{short}").mkdir(parents=True)
        (tmp_path / version / "lib" / f"python{short}" / "os.py").write_text("")
    (tmp_path / "3.8.0" / "bin").mkdir(parents=True)  # no lib/python3.8/os.py: not an installation
    (tmp_path / "3.8.0" / "bin" / "python3.8").write_text("")
    monkeypatch.setenv("SWECTL_PYTHONS", str(tmp_path))
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path / "no-pyenv"))
    found = find_interpreter("3.9")
    assert found is not None and found.full_version == "3.9.18" and found.prefix == str(tmp_path / "3.9.18")
    assert found.executable == f"{tmp_path}/3.9.18/bin/python3.9"
    assert find_interpreter("3.8") is None
    monkeypatch.setenv("SWECTL_PYTHONS", str(tmp_path / "3.10.2"))  # a prefix itself
    assert find_interpreter("3.10") is not None and find_interpreter("3.9") is None


def test_a_missing_python_gets_the_nearest_newer_one_of_its_major_version(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    """Django 1.11's spec says 3.5, which nothing here has offline: 3.6 (the lowest newer minor, its newest patch)
    runs it, not the base image's 3.11; another major version never stands in."""
    for version in ("3.6.1", "3.6.15", "3.8.18", "2.7.18"):
        short = ".".join(version.split(".")[:2])
        (tmp_path / version / "bin").mkdir(parents=True)
        (tmp_path / version / "bin" / f"python{short}").write_text("")
        (tmp_path / version / "lib" / f"python{short}").mkdir(parents=True)
        (tmp_path / version / "lib" / f"python{short}" / "os.py").write_text("")
    monkeypatch.setenv("SWECTL_PYTHONS", str(tmp_path))
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path / "no-pyenv"))
    found = nearest_newer_interpreter("3.5")
    assert found is not None and found.full_version == "3.6.15"
    assert nearest_newer_interpreter("3.7").full_version == "3.8.18"  # type: ignore[union-attr]
    assert nearest_newer_interpreter("3.9") is None and nearest_newer_interpreter("2.6").full_version == "2.7.18"


def test_label_values_survive_containerfile_quoting(tmp_path: Path) -> None:
    """LABEL expands $VAR: a warning quoting a pre_install line must come back as written."""
    text = 'step skipped: wget -O "$QHULL_TAR" "$QHULL_URL" \\ done'
    assert _label_value(text) == '"step skipped: wget -O \\"\\$QHULL_TAR\\" \\"\\$QHULL_URL\\" \\\\ done"'


def test_setup_cfg_setup_requires_join_the_build_stage(tmp_path: Path) -> None:
    """setuptools fetches setup_requires itself (offline it cannot): they are downloaded with the build stage."""
    repo = tmp_path / "r"
    commit = _committed(repo, {
        "pyproject.toml": '[build-system]\nrequires = ["setuptools>=42", "wheel"]\n',
        "setup.cfg": "[options]\nsetup_requires =\n    setuptools >= 40.4\n    setuptools_scm\n"
                     "    wheel\n    foo; python_version < '3.8'\n"})
    notes: list[str] = []
    reqs = _build_requires(repo, commit, notes)
    assert reqs == ["setuptools>=42", "wheel", "setuptools >= 40.4", "setuptools_scm", "foo; python_version < '3.8'"]
    assert notes == []


def test_setup_py_literal_setup_requires_join_the_build_stage(tmp_path: Path) -> None:
    """astropy 3.x's setup.py adds cython and jinja2 to setup_requires when built from a checkout: read from its
    syntax tree (never run), with setup.cfg's."""
    repo = tmp_path / "r"
    commit = _committed(repo, {
        "setup.cfg": "[options]\nsetup_requires = numpy>=1.13\n",
        "setup.py": "import os\nsetup_requires = []\nif not os.path.exists('PKG-INFO'):\n"
                    "    setup_requires.extend(['cython>=0.21', 'jinja2>=2.7'])\n"
                    "setup_requires.append('extension-helpers')\nsetup_requires += ('wheel',)\n"
                    "setup(name='x', setup_requires=setup_requires + ['six'])\nsetup(setup_requires=['pbr'])\n"})
    notes: list[str] = []
    reqs = _build_requires(repo, commit, notes)
    assert reqs[0] == "numpy>=1.13"  # setup.cfg's first, then setup.py's (in syntax-tree order)
    assert sorted(reqs[1:]) == ["cython>=0.21", "extension-helpers", "jinja2>=2.7", "pbr", "wheel"]
    assert notes == []
    pinned = _build_requires(repo, commit, notes, pinned=frozenset({"cython", "jinja2"}))
    assert "cython>=0.21" not in pinned and "jinja2>=2.7" not in pinned and "pbr" in pinned  # the spec's pins win
    (repo / "setup.py").write_text("setup_requires = [\n")
    _git(repo, "commit", "-qam", "broken")
    assert _build_requires(repo, _git(repo, "rev-parse", "HEAD"), notes) == ["numpy>=1.13"]
    assert len(notes) == 1 and "setup.py: not parsable" in notes[0]


def test_setup_py_install_requires_names_what_it_builds_from_strings(tmp_path: Path) -> None:
    """scikit-learn 0.22's setup.py cannot say what it requires on the host (it needs numpy and an old
    setuptools to run): the names its install_requires list spells are read from the syntax tree instead."""
    repo = tmp_path / "r"
    commit = _committed(repo, {"setup.py": (
        "NUMPY_MIN_VERSION = '1.11.0'\nV = '0.11'\n"
        "setup(name='x', install_requires=['numpy>={}'.format(NUMPY_MIN_VERSION), 'scipy>=' + V, "
        "f'joblib>={V}', 'six>=1.1', some_name, 'not a requirement!'])\n")})
    assert setup_py_install_requires(repo, commit) == ["numpy", "scipy", "joblib", "six>=1.1"]
    (repo / "setup.py").write_text("setup(install_requires=deps)\n")
    _git(repo, "commit", "-qam", "computed")
    assert setup_py_install_requires(repo, _git(repo, "rev-parse", "HEAD")) == []


def test_requirements_files_are_read_at_the_environment_setup_commit(tmp_path: Path) -> None:
    """As the official harness: every row of a (repo, version) reads the requirements at the one environment setup
    commit, so rows whose base commits changed the file still share an environment; a clone without that commit
    falls back to the base commit."""
    repo = tmp_path / "r"
    env_commit = _committed(repo, {"requirements.txt": "asgiref>=3.2\n"})
    (repo / "requirements.txt").write_text("asgiref>=3.2.10\nsqlparse\n")
    _git(repo, "commit", "-q", "-am", "later")
    base = _git(repo, "rev-parse", "HEAD")
    spec = RepoSpec(repo="x/y", version="1.0", python="3.9", packages="requirements.txt")
    at_setup = spec_requirements(_task(environment_setup_commit=env_commit), spec, repo, base)
    assert {s.name: s.requirements for s in at_setup.stages}["packages"] == ["asgiref>=3.2"]
    assert not any("environment setup commit" in n for n in at_setup.notes)
    missing = _task(environment_setup_commit="e" * 40)
    reqs = spec_requirements(missing, spec, repo, base)
    assert {s.name: s.requirements for s in reqs.stages}["packages"] == ["asgiref>=3.2.10", "sqlparse"]
    lacks = "the clone lacks the environment setup commit eeeeeeeeeeee"
    assert any(n.startswith(lacks) for n in reqs.notes), reqs.notes


def test_conda_era_caps_hold_back_what_conda_never_built_for_an_old_python() -> None:
    notes: list[str] = []
    assert conda_era_caps(["numpy", "cython", "Cython>=0.28"], "3.6", notes) == ["numpy", "cython<3", "Cython>=0.28"]
    assert len(notes) == 1 and "cython capped <3 for python 3.6" in notes[0]
    assert conda_era_caps(["cython"], "3.9", notes) == ["cython"]


def test_missing_files_names_what_a_partial_mirror_left_out(tmp_path: Path) -> None:
    from swectl.images.clones import missing_files

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True,
                              text=True).stdout.strip()

    git("init", "-q", "-b", "main")
    (tmp_path / "small.txt").write_text("small\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "big.bin").write_text("big " * 1000)
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    assert missing_files(tmp_path, "HEAD") == []
    sha = git("rev-parse", "HEAD:data/big.bin")
    (tmp_path / ".git" / "objects" / sha[:2] / sha[2:]).unlink()
    assert missing_files(tmp_path, "HEAD") == ["data/big.bin"]


def test_submodules_come_from_their_own_clone_in_the_repo_cache(tmp_path: Path) -> None:
    """astropy <= 3.x keeps astropy_helpers as a submodule its setup.py needs: the testbed gets it at the pinned
    commit from the repo cache, with no remote pointing at the host; without its clone, a warning and an empty
    folder (what a plain git clone leaves)."""
    from swectl.images.clones import Testbed, missing_files, submodule_sources

    cache = tmp_path / "cache"
    helpers, proj = cache / "acme__helpers", cache / "acme__proj"
    for repo in (helpers, proj):
        repo.mkdir(parents=True)
        _git(repo, "init", "-q", "-b", "main")
    (helpers / "helpers.py").write_text("PINNED = True\n")
    _git(helpers, "add", "-A")
    _git(helpers, "commit", "-q", "-m", "pinned")
    pinned = _git(helpers, "rev-parse", "HEAD")
    (helpers / "helpers.py").write_text("PINNED = False\n")
    _git(helpers, "commit", "-qam", "later")
    (proj / "setup.py").write_text("import helpers\n")
    (proj / ".gitmodules").write_text('[submodule "helpers"]\n\tpath = ext/helpers\n'
                                      "\turl = https://github.com/acme/helpers.git\n")
    _git(proj, "add", "-A")
    _git(proj, "update-index", "--add", "--cacheinfo", f"160000,{pinned},ext/helpers")
    _git(proj, "commit", "-q", "-m", "with a submodule")
    commit = _git(proj, "rev-parse", "HEAD")

    (sub, source), = submodule_sources(proj, commit, cache)
    assert (sub.path, sub.commit, sub.repo, source) == ("ext/helpers", pinned, "acme/helpers", helpers)
    said: list[str] = []
    testbed = Testbed(proj, commit, [], tmp_path / "testbed", said.append, repo_cache=cache)
    # one listing of the tree serves every check: the gitlink is a "commit" entry, the files "blob" ones
    assert sorted((e.kind, e.path) for e in testbed.tree) == [
        ("blob", ".gitmodules"), ("blob", "setup.py"), ("commit", "ext/helpers")]
    assert testbed.submodule_sources == [(sub, source)] and missing_files(proj, commit, testbed.tree) == []
    bed = testbed.get()
    assert (bed / "ext" / "helpers" / "helpers.py").read_text() == "PINNED = True\n"
    assert testbed.warnings == [] and any("submodule ext/helpers" in line for line in said)
    assert _git(bed, "status", "--porcelain") == ""
    configs = [bed / ".git" / "config", *(bed / ".git" / "modules").rglob("config")]
    assert all(str(cache) not in p.read_text() for p in configs)
    assert _git(bed / "ext" / "helpers", "remote", "get-url", "origin") == "https://github.com/acme/helpers.git"
    (bed / "ext" / "helpers" / "build.egg-info").mkdir()
    (bed / "ext" / "helpers" / "helpers.py").write_text("edited\n")
    testbed.clean()
    assert _git(bed, "status", "--porcelain") == "" and not (bed / "ext" / "helpers" / "build.egg-info").exists()

    shutil.rmtree(helpers)
    bare = Testbed(proj, commit, [], tmp_path / "bare", said.append, repo_cache=cache).get()
    assert list((bare / "ext" / "helpers").iterdir()) == []
    warned = Testbed(proj, commit, [], tmp_path / "bare2", said.append, repo_cache=cache)
    warned.get()
    assert len(warned.warnings) == 1 and "git clone https://github.com/acme/helpers.git" in warned.warnings[0]


def test_conda_names_that_pypi_spells_otherwise() -> None:
    from swectl.images.requirements import conda_to_pip

    notes: list[str] = []
    assert conda_to_pip("iris", "env", notes) == "scitools-iris"  # PyPI's iris raises on import
    assert conda_to_pip("iris=3.0=py_0", "env", notes) == "scitools-iris==3.0"
    assert conda_to_pip("conda-forge::pytables>=3.6", "env", notes) == "tables>=3.6"
    assert conda_to_pip("numpy=1.2", "env", notes) == "numpy==1.2"
    assert conda_to_pip("Python=3.9", "env", notes) is None
    assert notes == []


def test_conda_c_libraries_come_from_apt_not_pip() -> None:
    from swectl.images.requirements import conda_c_libraries, environment_yml

    text = "name: t\ndependencies:\n  - python=3.8\n  - eccodes\n  - cfgrib\n  - conda-forge::hdf5=1.12\n  - iris\n"
    assert conda_c_libraries("dependencies:\n  - cfgrib\n") == ["libeccodes-dev"]  # conda's cfgrib brings eccodes
    notes: list[str] = []
    assert environment_yml(text, "ci/requirements/environment.yml", notes) == ["cfgrib", "scitools-iris"]
    assert conda_c_libraries(text) == ["libeccodes-dev", "libhdf5-dev"]
    assert conda_c_libraries("dependencies: [") == []


def test_c_sources_outside_tests_and_docs_need_a_compiler(tmp_path: Path) -> None:
    from swectl.images.clones import has_c_sources

    def commit(path: str) -> None:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("x\n")
        subprocess.run(["git", "-C", str(tmp_path), "add", "-A"], check=True)
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm",
                        path], check=True)

    subprocess.run(["git", "init", "-q", "-b", "main", str(tmp_path)], check=True)
    commit("pkg/__init__.py")
    commit("tests/roots/fixture.pyx")  # a test fixture (sphinx has these), not built
    commit("docs/example.c")
    assert has_c_sources(tmp_path, "HEAD") is False
    commit("pkg/_speedups.c")
    assert has_c_sources(tmp_path, "HEAD") is True


def test_environment_and_instance_containerfiles_split_as_the_official_harness(specs: SpecTable) -> None:
    """The environment image holds the venv and its wheels, nothing of the testbed; the instance image is the
    testbed and the spec's install on it. Install warnings of the environment are kept in it and printed again
    by every instance build on it, so each instance's report has them."""
    env = env_containerfile("localhost/base:1")
    assert env.startswith("FROM localhost/base:1\n")
    assert "install-deps.sh" in env and "testbed" not in env and "setup.sh" not in env
    inst = instance_containerfile("localhost/swectl-env.x_1776_y-1.0:abc")
    assert inst.startswith("FROM localhost/swectl-env.x_1776_y-1.0:abc\n")
    assert "COPY testbed /testbed" in inst and "setup.sh" in inst and "install-deps" not in inst
    deps = install_deps_script([StageWheels(name="pins", install=["six==1.16.0"], files=[])])
    assert f'echo "{WARNING_TAG} could not install $req" | tee -a {ENV_WARNINGS}' in deps
    script, _ = setup_script(specs.get("psf/requests", "2.0"), allow_network=False)
    assert script.splitlines()[2] == f"cat {ENV_WARNINGS} 2>/dev/null"


def test_environment_image_names_are_valid_and_per_repo_version() -> None:
    name = env_image_name(_task(version="0.22"), "0123456789abcdef0123")
    assert name == "localhost/swectl-env.x_1776_y-0.22:0123456789abcdef"
    assert name.islower()


def test_a_killed_download_raises_rather_than_caching_a_failure(tmp_path: Path) -> None:
    """A pip run killed midway (a signal or the timeout) says nothing about what resolves: it must not be recorded
    as "could not resolve" for good (the stage manifest is written only when the download returns)."""
    log = tmp_path / "pip.log"
    assert _attempt([sys.executable, "-c", "pass"], log) is True
    assert _attempt([sys.executable, "-c", "raise SystemExit(1)"], log) is False  # a plain failure is an answer
    with pytest.raises(ImageBuildError, match="killed by signal 9; nothing was cached"):
        _attempt([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], log)
    with pytest.raises(ImageBuildError, match=r"timed out after 0\.5 s"):
        _attempt([sys.executable, "-c", "import time; time.sleep(30)"], log, timeout=0.5)
