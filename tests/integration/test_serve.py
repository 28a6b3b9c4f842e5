"""`swectl serve` as OpenClaw-RL's swe-rl rollouts use it: a real `swectl serve` process, real Podman sandboxes,
and a plain HTTP client written from the API of the issue (it shares no code with the server).

The whole swe-rl flow on bundled tasks (gold resolves, empty does not), commands killed inside at their
timeout, abandoned leases reclaimed, a sandbox killed from outside, idempotency keys, bad requests (each a
clear JSON error), the API key, and SIGTERM leaving no container behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest

from swectl.config import DEFAULT_IMAGE
from swectl.serve.wire import CUT_MARK
from tests.integration.conftest import REPO_ROOT, podman
from tests.integration.serving import STOP_TIMEOUT_S, Client, Service, bundled_tasks

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = Service(tmp_path_factory.mktemp("serve"), "--lease-ttl", "3")
    try:
        yield svc
    finally:
        svc.stop()


@pytest.fixture
def client(service: Service) -> Iterator[Client]:
    c = Client(service.url)
    yield c
    c.http.close()


def test_the_swe_rl_flow_grades_gold_resolved_and_empty_unresolved(client: Client) -> None:
    for task in bundled_tasks(2):
        iid = task["instance_id"]
        # the agent's episode: allocate, explore, edit, heartbeat, diff, close
        lease = client.allocate(instance_id=iid, image="docker.io/swebench/some-official-name:latest")
        log = client.exec(lease, "git log --oneline | head -1")
        assert log["returncode"] == 0 and "task setup" in log["output"]  # the task's bug is committed
        assert client.exec(lease, "echo edited > NEW_FILE.txt && pwd")["output"].strip() == "/testbed"
        assert client.ok("/heartbeat", {"lease_id": lease}) == {"ok": True, "state": "live"}
        diff = client.ok("/diff", {"lease_id": lease})
        assert diff["returncode"] == 0 and "+edited" in diff["patch"] and "NEW_FILE.txt" in diff["patch"]
        client.ok("/close", {"lease_id": lease})
        # grading: a fresh lease for the instance, then evaluate the gold patch and the empty one
        lease = client.allocate(instance_id=iid)
        gold = client.ok("/evaluate", {"lease_id": lease, "patch": task["patch"], "eval_script": "exit 1"})
        # returncode is the test command's: the grader's must-fail canary (docs/grading.md) makes it 1
        assert gold["resolved"] is True and gold["status"] == "resolved" and gold["returncode"] == 1, gold
        assert len(gold["output"]) <= 2000 and "PASSED" in gold["output"]
        empty = client.ok("/evaluate", {"lease_id": lease, "patch": "", "eval_script": "exit 0"})
        assert empty["resolved"] is False and empty["reason"] == "patch_apply_failed", empty
        client.ok("/close", {"lease_id": lease})


def test_an_unknown_instance_is_graded_by_the_eval_scripts_exit_code(client: Client) -> None:
    lease = client.allocate(image=DEFAULT_IMAGE, instance_id="someone__else-1")
    status, answer = client.post("/evaluate", {"lease_id": lease, "patch": ""})
    assert status == 400 and "eval_script is required" in answer["error"]
    client.exec(lease, "touch /tmp/made-by-the-agent", cwd="/")
    # graded in a fresh sandbox of the lease's image: what the agent left in its own sandbox is not there
    script = "test -f /tmp/made-by-the-agent"
    bad = client.ok("/evaluate", {"lease_id": lease, "patch": "", "eval_script": script, "cwd": "/"})
    assert bad["resolved"] is False and bad["returncode"] == 1 and bad["graded_by"] == "exit_code"
    good = client.ok("/evaluate", {"lease_id": lease, "patch": "", "eval_script": "echo fine; exit 0", "cwd": "/"})
    assert good["resolved"] is True and "fine" in good["output"]
    client.ok("/close", {"lease_id": lease})


def test_a_timed_out_command_is_killed_inside_the_sandbox(client: Client) -> None:
    lease = client.allocate(image=DEFAULT_IMAGE)
    started = time.monotonic()
    r = client.exec(lease, "echo $$ > /tmp/pid; sleep 60", timeout=1, cwd="/")
    assert time.monotonic() - started < 20
    assert r == {"ok": True, "returncode": -1, "output": "Command timed out after 1s"}
    check = "kill -0 $(cat /tmp/pid) 2>/dev/null && echo alive || echo gone; pgrep -fc 'slee[p] 60' || true"
    alive = client.exec(lease, check, cwd="/")
    assert alive["output"].split() == ["gone", "0"], alive
    client.ok("/close", {"lease_id": lease})


def test_huge_binary_and_non_utf8_output_comes_back_as_json(client: Client) -> None:
    lease = client.allocate(image=DEFAULT_IMAGE)
    huge = client.exec(lease, "head -c 20000000 /dev/urandom; echo; echo THE-END", cwd="/",
                       max_output_bytes=100_000)
    assert huge["returncode"] == 0 and len(huge["output"]) < 200_000 and huge["output"].endswith("THE-END\n")
    assert huge["truncated"] is True and huge["output_bytes"] == 20_000_009
    assert huge["output"].startswith(CUT_MARK) and huge["elided_bytes"] == 20_000_009 - 100_000
    odd = client.exec(lease, r"printf 'a\xff\xfeb\x00c\n'", cwd="/")
    assert odd["output"].startswith("a") and "\ufffd" in odd["output"] and odd["output"].endswith("c\n"), odd
    big_command = client.exec(lease, "echo " + "x" * 100_000 + " | wc -c", cwd="/")  # a large body in, fine
    assert big_command["output"].strip() == "100001"
    client.ok("/close", {"lease_id": lease})


def test_commands_on_one_lease_run_one_at_a_time(client: Client) -> None:
    lease = client.allocate(image=DEFAULT_IMAGE)
    exclusive = "mkdir /tmp/held || exit 9; sleep 0.3; rmdir /tmp/held"

    async def burst() -> list[dict]:
        async with httpx.AsyncClient(base_url=str(client.http.base_url), timeout=60) as http:
            answers: list[dict] = []

            async def one() -> None:
                r = await http.post("/exec", json={"lease_id": lease, "command": exclusive, "cwd": "/"})
                answers.append(r.json())

            async with anyio.create_task_group() as tg:
                for _ in range(4):
                    tg.start_soon(one)
            return answers

    answers = anyio.run(burst)
    assert [a["returncode"] for a in answers] == [0, 0, 0, 0], answers
    client.ok("/close", {"lease_id": lease})


def test_an_abandoned_lease_is_reclaimed_and_a_heartbeated_one_is_kept(service: Service, client: Client) -> None:
    abandoned = client.allocate(image=DEFAULT_IMAGE)
    kept = client.allocate(image=DEFAULT_IMAGE)
    before = len(service.containers())
    deadline = time.monotonic() + 7  # the TTL is 3 s; the pool checks every 0.75 s
    while time.monotonic() < deadline:
        client.ok("/heartbeat", {"lease_id": kept})
        time.sleep(0.5)
    status, answer = client.post("/exec", {"lease_id": abandoned, "command": "true"})
    assert status == 200 and answer["ok"] is False and answer["state"] == "expired", answer
    assert answer["infra"] is True and "expired" in answer["error"]
    # a heartbeat cannot revive it: the client's episode must abort (ok: false), never go on to be scored
    status, answer = client.post("/heartbeat", {"lease_id": abandoned})
    assert (status, answer["ok"], answer["state"], answer["infra"]) == (200, False, "expired", True), answer
    assert client.ok("/close", {"lease_id": abandoned})["state"] == "expired"  # a close in `finally` is fine
    assert client.exec(kept, "echo still here", cwd="/")["output"] == "still here\n"
    # the default cwd, /testbed, is missing in this image: the command fails (as `docker exec -w` does), the lease stays
    missing = client.exec(kept, "echo never")
    assert missing["returncode"] == 1 and "/testbed: No such file or directory" in missing["output"]
    assert len(service.containers()) == before - 1  # the abandoned sandbox is gone, its slot back in the pool
    pool = client.http.get("/status").json()["pool"]
    assert pool["expired"] >= 1 and pool["leases_expired"] >= 1
    client.ok("/close", {"lease_id": kept})


def test_a_sandbox_killed_from_outside_ends_its_lease_as_an_infra_failure(client: Client) -> None:
    allocation = client.ok("/allocate", {"image": DEFAULT_IMAGE})
    lease = allocation["lease_id"]
    assert podman("kill", allocation["container_id"]).returncode == 0
    status, answer = client.post("/exec", {"lease_id": lease, "command": "true"})
    assert status == 200 and answer["ok"] is False and answer["infra"] is True, answer
    assert answer["state"] == "lost" and "sandbox" in answer["error"]
    status, answer = client.post("/exec", {"lease_id": lease, "command": "true"})
    assert status == 200 and answer["ok"] is False and "sandbox failed" in answer["error"]


def test_idempotency_keys_give_at_most_once_execution(client: Client) -> None:
    lease = client.allocate(image=DEFAULT_IMAGE)
    key = {"Idempotency-Key": uuid.uuid4().hex}
    body = {"lease_id": lease, "command": "echo x >> /tmp/count; wc -l < /tmp/count", "cwd": "/"}
    first = client.ok("/exec", body, headers=key)
    again = client.ok("/exec", body, headers=key)
    assert first == again and first["output"].strip() == "1"
    assert client.exec(lease, "wc -l < /tmp/count", cwd="/")["output"].strip() == "1"  # ran once
    status, answer = client.post("/exec", {**body, "command": "true"}, headers=key)
    assert status == 422 and "different" in answer["error"]
    alloc_key = {"Idempotency-Key": uuid.uuid4().hex}
    a = client.ok("/allocate", {"image": DEFAULT_IMAGE}, headers=alloc_key)
    b = client.ok("/allocate", {"image": DEFAULT_IMAGE}, headers=alloc_key)
    assert a["lease_id"] == b["lease_id"]
    close_key = {"Idempotency-Key": uuid.uuid4().hex}
    assert client.ok("/close", {"lease_id": a["lease_id"]}, headers=close_key) == {"ok": True, "state": "closed"}
    assert client.ok("/close", {"lease_id": a["lease_id"]}, headers=close_key) == {"ok": True, "state": "closed"}
    client.ok("/close", {"lease_id": lease})


def test_bad_requests_get_clear_json_errors(client: Client) -> None:
    http = client.http
    cases = [
        (http.post("/exec", content=b'{"lease_id": "x"}'), 400, "command"),
        (http.post("/exec", content=b"not json"), 400, "not valid JSON"),
        (http.post("/exec", content=b""), 400, "empty body"),
        (http.post("/exec", json={"lease_id": "lease-nope", "command": "true"}), 404, "unknown lease"),
        (http.post("/exec", json={"lease_id": "x", "command": "true", "timeout": -1}), 400, "timeout"),
        (http.post("/allocate", json={}), 400, "needs an image"),
        (http.post("/allocate", json={"instance_id": "not__known-1"}), 400, "not a task of the served set"),
        (http.post("/heartbeat", json={"lease_id": "lease-nope"}), 404, "unknown lease"),
        (http.get("/exec"), 405, "Method Not Allowed"),
        (http.post("/nowhere", json={}), 404, "Not Found"),
    ]
    for response, status, words in cases:
        body = response.json()
        assert (response.status_code, body["ok"]) == (status, False), (response.request.url, body)
        assert words in body["error"], body
    assert http.get("/healthz").json() == {"ok": True}


def test_body_limit_api_key_and_image_map(tmp_path: Path) -> None:
    image_map = tmp_path / "images.json"
    image_map.write_text(json.dumps({"mapped__instance-1": DEFAULT_IMAGE}))
    svc = Service(tmp_path, "--max-body-mb", "0.01", "--image-map", str(image_map),
                  env={"SWECTL_SERVE_API_KEY": "s3cret"})
    try:
        assert httpx.get(f"{svc.url}/healthz").json() == {"ok": True}  # probes need no key
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.post(f"{svc.url}/allocate", json={"image": DEFAULT_IMAGE}, headers=headers)
            assert r.status_code == 401 and "API key" in r.json()["error"]
            assert httpx.get(f"{svc.url}/status", headers=headers).status_code == 401
        authorized = Client(svc.url, "s3cret")
        status, answer = authorized.post("/exec", {"lease_id": "x", "command": "x" * 20_000})
        assert status == 413 and "over the limit" in answer["error"]
        lease = authorized.allocate(image=DEFAULT_IMAGE)
        assert authorized.exec(lease, "echo hi", cwd="/")["output"] == "hi\n"
        mapped = authorized.ok("/allocate", {"instance_id": "mapped__instance-1", "image": "docker.io/x/y:z"})
        assert mapped["image"] == DEFAULT_IMAGE  # the image map wins over the client's image
    finally:
        assert svc.stop() == 130


def test_sigterm_removes_every_sandbox_of_the_service(tmp_path: Path) -> None:
    svc = Service(tmp_path)
    client = Client(svc.url)
    leases = [client.allocate(image=DEFAULT_IMAGE) for _ in range(3)]
    assert len(svc.containers()) == 3
    client.exec(leases[0], "true", cwd="/")
    svc.proc.send_signal(signal.SIGTERM)
    assert svc.proc.wait(STOP_TIMEOUT_S) == 130
    assert svc.containers() == []
    assert "containers of this run were removed" in svc.log.read_text()
    svc.stop()


def test_a_public_address_without_an_api_key_is_refused(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SWECTL_SERVE_API_KEY"}
    r = subprocess.run([sys.executable, "-m", "swectl.cli.main", "serve", "--host", "0.0.0.0", "--port", "0",
                        "--out", str(tmp_path)], cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and "set an API key" in r.stderr


def test_the_service_runs_on_ssh_nodes(tmp_path: Path) -> None:
    from swectl.testing import nodes as testnodes

    reason = testnodes.can_run_test_nodes()
    if reason is not None:
        pytest.skip(reason)
    with testnodes.test_nodes(2, prefix="swv", base_index=210) as tn:
        config = tmp_path / "cluster.toml"
        config.write_text(tn.cluster_toml(local=False) + "\n[env_pool]\nwarm = 0\n")
        svc = Service(tmp_path, str(config))
        try:
            client = Client(svc.url)
            allocations = [client.ok("/allocate", {"image": DEFAULT_IMAGE}) for _ in range(4)]
            assert {a["node"] for a in allocations} == {n.name for n in tn.nodes}  # spread over both nodes
            for a in allocations:
                assert client.exec(a["lease_id"], "echo $((6 * 7))", cwd="/")["output"] == "42\n"
            client.ok("/close", {"lease_id": allocations[0]["lease_id"]})
            assert len(svc.containers()) == 3
        finally:
            assert svc.stop() == 130
        assert svc.leftover == []
