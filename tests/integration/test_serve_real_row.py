"""`swectl serve` on a real SWE-bench Verified row, as OpenClaw-RL's swe-rl rollout asks for it: pallets__flask-5014
(its instance image built offline here from a shallow git repository of flask holding the row's two
commits, ``tests/data/swebench/``), allocated under the official image name the client derives, graded through the
``<id>__eval`` lease with the row's (empty) eval script: gold +1, no change -1, a patch that only adds a file -1.

Verified is an evaluation set: it is used here to check grading, never as training data."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from swectl.tasks.sources import load_tasks
from tests.conftest import REPO_ROOT, shared_data
from tests.integration.serving import Client, Service
from tests.integration.test_serve_clients import SUBMIT, official_name
from tests.red_team import attack_patches, export_tree

pytestmark = [pytest.mark.integration]
INSTANCE = "pallets__flask-5014"
REPO_TARBALL = REPO_ROOT / "tests" / "data" / "swebench" / "pallets__flask-5014.git.tar.gz"
BUILD_TIMEOUT_S = 1200


@pytest.fixture(scope="module")
def real_row(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict, Path, Path]]:
    """The row, a task file holding it, and the image map of its instance image (built once, cached by podman)."""
    work = tmp_path_factory.mktemp("real-row")
    rows = [json.loads(line) for line in shared_data("swe_bench_verified.jsonl").read_text().splitlines()]
    row = next(r for r in rows if r["instance_id"] == INSTANCE)
    tasks = work / "rows.jsonl"
    tasks.write_text(json.dumps(row) + "\n")
    bare = work / "flask.git"
    bare.mkdir()
    with tarfile.open(REPO_TARBALL) as tar:
        tar.extractall(bare, filter="data")
    cache = work / "repos"
    subprocess.run(["git", "clone", "-q", "--no-checkout", "--no-local", str(bare), str(cache / "pallets__flask")],
                   check=True, timeout=120)
    image_map = work / "image-map.json"
    built = subprocess.run([sys.executable, "-m", "swectl.cli.main", "image", "build", "--repo-cache", str(cache),
                            "--tasks", str(tasks), "--image-map", str(image_map)], cwd=REPO_ROOT,
                           capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert built.returncode == 0, built.stderr[-3000:]
    yield row, tasks, image_map


def test_a_real_row_through_the_eval_lease_gold_resolves_and_nothing_else(
        real_row: tuple[dict, Path, Path], tmp_path: Path) -> None:
    row, tasks, image_map = real_row
    svc = Service(tmp_path, "--tasks", str(tasks), "--image-map", str(image_map))
    client = Client(svc.url)
    try:
        def episode(edit: str) -> str:
            lease = client.allocate(image=official_name(INSTANCE), instance_id=INSTANCE)
            if edit:
                assert client.exec(lease, edit)["returncode"] == 0
            out = client.exec(lease, SUBMIT)["output"]
            client.ok("/close", {"lease_id": lease})
            return out.split("\n", 1)[1] if "\n" in out else ""

        def grade(patch: str) -> dict:
            lease = client.allocate(image=official_name(INSTANCE), instance_id=f"{INSTANCE}__eval")
            verdict = client.ok("/evaluate", {"lease_id": lease, "patch": patch, "eval_script": ""})
            client.ok("/close", {"lease_id": lease})
            return verdict

        write_gold = f"cat > /tmp/gold.diff <<'SWECTL_EOF'\n{row['patch']}SWECTL_EOF\ngit apply /tmp/gold.diff"
        gold = grade(episode(write_gold))
        assert gold["resolved"] is True and gold["graded_by"] == "tests" and gold["task"] == INSTANCE, gold
        assert episode("") == ""  # no change: the client scores it -1 without grading
        wrong = grade(episode("echo 'a note' > NOTES.md"))
        assert wrong["resolved"] is False and wrong["f2p_failed"] == row["FAIL_TO_PASS"], wrong
    finally:
        assert svc.stop() == 130


def test_no_attack_resolves_on_the_real_row_through_swectl_serve(
        real_row: tuple[dict, Path, Path], tmp_path: Path) -> None:
    """The red team (tests/red_team.py) on the real row, each attack graded through `swectl serve`'s eval lease as
    OpenClaw-RL's reward asks for it: none resolves; the answer says tampered and why."""
    _, tasks, image_map = real_row
    task = load_tasks(tasks, strict=True).tasks[0]
    image = json.loads(image_map.read_text())[INSTANCE]
    patches = attack_patches(export_tree(task, tmp_path / "testbed", image), task)
    (tmp_path / "svc").mkdir()
    svc = Service(tmp_path / "svc", "--tasks", str(tasks), "--image-map", str(image_map))
    client = Client(svc.url)
    verdicts = {}
    try:
        for name, patch in patches.items():
            lease = client.allocate(image=official_name(INSTANCE), instance_id=f"{INSTANCE}__eval")
            verdicts[name] = client.ok("/evaluate", {"lease_id": lease, "patch": patch, "eval_script": ""})
            client.ok("/close", {"lease_id": lease})
    finally:
        assert svc.stop() == 130
    report = "\n".join(f"{n:<24} {v['status']:<10} {v['reason']:<14} {v['output'][:100]!r}"
                       for n, v in verdicts.items())
    print(report)  # shown with -s (and on failure)
    assert not [n for n, v in verdicts.items() if v["resolved"]], report
    assert {v["status"] for v in verdicts.values()} <= {"tampered", "unresolved"}, report
    tampered = {n for n, v in verdicts.items() if v["tampered"]}
    assert len(tampered) >= len(patches) - 4, report
    assert all(verdicts[n]["output"].startswith("swectl: graded tampered (") for n in tampered), report
    assert {"pytest_ini_plugin", "flip_at_import", "forge_and_exit_0"} <= tampered, report


def test_a_real_row_exported_to_harbor_scores_its_oracle_1_and_its_no_op_0(
        real_row: tuple[dict, Path, Path], tmp_path: Path) -> None:
    """`swectl tasks export --harbor` of the Verified row (its eval script as swectl grades it, SWE-bench's rule in the
    exported judge), run by Harbor itself (0.25.0) in its podman environment: oracle 1.0, no-op 0.0."""
    from swectl.testing.harbor import harbor_trials, removing_new_images

    _, tasks, image_map = real_row
    out = tmp_path / "harbor"
    exported = subprocess.run([sys.executable, "-m", "swectl.cli.main", "tasks", "export", "--harbor", str(out),
                               "--tasks", str(tasks), "--image-map", str(image_map)], capture_output=True, text=True,
                              timeout=300, check=False)
    assert exported.returncode == 0, exported.stdout + exported.stderr
    with removing_new_images():  # the images Harbor built (kept by --no-delete)
        for agent, reward in (("oracle", 1.0), ("nop", 0.0)):
            trials, run = harbor_trials(out, agent, tmp_path / "jobs", home=tmp_path, n=1)
            assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
            assert [(t.task, t.reward, t.exception) for t in trials] == [(INSTANCE, reward, "")], trials
