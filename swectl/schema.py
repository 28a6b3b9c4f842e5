"""The types shared across swectl's layers, as frozen msgspec Structs: the exec agent's wire protocol, what
nodes and sandboxes report (CommandOutput, ExecResult, SandboxSpec, SandboxInfo, NodeReport) and what the actors'
``statistics()`` return (PoolStatistics, EngineStatistics, GraderStatistics, RolloutStatistics; ServerState).

Types used by one subject live beside it: the engine wire format in swectl/engine/wire.py, Task in
swectl/tasks/record.py, episodes and trajectories in swectl/agent/, config sections in swectl/config.py and
next to their actor.

Narrow types per stage. Wire types of the in-sandbox exec agent (remote/programs/exec_agent.py) are tagged unions:
requests carry ``op``, replies carry ``kind``. The agent speaks msgpack maps, so fields are matched by
name; new optional fields may be added with defaults (msgspec schema evolution), never renamed.
"""

from __future__ import annotations

import enum

import msgspec

# ---------------------------------------------------------------- exec agent wire protocol (version 1)


class ExecRequest(msgspec.Struct, frozen=True, tag="exec", tag_field="op"):
    """Exec agent request: run a shell command with a timeout."""
    id: int
    command: str
    timeout: float
    cwd: str | None = None
    env: dict[str, str] | None = None
    head: int = 10_000
    tail: int = 10_000


class WriteRequest(msgspec.Struct, frozen=True, tag="write", tag_field="op"):
    """Exec agent request: write (or append) bytes to a file."""
    id: int
    path: str
    data: bytes
    append: bool = False
    mode: int | None = None


class ReadRequest(msgspec.Struct, frozen=True, tag="read", tag_field="op"):
    """Exec agent request: read a byte range of a file."""
    id: int
    path: str
    offset: int
    length: int


class PingRequest(msgspec.Struct, frozen=True, tag="ping", tag_field="op"):
    """Exec agent request: answer with a pong."""
    id: int


class ForwardRequest(msgspec.Struct, frozen=True, tag="forward", tag_field="op"):
    """Exec agent request: listen on 127.0.0.1:``port`` inside the sandbox and relay every connection to the unix
    socket ``path`` (which the controller's side serves), in a child process of the agent's until it is killed."""
    id: int
    port: int
    path: str


AgentRequest = ExecRequest | WriteRequest | ReadRequest | PingRequest | ForwardRequest


class AgentHello(msgspec.Struct, frozen=True, tag="hello", tag_field="kind"):
    """The exec agent's first message: its pid, Python version and protocol version."""
    pid: int
    python: str
    protocol: int


class ExecReply(msgspec.Struct, frozen=True, tag="exec", tag_field="kind"):
    """Exec agent reply: a command's exit code, timeout flag and output."""
    id: int
    exit_code: int
    timed_out: bool
    output: bytes
    elided: int
    duration_s: float


class WriteReply(msgspec.Struct, frozen=True, tag="write", tag_field="kind"):
    """Exec agent reply: the file's size after a write."""
    id: int
    size: int


class ReadReply(msgspec.Struct, frozen=True, tag="read", tag_field="kind"):
    """Exec agent reply: the bytes read and the file's size."""
    id: int
    data: bytes
    size: int


class PongReply(msgspec.Struct, frozen=True, tag="pong", tag_field="kind"):
    """Exec agent reply to a ping."""
    id: int


class ErrorReply(msgspec.Struct, frozen=True, tag="error", tag_field="kind"):
    """Exec agent reply: the request failed (message, errno)."""
    id: int
    error: str
    errno: int | None = None


class ForwardReply(msgspec.Struct, frozen=True, tag="forward", tag_field="kind"):
    """Exec agent reply: the relay listens; ``pid`` is its process inside the sandbox."""
    id: int
    pid: int


AgentReply = AgentHello | ExecReply | WriteReply | ReadReply | PongReply | ForwardReply | ErrorReply

# ---------------------------------------------------------------- nodes and sandboxes


class CommandOutput(msgspec.Struct, frozen=True):
    """A host-side command run on a node (podman CLI, health checks)."""

    exit_code: int
    stdout: bytes
    stderr: bytes


class ExecResult(msgspec.Struct, frozen=True):
    """What one command in a sandbox produced. A timeout is a result, not an error."""

    output: str  # merged stdout+stderr, decoded with errors="replace", head+tail with an elision marker
    exit_code: int
    timed_out: bool
    elided_bytes: int = 0
    duration_s: float = 0.0


class Mount(msgspec.Struct, frozen=True):
    """A folder of the node bound read-only into a sandbox (``source`` on the node, ``target`` inside)."""

    source: str
    target: str


class SandboxSpec(msgspec.Struct, frozen=True):
    """How to create one sandbox. Limits come from the [sandbox] config section."""

    image: str
    workdir: str = "/"
    network: bool = False
    memory: str = "2g"
    pids_limit: int = 512
    cpus: float = 1.0  # 0: no CPU limit
    labels: dict[str, str] = {}
    env: dict[str, str] = {}
    mounts: list[Mount] = []  # folders of the node bound read-only into the sandbox


class SandboxInfo(msgspec.Struct, frozen=True):
    """A container swectl created, as listed on a node."""

    id: str
    name: str
    node: str
    image: str
    state: str
    labels: dict[str, str]


# ---------------------------------------------------------------- nodes and the env pool


class NodeReport(msgspec.Struct, frozen=True):
    """Result of `swectl nodes check` for one node."""

    node: str
    ok: bool
    podman_version: str = ""
    images: list[str] = []
    free_disk_gb: float | None = None
    swectl_containers: int = 0
    exec_ok: bool = False
    problems: list[str] = []  # each "<problem> -- hint: <what to do>"
    backend: str = ""  # the configured sandbox backend the check exercised (sandbox.backend; always set)
    namespace: str = ""  # whether the node can run namespace sandboxes: "yes", or "no: <why>"
    unenforced_limits: list[str] = []  # limits namespace sandboxes could not enforce there (no cgroup controller)
    image_disk_gb: float | None = None  # what the node's images take on its disk (each shared layer once)
    image_disk_budget_gb: float = 0.0  # nodes.N.image_disk_gb (0: no budget)
    engine_kinds: dict[str, str] = {}  # engine kind -> "yes", or "no: <why>" (cpu, sglang, vllm; for [engine] python)


class NodeStatistics(msgspec.Struct, frozen=True):
    """EnvPool.statistics() for one node: health, leased, warm and starting sandboxes."""
    name: str
    healthy: bool
    leased: int
    warm: int
    starting: int
    max_running: int
    max_starting: int
    failures: int
    images: int | None = None  # images the pool knows the node holds; None: not known (not listed, or no store)
    pulls: int = 0  # image pulls in flight there
    waiting: int = 0  # leases (and warm sandboxes) waiting for a pull there
    image_disk_gb: float | None = None  # what its images take, as last measured (nodes with a budget)
    image_disk_budget_gb: float = 0.0  # nodes.N.image_disk_gb (0: no budget)


class PoolStatistics(msgspec.Struct, frozen=True):
    """EnvPool.statistics(): per-node statistics and pool-wide counts."""
    nodes: list[NodeStatistics]
    leased: int
    warm: int
    starting: int
    leases_granted: int
    warm_hits: int
    cold_starts: int
    leases_expired: int
    leases_failed: int
    start_failures: int
    orphans_reaped: int
    image_pulls: int = 0  # images pulled onto a node for a lease or a warm sandbox (one per node and image at a time)
    image_pull_failures: int = 0
    image_waits: int = 0  # leases that waited for a pull of their image first
    image_wait_s: float = 0.0  # the seconds those leases waited, summed
    images_evicted: int = 0  # images removed to keep a node within its disk budget


# ---------------------------------------------------------------- engines, grader and rollout


class ServerState(enum.Enum):
    """Where one inference server is in its life (the Engines actor's state machine)."""

    STOPPED = "stopped"  # no process: before the first start, after shutdown
    STARTING = "starting"  # launched, not answering /health yet; not routed to
    HEALTHY = "healthy"  # its last health check passed; routed to
    FAILING = "failing"  # fewer than engine.max_failures checks failed in a row; still routed to
    DOWN = "down"  # engine.max_failures checks failed in a row; not routed to (an external server stays here)
    RESTARTING = "restarting"  # exited or down; relaunched after engine.health_interval_s; not routed to


class ServerStatistics(msgspec.Struct, frozen=True):
    """Engines.statistics() for one engine server: where it runs and its state."""
    index: int
    node: str
    url: str
    state: ServerState
    failures: int  # failed health checks in a row
    restarts: int
    last_error: str


class EngineStatistics(msgspec.Struct, frozen=True):
    """Engines.statistics(): the servers and how many take requests."""
    servers: list[ServerStatistics]
    routable: int  # servers that take requests (healthy or failing)
    outage_waits: int = 0  # episodes that waited for a server to come back (no server was healthy)
    outage_wait_s: float = 0.0  # the seconds they waited, in all


class GraderStatistics(msgspec.Struct, frozen=True):
    """Grader.statistics(): gradings running, waiting, done and resolved."""
    running: int  # gradings holding a slot
    waiting: int  # gradings waiting for a slot
    graded: int
    resolved: int
    unresolved: int
    errors: int
    infra_errors: int  # errors that are the infrastructure's (dropped, never scored)
    reused: int = 0  # verdicts given without a sandbox (empty patch, a patch graded before): GraderConfig.reuse
    tampered: int = 0  # patches graded "tampered" (docs/grading.md): no reward, counted apart from unresolved


class RolloutStatistics(msgspec.Struct, frozen=True):
    """Rollout.statistics(): episodes running, waiting and finished, and how they ended."""
    running: int  # episodes holding a slot
    waiting: int  # episodes waiting for a slot
    finished: int
    completed: int
    truncated: int
    aborted: int
    resolved: int
    engine_waits: int = 0  # episodes that waited for an engine to come back before starting
    engine_wait_s: float = 0.0  # the seconds they waited, in all


class JudgeStatistics(msgspec.Struct, frozen=True):
    """Judge.statistics(): the process-reward judge's steps and votes, and what went wrong."""
    steps: int  # steps judged (each sampled [reward.prm] samples times)
    scored: int  # steps with at least one vote that parsed
    votes: int  # answers that parsed to +1 or -1
    unparseable: int  # answers without a \\boxed{1} / \\boxed{-1}
    failures: int  # requests that failed (engine down, timeout, rejected): never a score


class TrainerStatistics(msgspec.Struct, frozen=True):
    """Trainer.statistics(): the ranks, steps done and refused, the last step's time."""
    world_size: int
    parameters: int
    steps: int
    skipped: int  # steps refused for a non-finite loss or gradient
    last_step_s: float


class DataSourceStatistics(msgspec.Struct, frozen=True):
    """DataSource.statistics(): the training tasks and where the cursor stands."""
    tasks: int
    epoch: int
    index: int
    consumed: int


class MetricsStatistics(msgspec.Struct, frozen=True):
    """Metrics.statistics(): the steps in the run's metrics.jsonl and the last one."""
    steps_logged: int  # distinct steps in metrics.jsonl (those kept from before a resume included)
    last_step: int | None  # None: nothing logged yet


class GatewayStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """The gateway's counters since it started (actors/gateway.py)."""

    sessions_open: int
    sessions_ended: int
    requests: int
    replayed: int  # retries answered from the record
    rejected: int  # answered with a 4xx
    engine_failures: int  # answered with a 5xx
    disconnected: int = 0  # turns cancelled because their client went away
    engine_retries: int = 0  # turns asked again of a routable server after theirs failed (the outage wait)



class HarnessStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """An external harness's episodes since it started (actors/harness.py): their gateway sessions' turns, branches
    beyond the first (``gateway/branches``) and drifted tokens (``gateway/drift_tokens``), and the gateway's own
    counters."""

    episodes: int
    turns: int
    branches: int
    drift_tokens: int
    gateway: GatewayStatistics
