"""`swectl serve` under the way OpenClaw-RL's swe-rl rollout code (run unmodified against it in a session: see
the README, "Serving rollouts") really calls it. The client here is our own, written from what that code was
seen to do:

- the agent's patch is the output of its submit command (``echo <sentinel> && git add -A && git diff --cached``),
  read after the sentinel line;
- grading allocates a fresh lease with ``instance_id = "<id>__eval"`` and the row's ``eval_script`` (often empty),
  and scores ``resolved``;
- slime's HTTP helper retries every non-2xx answer (10 attempts, 1 s apart) and never reads an error body, while a
  2xx with ``ok: false`` raises at once;
- no ``Authorization`` header is sent.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from swectl.config import DEFAULT_IMAGE
from swectl.serve.wire import CUT_MARK
from tests.integration.serving import Client, Service, bundled_tasks

pytestmark = [pytest.mark.integration]
SENTINEL = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
SUBMIT = f"echo {SENTINEL} && git add -A && git diff --cached"


class RetryingClient:
    """slime's way: every non-2xx answer (or transport error) is retried, ``attempts`` in all, ``pause`` apart, and
    then raises; the body of a failure is never read. A 2xx without ``ok: true`` raises at once."""

    def __init__(self, url: str, *, attempts: int = 10, pause: float = 1.0, local_address: str | None = None) -> None:
        transport = httpx.HTTPTransport(local_address=local_address) if local_address else None
        self.http = httpx.Client(base_url=url, timeout=120, transport=transport)
        self.attempts, self.pause = attempts, pause
        self.sent = 0

    def post(self, path: str, body: dict) -> dict:
        for attempt in range(self.attempts):
            self.sent += 1
            try:
                r = self.http.post(path, json=body)
                r.raise_for_status()
                break
            except httpx.HTTPError:
                if attempt == self.attempts - 1:
                    raise
                time.sleep(self.pause)
        answer = r.json()
        if not answer.get("ok"):
            raise RuntimeError(f"{path} failed: {answer}")
        return answer


class Rollout:
    """One swe-rl episode's calls: allocate, commands, submit, close; then the grading lease and /evaluate."""

    def __init__(self, client: RetryingClient) -> None:
        self.client = client

    def run(self, lease: str, command: str) -> dict:
        return self.client.post("/exec", {"lease_id": lease, "command": command, "cwd": "/testbed", "timeout": 180,
                                          "env": {}})

    def submitted_patch(self, lease: str) -> str:
        output = self.run(lease, SUBMIT)["output"].lstrip("\n")
        assert output.startswith(SENTINEL), output[:200]
        return output[len(SENTINEL):].lstrip("\n")

    def episode(self, task: dict, edit: str) -> str:
        """The agent's patch after ``edit`` (shell) in a lease of the task, the lease closed."""
        lease = self.client.post("/allocate", {"image": official_name(task["instance_id"]),
                                               "instance_id": task["instance_id"]})["lease_id"]
        try:
            self.client.post("/heartbeat", {"lease_id": lease})
            if edit:
                assert self.run(lease, edit)["returncode"] == 0
            return self.submitted_patch(lease)
        finally:
            self.client.post("/close", {"lease_id": lease})

    def grade(self, task: dict, patch: str, eval_script: str = "") -> dict:
        lease = self.client.post("/allocate", {"image": official_name(task["instance_id"]),
                                               "instance_id": f"{task['instance_id']}__eval"})["lease_id"]
        try:
            return self.client.post("/evaluate", {"lease_id": lease, "patch": patch, "eval_script": eval_script,
                                                  "cwd": "/testbed", "timeout": 3600})
        finally:
            self.client.post("/close", {"lease_id": lease})


def official_name(instance_id: str) -> str:
    """The image name the swe-rl client derives for a SWE-bench row (it is not on this machine)."""
    return f"docker.io/swebench/sweb.eval.x86_64.{instance_id.replace('__', '_1776_')}:latest".lower()


def apply_command(patch: str) -> str:
    encoded = base64.b64encode(patch.encode()).decode()
    return f"echo {encoded} | base64 -d > /tmp/fix.diff && git apply /tmp/fix.diff && rm /tmp/fix.diff"


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = Service(tmp_path_factory.mktemp("serve-clients"))
    try:
        yield svc
    finally:
        svc.stop()


@pytest.fixture
def rollout(service: Service) -> Iterator[Rollout]:
    client = RetryingClient(service.url, attempts=3, pause=0.2)
    yield Rollout(client)
    client.http.close()


def test_gold_resolves_and_no_change_or_a_wrong_patch_never_does(rollout: Rollout, service: Service) -> None:
    for task in bundled_tasks(36)[::12]:  # three of the four projects
        gold = rollout.episode(task, apply_command(task["patch"]))
        assert gold.startswith("diff --git") and "+++ b/" in gold
        verdict = rollout.grade(task, gold)  # eval_script "" as the rows carry: the task's tests grade it
        assert verdict["resolved"] is True and verdict["graded_by"] == "tests", verdict
        assert (verdict["task"], verdict["suffix"]) == (task["instance_id"], "eval")
        # the swe-rl client scores no change without grading; an empty patch sent anyway is a clear failure
        assert rollout.episode(task, "") == ""
        empty = rollout.grade(task, "")
        assert (empty["resolved"], empty["reason"]) == (False, "patch_apply_failed"), empty
        # a valid-looking patch that only adds a notes file, whatever the eval script would exit with
        wrong = rollout.episode(task, "echo 'looked at it' > NOTES.md")
        assert "+++ b/NOTES.md" in wrong
        for script in ("", "exit 0"):
            verdict = rollout.grade(task, wrong, script)
            assert verdict["resolved"] is False and verdict["status"] == "unresolved" and verdict["f2p_failed"]
    garbage = rollout.grade(task, "this is not a diff\n")
    assert (garbage["resolved"], garbage["reason"]) == (False, "patch_apply_failed") and "infra" not in garbage


def test_the_grading_lease_starts_from_the_task_and_its_own_image(rollout: Rollout) -> None:
    task = bundled_tasks(1)[0]
    answer = rollout.client.post("/allocate", {"image": "docker.io/someone/else:latest",
                                               "instance_id": f"{task['instance_id']}__eval"})
    try:
        assert answer["image"] == task["image"] and answer["task_known"] is True and answer["suffix"] == "eval"
        log = rollout.run(answer["lease_id"], "git log -1 --format=%s")
        assert log["output"].strip() == "swectl: task setup"  # the task's bug is applied and committed
    finally:
        rollout.client.post("/close", {"lease_id": answer["lease_id"]})


def test_a_suffix_on_an_unknown_id_is_an_unknown_instance(rollout: Rollout, service: Service) -> None:
    with pytest.raises(httpx.HTTPStatusError):  # 400 (retried, as slime does, then raised)
        rollout.client.post("/allocate", {"instance_id": "nosuch__thing-1__eval"})
    answer = rollout.client.post("/allocate", {"image": DEFAULT_IMAGE, "instance_id": "nosuch__thing-1__eval"})
    rollout.client.post("/close", {"lease_id": answer["lease_id"]})
    assert answer["task_known"] is False and answer["task"] == ""
    assert "'nosuch__thing-1__eval' is not a task of the served set" in (service.out / "swectl.log").read_text()


def test_a_one_mib_diff_from_the_submit_command_comes_back_whole(rollout: Rollout) -> None:
    task = bundled_tasks(1)[0]
    lease = rollout.client.post("/allocate", {"instance_id": task["instance_id"]})["lease_id"]
    try:
        make = "head -c 786432 /dev/urandom | base64 > BIG.txt && wc -c < BIG.txt"
        assert int(rollout.run(lease, make)["output"]) > 1_000_000
        answer = rollout.run(lease, SUBMIT)
        assert answer["truncated"] is False and len(answer["output"]) > 1_048_576
        patch = rollout.submitted_patch(lease)
        same = rollout.client.post("/diff", {"lease_id": lease, "cwd": "/testbed"})["patch"]
        assert patch == same  # the whole diff, byte for byte what git made
    finally:
        rollout.client.post("/close", {"lease_id": lease})
    verdict = rollout.grade(task, patch)
    assert verdict["resolved"] is False and verdict["status"] == "unresolved"  # graded, not refused


def test_a_cut_output_says_so_and_its_patch_is_not_graded(rollout: Rollout) -> None:
    task = bundled_tasks(1)[0]
    lease = rollout.client.post("/allocate", {"instance_id": task["instance_id"]})["lease_id"]
    try:
        rollout.run(lease, apply_command(task["patch"]) + " && seq 1 20000 > LONG.txt")
        cut = rollout.client.post("/exec", {"lease_id": lease, "command": SUBMIT, "max_output_bytes": 4096})
        assert cut["truncated"] is True and cut["output"].startswith(CUT_MARK) and cut["elided_bytes"] > 0
        # what the swe-rl client would take for the patch: everything, as it does not start with the sentinel
        assert "diff --git " in cut["output"] and "+++ b/" in cut["output"]
    finally:
        rollout.client.post("/close", {"lease_id": lease})
    with pytest.raises(RuntimeError, match="cut"):  # 200 with ok: false: no retries, no grade
        rollout.grade(task, cut["output"])


def test_ended_leases_do_not_punish_retrying_clients(service: Service) -> None:
    client = RetryingClient(service.url)  # slime's defaults: 10 attempts, 1 s apart
    lease = client.post("/allocate", {"image": DEFAULT_IMAGE})["lease_id"]
    started = time.monotonic()
    assert client.post("/close", {"lease_id": lease})["state"] == "closed"
    assert client.post("/close", {"lease_id": lease})["state"] == "closed"  # a retried or `finally` close
    assert client.post("/heartbeat", {"lease_id": lease})["state"] == "closed"
    assert client.post("/close", {"lease_id": "lease-never-given"})["state"] == "unknown"
    with pytest.raises(RuntimeError, match="has ended") as failed:  # at once, not after 10 attempts
        client.post("/exec", {"lease_id": lease, "command": "true"})
    assert "'infra': True" in str(failed.value) and "'state': 'closed'" in str(failed.value)
    assert client.sent == 6 and time.monotonic() - started < 5
    client.http.close()


def test_commands_get_a_login_shells_environment(rollout: Rollout) -> None:
    """What `bash -lc` gives (their exec server's way): profile scripts' variables and ~/.bashrc's functions, the
    request's env beside them; a profile edited by the agent counts from its next command on."""
    task = bundled_tasks(1)[0]
    lease = rollout.client.post("/allocate", {"instance_id": task["instance_id"]})["lease_id"]
    try:
        assert rollout.run(lease, "command -v python")["output"].strip() == "/opt/venv/bin/python"
        rollout.run(lease, "echo 'export FROM_PROFILE=yes' > /etc/profile.d/zz-test.sh; "
                    "echo 'greet() { echo hello from bashrc; }' >> ~/.bashrc")
        for _ in range(2):  # from now on the profile files are read: the captured environment is older
            answer = rollout.client.post("/exec", {"lease_id": lease, "command": "echo $FROM_PROFILE $MINE; greet",
                                                   "cwd": "/testbed", "env": {"MINE": "mine"}})
            assert answer["output"] == "yes mine\nhello from bashrc\n", answer
        plain = rollout.run(lease, "echo $PATH; pwd")["output"].split()
        assert plain[0].startswith("/opt/venv/bin:") and plain[1] == "/testbed"
    finally:
        rollout.client.post("/close", {"lease_id": lease})


def test_an_allow_listed_network_needs_no_key(tmp_path: Path) -> None:
    svc = Service(tmp_path, "--allow-from", "127.0.0.2/32", env={"SWECTL_SERVE_API_KEY": "s3cret"})
    try:
        listed = RetryingClient(svc.url, attempts=1, local_address="127.0.0.2")  # sends no Authorization header
        lease = listed.post("/allocate", {"image": DEFAULT_IMAGE})["lease_id"]
        assert listed.post("/exec", {"lease_id": lease, "command": "echo hi", "cwd": "/"})["output"] == "hi\n"
        other = httpx.post(f"{svc.url}/heartbeat", json={"lease_id": lease})  # from 127.0.0.1, not listed
        assert other.status_code == 403 and "127.0.0.2/32" in other.json()["error"]
        wrong = httpx.post(f"{svc.url}/heartbeat", json={"lease_id": lease}, headers={"Authorization": "Bearer x"})
        assert wrong.status_code == 401
        keyed = Client(svc.url, "s3cret")
        assert keyed.ok("/heartbeat", {"lease_id": lease})["state"] == "live"
        assert json.loads(httpx.get(f"{svc.url}/healthz").text) == {"ok": True}
        listed.post("/close", {"lease_id": lease})
        listed.http.close()
    finally:
        assert svc.stop() == 130
