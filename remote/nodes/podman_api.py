"""Podman's API service on one node for container lifecycle, through podman-py (``sandbox.podman_api = true``).

``PodmanApi`` is a PodmanCli whose lifecycle calls (create, list, remove, images, version, free disk) go to
``podman system service`` instead of spawning a ``podman`` process each: a spawn blocks the controller's event
loop (docs/results.md, "Figures the code relies on") and pays a Go start-up. Commands in a sandbox do not change:
the exec agent still starts through one ``podman exec -i`` (``argv``), and the no-python path keeps its ``podman
exec`` per command.

The service: ``podman system service --time=0 unix://SOCK`` with swectl's containers.conf (CONTAINERS_CONF, as
PodmanCli passes it), started on the node by the first backend that finds none answering at SOCK, detached
(setsid, its output in ``SOCK.log``, its pid in ``SOCK.pid``) so that it outlives the controller and serves the
next one. It stays on the node by design, like the nsbox daemon; a service found dead is started again. SOCK is
``$XDG_RUNTIME_DIR/swectl`` (else /run/swectl for root, else /tmp/swectl-UID) ``/podman-api-KEY.sock``, where KEY
hashes the containers.conf in use: backends with another configuration get their own service. Starts are
serialised by ``flock`` on ``SOCK.lock``. On an SSH node the socket is reached through the connection
(``SshNode.forward_unix``); on this machine directly.

podman-py is synchronous: every call runs in a worker thread (``anyio.to_thread.run_sync``) under a per-node
CapacityLimiter, each thread with its own client (its own keep-alive connection). Calls are not abandoned when
cancelled (a create the controller no longer waits for would leave a container behind): a cancelled call
returns when its HTTP request does, each bounded by a timeout.

A container is made exactly as ``podman run`` makes it in ``ContainerCli.run_args`` (the libpod
SpecGenerator the CLI sends: name, labels, env, init, stop timeout 0, network none unless ``spec.network``,
memory/pids/cpus limits, workdir, ``sleep infinity``); the service fills the rest from the same containers.conf
(runtime, ulimits, capabilities, init path). Only ``podman inspect``'s CreateCommand differs (empty). A missing
image is pulled as ``podman run`` would; errors are CommandErrors naming the call (and the image).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from typing import TYPE_CHECKING, Any

import anyio

from swectl.errors import CommandError, NodeLostError, SwectlError
from swectl.remote.nodes.node import Node
from swectl.remote.nodes.podman import PodmanCli, bundled_containers_conf, qualify_image
from swectl.schema import SandboxInfo, SandboxSpec

if TYPE_CHECKING:
    import podman

CONCURRENCY = 8  # API calls at once per node (worker threads, each with its own connection)
CALL_TIMEOUT_S = 300.0  # one lifecycle request (the CLI path has none; a loaded node may take a while)
PULL_TIMEOUT_S = 3600.0
SERVICE_START_S = 30.0  # until a started service answers
CPU_PERIOD = 100_000  # podman's --cpus: quota = cpus * period over this period (µs)

# $1: the socket's key; then mode ("locate" | "start"); then the podman argv prefix (env CONTAINERS_CONF=... podman).
# locate: print the socket's path. start: under the lock, start a service unless the one in SOCK.pid still runs
# (one started by a controller beside us), wait for its socket, print the path.
_SERVICE_SCRIPT = r"""
if [ -n "${XDG_RUNTIME_DIR:-}" ] && [ -d "$XDG_RUNTIME_DIR" ]; then d="$XDG_RUNTIME_DIR/swectl"
elif [ "$(id -u)" = 0 ]; then d=/run/swectl
else d="${TMPDIR:-/tmp}/swectl-$(id -u)"; fi
mkdir -p "$d" && chmod 700 "$d" || exit 1
sock="$d/podman-api-$1.sock"
mode=$2
shift 2
if [ "$mode" = locate ]; then printf %s "$sock"; exit 0; fi
exec 9>>"$sock.lock"
if command -v flock >/dev/null 2>&1; then
  flock -w 60 9 || { echo "timed out waiting for $sock.lock" >&2; exit 1; }
fi
pid=$(cat "$sock.pid" 2>/dev/null)
if ! { [ -n "$pid" ] && grep -qF "$sock" "/proc/$pid/cmdline" 2>/dev/null; }; then
  rm -f "$sock"
  (cd / && exec setsid "$@" system service --time=0 "unix://$sock" </dev/null >"$sock.log" 2>&1 9>&-) &
  echo $! > "$sock.pid"
fi
i=0
while [ ! -S "$sock" ]; do
  i=$((i + 1))
  if [ "$i" -gt 300 ]; then echo "no socket $sock after 30 s: $(tail -c 2000 "$sock.log")" >&2; exit 1; fi
  sleep 0.1
done
printf %s "$sock"
"""


class _Unreachable(SwectlError):
    """The service did not answer (no socket, connection refused or reset, timed out)."""


class _HttpError(SwectlError):
    """The service answered with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def ram_in_bytes(size: str) -> int:
    """``--memory``'s reading of a size (go-units RAMInBytes): ``2g``, ``300m``, ``512MiB``, ``1.5G``, ``1024``."""
    match = re.fullmatch(r"(\d+(?:\.\d+)*) ?([kKmMgGtTpP])?[iI]?[bB]?", size.strip())
    if match is None:
        raise ValueError(f"invalid memory size {size!r}")
    return int(float(match.group(1)) * 1024 ** " kmgtp".index((match.group(2) or " ").lower()))


def create_body(spec: SandboxSpec, name: str) -> dict[str, Any]:
    """The libpod SpecGenerator that ``podman run`` sends for ``ContainerCli.run_args(spec, name)``."""
    body: dict[str, Any] = {
        "name": name,
        "image": qualify_image(spec.image),
        "entrypoint": ["sleep"],
        "command": ["infinity"],
        "labels": dict(spec.labels),
        "env": dict(spec.env),
        "init": True,
        "stop_timeout": 0,
        # What the CLI always sends (no terminal, the default sd-notify mode), so that the containers are the same
        "annotations": {"io.kubernetes.cri-o.TTY": "false"},
        "sdnotifyMode": "container",
        "work_dir": spec.workdir,
        "resource_limits": {
            "memory": {"limit": ram_in_bytes(spec.memory)},
            "pids": {"limit": spec.pids_limit},
        },
    }
    if spec.cpus > 0:  # 0: no CPU limit
        body["resource_limits"]["cpu"] = {"period": CPU_PERIOD, "quota": int(spec.cpus * CPU_PERIOD)}
    if not spec.network:
        body["netns"] = {"nsmode": "none"}
    if spec.mounts:
        body["mounts"] = [{"type": "bind", "source": m.source, "destination": m.target, "options": ["rbind", "ro"]}
                          for m in spec.mounts]
    return body


class PodmanApi(PodmanCli):
    """Lifecycle through the node's Podman API service; ``argv``/``run`` (the exec agent, the no-python path)
    stay on the CLI."""

    def __init__(self, node: Node, containers_conf: str = "bundled", concurrency: int = CONCURRENCY) -> None:
        super().__init__(node, containers_conf)
        self.socket: str | None = None  # the service's socket on the node
        self._url: str | None = None  # how this machine reaches it
        self._limiter = anyio.CapacityLimiter(concurrency)
        self._restart = anyio.Lock()
        self._local = threading.local()
        self._clients: list[podman.PodmanClient] = []
        self._clients_lock = threading.Lock()

    # ------------------------------------------------------------------ the service

    def _key(self) -> str:
        conf = bundled_containers_conf().read_bytes() if self._conf == "bundled" else self._conf.encode()
        return hashlib.sha256(conf).hexdigest()[:12]

    async def _service(self, mode: str) -> str:
        assert self._prefix is not None
        argv = ["sh", "-c", _SERVICE_SCRIPT, "sh", self._key(), mode, *self._prefix, self.binary]
        out = await self.node.run(argv)
        if out.exit_code != 0:
            shown = ["sh", "-c", "<start podman system service>", *argv[3:]]
            raise CommandError(self.node.name, shown, out.exit_code, out.stderr.decode(errors="replace"))
        return out.stdout.decode()

    async def _reach(self) -> str:
        """The service's URL from this machine (on an SSH node: forwarded, again after a reconnection)."""
        assert self.socket is not None
        forward = getattr(self.node, "forward_unix", None)
        self._url = f"unix://{await forward(self.socket) if forward is not None else self.socket}"
        return self._url

    async def _ensure_service(self) -> None:
        """Find the node's service answering at its socket, or start it and wait until it answers."""
        if self.socket is None:
            self.socket = await self._service("locate")
        if await self._answers():
            return
        await self._service("start")
        with anyio.move_on_after(SERVICE_START_S):
            while not await self._answers():  # noqa: ASYNC110 (a service on the node)
                await anyio.sleep(0.1)
            return
        raise CommandError(
            self.node.name, [self.binary, "system", "service", f"unix://{self.socket}"], None,
            f"the service does not answer {SERVICE_START_S:g}s after it started (its log: {self.socket}.log)",
        )  # fmt: skip

    async def _answers(self) -> bool:
        url = await self._reach()
        try:
            await anyio.to_thread.run_sync(self._request, url, "GET", "/_ping", {}, 10.0, limiter=self._limiter)
        except (_Unreachable, _HttpError):
            return False
        return True

    async def prepare(self) -> None:
        """swectl's containers.conf on the node (PodmanCli.prepare), then the service answering."""
        await super().prepare()
        await self._ensure_service()

    @property
    def ready(self) -> bool:
        return self._prefix is not None and self._url is not None

    # ------------------------------------------------------------------ calls

    def _client(self, url: str) -> podman.PodmanClient:
        client = getattr(self._local, "client", None)
        if client is None or self._local.url != url:
            import podman  # podman-py (and requests) only where the API path is used: 150 ms of imports

            client = podman.PodmanClient(base_url=url)
            self._local.client, self._local.url = client, url
            with self._clients_lock:
                self._clients.append(client)
        return client

    def _request(
        self, url: str, method: str, path: str, params: dict[str, Any], timeout: float, data: Any = None
    ) -> Any:
        """One request in a worker thread: the decoded JSON body (else the text; None when empty); _HttpError for a
        status >= 400, _Unreachable when the service does not answer."""
        from podman.errors import APIError

        api = self._client(url).api
        kwargs: dict[str, Any] = {"params": params, "timeout": timeout}
        if data is not None:
            kwargs.update(data=data, headers={"content-type": "application/json"})
        try:
            response = {"GET": api.get, "POST": api.post, "DELETE": api.delete}[method](path, **kwargs)
        except APIError as exc:  # podman-py wraps OSError (requests' connection errors and timeouts)
            raise _Unreachable(f"{exc}: {exc.__cause__}") from exc
        if response.status_code >= 400:
            try:
                message = response.json().get("message") or response.text
            except ValueError:
                message = response.text
            raise _HttpError(response.status_code, message.strip())
        if path == "/images/pull":  # a stream of JSON objects, one per line
            return [json.loads(line) for line in response.text.splitlines() if line.strip()]
        if not response.content or "json" not in response.headers.get("content-type", ""):
            return response.text or None  # /_ping answers "OK"
        return response.json()

    async def _call(
        self, method: str, path: str, params: dict[str, Any] | None = None, *, data: Any = None,
        timeout: float = CALL_TIMEOUT_S, what: str = "",
    ) -> Any:  # fmt: skip
        """A request to the service in a worker thread; a service that does not answer is started again and the
        request retried once. Errors: CommandError (status as exit code), NodeLostError on a dropped SSH node."""
        body = json.dumps(data) if data is not None else None
        shown = ["podman-api", method, path, *([what] if what else [])]
        for attempt in (1, 2):
            url = await self._reach()
            try:
                return await anyio.to_thread.run_sync(
                    self._request, url, method, path, params or {}, timeout, body, limiter=self._limiter
                )
            except _HttpError as exc:
                raise CommandError(self.node.name, shown, exc.status, exc.message) from exc
            except _Unreachable as exc:
                if not self.node.alive:
                    raise NodeLostError(self.node.name, f"connection lost during {' '.join(shown)}") from exc
                if attempt == 2:
                    message = f"the Podman API service does not answer: {exc}"
                    raise CommandError(self.node.name, shown, None, message) from exc
                async with self._restart:  # one restart for every call that found the service gone
                    await self._ensure_service()
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ PodmanCli's lifecycle methods

    async def version(self) -> str:
        return str((await self._call("GET", "/version"))["Version"])

    async def images(self) -> list[str]:
        rows = await self._call("GET", "/images/json") or []
        return [name for row in rows for name in row.get("Names") or [] if "<none>" not in name]

    async def store_root(self) -> str:
        return str((await self._call("GET", "/info"))["store"]["graphRoot"] or "")

    async def create(self, spec: SandboxSpec, name: str) -> str:
        """Create and start a container that idles until removed (``podman run -d``); returns its id."""
        image = qualify_image(spec.image)
        try:
            body = create_body(spec, name)
        except ValueError as exc:
            raise CommandError(self.node.name, ["podman-api", "create", name], None, str(exc)) from exc
        what = f"{name} from {image}"
        try:
            created = await self._call("POST", "/containers/create", data=body, what=what)
        except CommandError as exc:
            if "image not known" not in exc.stderr and "no such image" not in exc.stderr.lower():
                raise
            await self._pull(image, exc)
            created = await self._call("POST", "/containers/create", data=body, what=what)
        cid = str(created["Id"])
        await self._call("POST", f"/containers/{cid}/start", what=what)
        return cid

    async def _pull(self, image: str, missing: CommandError) -> None:
        """Pull a missing image (what `podman run` does); a failure names the image."""
        try:
            events = await self._call(
                "POST", "/images/pull", {"reference": image, "quiet": "true"}, timeout=PULL_TIMEOUT_S, what=image
            )
            errors = [str(e["error"]) for e in events or [] if isinstance(e, dict) and e.get("error")]
        except CommandError as exc:
            errors = [exc.stderr]
        if errors:
            raise CommandError(
                self.node.name, missing.argv, missing.exit_code,
                f"image {image} is not on node {self.node.name!r} and pulling it failed: {errors[-1]}",
            )  # fmt: skip

    async def list_containers(self, labels: dict[str, str]) -> list[SandboxInfo]:
        filters = json.dumps({"label": [f"{key}={value}" for key, value in sorted(labels.items())]})
        rows = await self._call("GET", "/containers/json", {"all": "true", "filters": filters}) or []
        return self._sandbox_infos(rows)

    async def remove(self, ids: list[str]) -> None:
        """Force-remove containers (one request each, CONCURRENCY at once); missing ones are not an error."""
        failures: list[str] = []

        async def remove_one(cid: str) -> None:
            params = {"force": "true", "ignore": "true", "timeout": "0"}
            try:
                reports = await self._call("DELETE", f"/containers/{cid}", params) or []
            except CommandError as exc:
                failures.append(f"{cid}: {exc.stderr}")
                return
            failures.extend(f"{cid}: {r['Err']}" for r in reports if isinstance(r, dict) and r.get("Err"))

        async with anyio.create_task_group() as tg:
            for cid in ids:
                tg.start_soon(remove_one, cid)
        if failures:
            raise CommandError(self.node.name, ["podman-api", "DELETE", "/containers", *ids], 1, "; ".join(failures))

    def close(self) -> None:
        """Close every worker thread's client (their connections); call when no request is in flight."""
        with self._clients_lock:
            clients, self._clients = self._clients, []
        for client in clients:
            client.close()
        self._local = threading.local()

