"""An environment class for mini-swe-agent v2 that runs its commands in a swectl sandbox through the gateway.

This file runs inside the harness's own interpreter (.venv-harness), not swectl's: it uses the standard library and
mini-swe-agent alone. mini loads it by dotted path from its config::

    PYTHONPATH=<swectl>/swectl/gateway/harness mini -c swebench.yaml \\
        -c environment.environment_class=swectl_mini.SwectlEnvironment \\
        -c environment.gateway_url=<the gateway's url> -c environment.api_key=<the episode's key> ...

Each ``execute`` posts ``{command, cwd, env, timeout}`` to ``<gateway_url>/../swectl/v1/exec`` with the episode's key
(the same key its model calls use) and returns what mini's templates read: ``output``, ``returncode`` and
``exception_info``. A command whose output begins with ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` and exits 0 ends
the episode as mini's own environments do: it raises mini's ``Submitted`` with the rest of the output.

A gateway that cannot run the command (the sandbox was lost: HTTP 503) raises RuntimeError: the run stops, and swectl
counts the episode as an infrastructure failure, never as the command's result.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

SUBMIT_MARK = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class SwectlEnvironment:
    """mini-swe-agent's environment interface (execute, get_template_vars, serialize) over the swectl gateway."""

    def __init__(self, *, gateway_url: str, api_key: str, cwd: str = "", env: dict[str, str] | None = None,
                 timeout: int = 60, **ignored: Any) -> None:
        self.config = {"gateway_url": gateway_url, "cwd": cwd, "env": dict(env or {}), "timeout": timeout,
                       **{k: v for k, v in ignored.items() if isinstance(v, str | int | float | bool | list | dict)}}
        base = gateway_url.rstrip("/")
        self._url = (base[: -len("/v1")] if base.endswith("/v1") else base) + "/swectl/v1/exec"
        self._key = api_key

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        body = {"command": action.get("command", ""), "cwd": cwd or self.config["cwd"], "env": self.config["env"],
                "timeout": float(timeout or self.config["timeout"])}
        request = urllib.request.Request(self._url, data=json.dumps(body).encode(), method="POST",
                                         headers={"Authorization": f"Bearer {self._key}",
                                                  "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=body["timeout"] + 180) as response:
                output = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"swectl gateway: the command could not run (HTTP {exc.code}): "
                               f"{exc.read()[:2000].decode(errors='replace')}") from exc
        result = {"output": output.get("output", ""), "returncode": int(output.get("returncode", -1)),
                  "exception_info": output.get("exception_info", "")}
        self._submitted(result)
        return result

    @staticmethod
    def _submitted(result: dict[str, Any]) -> None:
        first, _, rest = result["output"].lstrip().partition("\n")
        if first.strip() == SUBMIT_MARK and result["returncode"] == 0:
            from minisweagent.exceptions import Submitted  # the harness's own exception: its agent stops on it

            raise Submitted({"role": "exit", "content": rest,
                             "extra": {"exit_status": "Submitted", "submission": rest}})

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return {**self.config, **kwargs}

    def serialize(self) -> dict[str, Any]:
        config = {k: v for k, v in self.config.items() if k != "api_key"}
        return {"info": {"config": {"environment": config,
                                    "environment_type": f"{type(self).__module__}.{type(self).__name__}"}}}
