"""Harbor itself (0.25.0, unmodified, .venv-harbor) on swectl's tasks, both ways round:

- `swectl tasks export --harbor` output: `harbor lint` passes it (but for the shared verifier every SWE task needs),
  and `harbor run` with Harbor's own podman environment scores its oracle agent 1 and its no-op agent 0 on each
  exported task (two bundled SWE tasks, whose exported verifier is their eval script and SWE-bench's rule, and a
  bundled terminal task, its environment pinned to the image swectl built);
- swectl's sandboxes inside Harbor: `harbor run -e swectl.serve.harbor_env:SwectlEnvironment` against a `swectl serve`
  of the bundled Harbor tasks' own folders scores oracle 1 and no-op 0 on each."""

from __future__ import annotations

from pathlib import Path

import pytest

from swectl.testing.harbor import (
    BUNDLED_HARBOR,
    export_bundled,
    harbor_trials,
    removing_new_images,
    run_harbor,
    swectl_serving,
)

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("harbor-export")
    export_bundled(out)
    return out


def test_harbor_lint_passes_the_exported_tasks(exported: Path, tmp_path: Path) -> None:
    folders = sorted(str(p) for p in exported.iterdir())
    assert len(folders) == 3
    run = run_harbor("lint", "--ignore", "shared-verifier", *folders, home=tmp_path, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize(("agent", "reward"), [("oracle", 1.0), ("nop", 0.0)])
def test_harbor_runs_the_exported_tasks(exported: Path, tmp_path: Path, agent: str, reward: float) -> None:
    with removing_new_images():  # the images Harbor built (kept by --no-delete)
        trials, run = harbor_trials(exported, agent, tmp_path / "jobs", home=tmp_path)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert len(trials) == 3 and all(t.reward == reward and not t.exception for t in trials), trials


def test_harbor_runs_in_swectl_sandboxes(tmp_path: Path) -> None:
    with swectl_serving(BUNDLED_HARBOR, tmp_path / "serve") as url:
        for agent, reward in (("oracle", 1.0), ("nop", 0.0)):
            trials, run = harbor_trials(BUNDLED_HARBOR, agent, tmp_path / "jobs", home=tmp_path,
                                        environment="swectl", serve_url=url, n=3)
            assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
            assert sorted(t.task for t in trials) == ["csv-region-totals", "fix-make-build", "log-error-counts"]
            assert all(t.reward == reward and not t.exception for t in trials), (agent, trials)
