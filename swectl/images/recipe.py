"""The files an instance image is built from, besides the testbed and the wheels: Containerfile, scripts.

- pip is offline for good (``PIP_NO_INDEX=1``, ``PIP_FIND_LINKS=/opt/swectl-wheels``, build isolation off) so
  the spec's ``install`` command runs unchanged at build time and again in the eval script, in a sandbox
  without network.
- ``/opt/miniconda3/bin/activate`` is a conda shim: sourcing it defines a ``conda`` shell function whose
  ``conda activate <env>`` activates ``/opt/venv`` and whose ``conda deactivate`` does nothing, so the
  official eval scripts (``source /opt/miniconda3/bin/activate; conda activate testbed``) run unchanged.
- The spec's ``pre_install`` lines that only run apt (``apt-get update && apt-get install -y locales``) are
  the apt steps: with ``allow_network`` and a Debian mirror the node reaches, they run in an image of their own
  under the instance image (:func:`apt_containerfile`, built with the network; the instance build itself stays
  ``--network none``); otherwise they are skipped with a warning. The other lines that need the network
  (wget, curl, conda, pip) are skipped with a warning unless ``allow_network``; the rest (sed edits of
  setup.py, ...) run, a failure being a warning. A line that is not valid bash is skipped with a warning (one
  would end the whole script). The ``install`` command must succeed. A stage or requirement that does not
  install is a warning.
- The venv's python is a real binary and the base interpreter sees the venv's packages (``make_venv``), so
  tools that re-exec ``sys.executable`` or link to it (tox --current-env) keep the venv.

Two Containerfiles, the official harness's env/instance split: the environment image (:func:`env_containerfile`:
the venv and its wheels, shared by every instance of a (repo, version) with the same dependencies) and the thin
instance image on it (:func:`instance_containerfile`: the testbed and the spec's install).
"""

from __future__ import annotations

import posixpath
import re
import shlex
import subprocess

from swectl.images.project import LOGIN_PATH_STEP, VENV, make_venv
from swectl.images.wheels import StageWheels
from swectl.tasks.record import TESTBED
from swectl.tasks.specs import RepoSpec

WHEELS = "/opt/swectl-wheels"
TOOLS = "/opt/swectl"
CONDA_ACTIVATE = "/opt/miniconda3/bin/activate"
WARNING_TAG = "swectl-warning:"
ENV_WARNINGS = f"{TOOLS}/env-warnings.txt"  # the environment image's build warnings (install-deps.sh)
# A pre_install line that runs one of these needs the network.
_NETWORK_STEP = re.compile(r"(?:^|[\s;&|(`])(?:apt-get|apt|wget|curl|conda|pip3?|git\s+clone)(?=\s|$)")
_BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# One command of an apt step: apt-get / apt with optional variable assignments before it.
_APT_COMMAND = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*(?:apt-get|apt)(?:\s|$)")


def needs_network(step: str) -> bool:
    """Whether a pre_install line runs a command that needs the network (apt-get, wget, curl, conda, pip, ...)."""
    return bool(_NETWORK_STEP.search(step))


def is_apt_step(step: str) -> bool:
    """Whether a pre_install line runs apt and nothing else (commands joined by ``&&``, ``;`` or ``||``)."""
    parts = [p.strip() for p in re.split(r"&&|\|\||;", step)]
    return bool(parts) and all(_APT_COMMAND.match(p) for p in parts)


def bash_syntax_error(step: str) -> str:
    """bash's complaint about ``step`` (``bash -n``), "" when it parses."""
    proc = subprocess.run(["bash", "-n", "-c", step], capture_output=True, text=True, check=False)
    return "" if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["not valid bash"])[0]


def split_pre_install(steps: list[str]) -> tuple[list[str], list[str], list[str]]:
    """The pre_install lines as (apt steps, other steps, warnings about lines that are not valid bash)."""
    apt: list[str] = []
    other: list[str] = []
    warnings: list[str] = []
    for step in steps:
        error = bash_syntax_error(step)
        if error:
            warnings.append(f"pre_install step skipped (not valid bash: {error}): {step}")
        else:
            (apt if is_apt_step(step) else other).append(step)
    return apt, other, warnings


def apt_containerfile(base: str, steps: list[str]) -> str:
    """An image of ``base`` with the apt steps run (any failure fails its build: never half an apt layer)."""
    script = " ".join(f"{{ {step} ; }} || exit 1;" for step in steps)
    return "\n".join([
        f"FROM {base}",
        f"RUN export DEBIAN_FRONTEND=noninteractive; {script} apt-get clean && rm -rf /var/lib/apt/lists/*",
        "",
    ])


def conda_shim() -> str:
    return "\n".join([
        "# swectl: no conda in this image. `conda activate <env>` activates the venv (every env name is the",
        "# venv); `conda deactivate` does nothing; other conda commands fail.",
        "conda() {",
        '    case "${1:-}" in',
        f"        activate) . {VENV}/bin/activate ;;",
        "        deactivate) : ;;",
        '        *) echo "swectl conda shim: conda $* is not supported (no conda in this image)" >&2; return 1 ;;',
        "    esac",
        "}",
        f". {VENV}/bin/activate",
        "",
    ])


def stage_file(index: int, name: str) -> str:
    return f"swectl-stage-{index}-{name}.txt"


def install_deps_script(stages: list[StageWheels], python: str = "python3") -> str:
    """Creates the venv with ``python`` and installs the stages in order: each all at once, else one
    requirement at a time (a requirement that does not install is a warning, kept in the environment image so
    that every instance build on it reports it again)."""
    lines = [
        "#!/bin/bash",
        "set -uo pipefail",
        f"{make_venv(python)} || exit 1",
        "install_stage() {",
        f'    {VENV}/bin/pip install -r "$1" && return 0',
        '    echo "swectl: installing $1 together failed; installing its requirements one by one"',
        "    while IFS= read -r req; do",
        f'        {VENV}/bin/pip install "$req" || echo "{WARNING_TAG} could not install $req" | tee -a {ENV_WARNINGS}',
        '    done < "$1"',
        "}",
    ]
    lines += [f"install_stage {WHEELS}/{stage_file(i, s.name)}" for i, s in enumerate(stages) if s.install]
    return "\n".join([*lines, ""])


def setup_script(spec: RepoSpec, *, allow_network: bool, apt_layer: bool = False) -> tuple[str, list[str]]:
    """The script run in TESTBED at build time (pre_install, then install), and warnings about skipped steps.
    ``apt_layer``: the apt steps ran in the image under this one (they are left out here)."""
    apt, other, warnings = split_pre_install(spec.pre_install)
    lines = ["#!/bin/bash", "set -uo pipefail", f"cat {ENV_WARNINGS} 2>/dev/null", f"cd {TESTBED}"]
    for step in spec.pre_install:
        if step not in other:
            if step in apt and not apt_layer:
                warnings.append(f"pre_install step skipped (apt: needs allow_network and a reachable Debian "
                                f"mirror): {step}")
            continue
        if needs_network(step) and not allow_network:
            warnings.append(f"pre_install step skipped (needs the network; allow_network runs it): {step}")
            continue
        message = shlex.quote(f"{WARNING_TAG} pre_install step failed: {step}")
        lines.append(f"{{ {step}\n}} || echo {message}")
    if spec.install:
        failed = shlex.quote(f"swectl: the install command failed: {spec.install}")
        lines.append(f"{{ {spec.install}\n}} || {{ echo {failed}; exit 1; }}")
    lines += [f"git -C {TESTBED} status --short | head -20", ""]
    return "\n".join(lines), warnings


def env_containerfile(base: str) -> str:
    """The environment image of a (repo, version), everything but the label: the venv with the stages' wheels
    installed, offline pip and the conda shim. Instances whose dependencies are the same share it."""
    env = {
        "PATH": f"{VENV}/bin:{_BASE_PATH}",
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": WHEELS,
        # pip reads PIP_NO_* booleans as the value of the option's *destination*: for --no-build-isolation
        # that is build_isolation, so "0" turns isolation OFF (checked with pip 23.0.1 in the base image).
        "PIP_NO_BUILD_ISOLATION": "0",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_PROGRESS_BAR": "off",
    }
    return "\n".join([
        f"FROM {base}",
        "ENV " + " ".join(f"{k}={v}" for k, v in env.items()),
        f"COPY wheels {WHEELS}",
        f"COPY tools/install-deps.sh tools/conda-activate {TOOLS}/",
        f"RUN bash {TOOLS}/install-deps.sh && mkdir -p {posixpath.dirname(CONDA_ACTIVATE)} "
        f"&& cp {TOOLS}/conda-activate {CONDA_ACTIVATE} && git config --system --add safe.directory '*'",
        LOGIN_PATH_STEP,
        "",
    ])


def instance_containerfile(env_image: str) -> str:
    """The thin per-instance image on its environment image, everything but the label: the testbed at the base
    commit and the spec's pre_install / install run in it (the ENV of the environment image carries over)."""
    return "\n".join([
        f"FROM {env_image}",
        f"COPY testbed {TESTBED}",
        f"COPY tools/setup.sh {TOOLS}/",
        f"WORKDIR {TESTBED}",
        f"RUN bash {TOOLS}/setup.sh",
        "",
    ])
