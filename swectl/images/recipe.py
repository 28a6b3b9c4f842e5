"""The files an instance image is built from, besides the testbed and the wheels: Containerfile, scripts.

- pip is offline for good (``PIP_NO_INDEX=1``, ``PIP_FIND_LINKS=/opt/swectl-wheels``, build isolation off) so
  the spec's ``install`` command runs unchanged at build time and again in the eval script, in a sandbox
  without network.
- ``/opt/miniconda3/bin/activate`` is a conda shim: sourcing it defines a ``conda`` shell function whose
  ``conda activate <env>`` activates ``/opt/venv`` and whose ``conda deactivate`` does nothing, so the
  official eval scripts (``source /opt/miniconda3/bin/activate; conda activate testbed``) run unchanged.
- The spec's ``pre_install`` lines that need the network (apt-get, wget, curl, conda, pip) are skipped with a
  warning unless ``allow_network``; the others (sed edits of setup.py, ...) run, a failure being a warning.
  The ``install`` command must succeed. A stage or requirement that does not install is a warning.

Dependency layers come first in the Containerfile: tasks of one spec with the same wheels share them through
podman's layer cache.
"""

from __future__ import annotations

import posixpath
import re
import shlex

from swectl.images.project import VENV
from swectl.images.wheels import StageWheels
from swectl.tasks.record import TESTBED
from swectl.tasks.specs import RepoSpec

WHEELS = "/opt/swectl-wheels"
TOOLS = "/opt/swectl"
CONDA_ACTIVATE = "/opt/miniconda3/bin/activate"
WARNING_TAG = "swectl-warning:"
# A pre_install line that runs one of these needs the network.
_NETWORK_STEP = re.compile(r"(?:^|[\s;&|(`])(?:apt-get|apt|wget|curl|conda|pip3?|git\s+clone)(?=\s|$)")
_BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def needs_network(step: str) -> bool:
    """Whether a pre_install line runs a command that needs the network (apt-get, wget, curl, conda, pip, ...)."""
    return bool(_NETWORK_STEP.search(step))


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


def install_deps_script(stages: list[StageWheels]) -> str:
    """Creates the venv and installs the stages in order: each all at once, else one requirement at a time
    (a requirement that does not install is a warning)."""
    lines = [
        "#!/bin/bash",
        "set -uo pipefail",
        f"python3 -m venv {VENV} || exit 1",
        "install_stage() {",
        f'    {VENV}/bin/pip install -r "$1" && return 0',
        '    echo "swectl: installing $1 together failed; installing its requirements one by one"',
        "    while IFS= read -r req; do",
        f'        {VENV}/bin/pip install "$req" || echo "{WARNING_TAG} could not install $req"',
        '    done < "$1"',
        "}",
    ]
    lines += [f"install_stage {WHEELS}/{stage_file(i, s.name)}" for i, s in enumerate(stages) if s.install]
    return "\n".join([*lines, ""])


def setup_script(spec: RepoSpec, *, allow_network: bool) -> tuple[str, list[str]]:
    """The script run in TESTBED at build time (pre_install, then install), and warnings about skipped steps."""
    warnings: list[str] = []
    lines = ["#!/bin/bash", "set -uo pipefail", f"cd {TESTBED}"]
    for step in spec.pre_install:
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


def containerfile_body(base: str) -> str:
    """Everything but the label. The dependency layers come first so that tasks of one spec share them."""
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
        f"COPY testbed {TESTBED}",
        f"COPY tools/setup.sh {TOOLS}/",
        f"WORKDIR {TESTBED}",
        f"RUN bash {TOOLS}/setup.sh",
        "",
    ])
