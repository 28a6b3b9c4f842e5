"""The one exception tree of swectl: every exception the product raises derives from SwectlError.

Classes defined elsewhere are marked with their module (they live next to the code that raises them).

    SwectlError                      base of everything swectl raises on purpose
    +-- ConfigError                  bad cluster.toml / --set value (message names the knob); a ValueError
    +-- TaskDataError                task rows unreadable or malformed (file:line, field, expected); a ValueError
    |   +-- RowProblemError          one malformed row, with its RowProblem (swectl.tasks.sources)
    |   +-- EvalSetError             an evaluation set would become training prompts (swectl.data.prepare)
    |   +-- HarborTaskError          a Harbor task folder swectl cannot use; names the folder and the field
    |                                (swectl.tasks.harbor)
    +-- DiffError                    a diff cannot be parsed or reversed; a ValueError (swectl.tasks.diffs)
    +-- SpecError                    SWE-bench repo specs missing, or no spec / eval script for a task
    +-- ImageBuildError              an image build step failed; names the step and its log (swectl.images.project)
    |   +-- BuildStepError           podman build failed in a known RUN step (swectl.images.builds)
    +-- ModelInitError               `swectl model init` cannot write its folder, or the ML stack is missing
    |                                (swectl.model.tiny)
    +-- PoolClosedError              the env pool is shutting down
    +-- InfraError                   infrastructure failed: never a reward, the episode is ABORTED
    |   +-- NodeError                a node cannot be reached or misbehaves
    |   |   +-- NodeConnectError     could not connect (refused, auth, unknown host key, timeout)
    |   |   +-- NodeLostError        a node died while work was on it
    |   +-- CommandError             a host-side command (podman, ssh) failed; carries argv, exit code, stderr
    |   +-- RegistryError            an image registry could not be asked: down, refused, no such image, not a
    |   |                            manifest; or the controller's own registry cannot start (swectl.images.registry)
    |   |   +-- NotInRegistryError   the registry answered that it has no such image (swectl.images.registry)
    |   +-- ImagePullError           an image could not be made present on a node: its pull failed or ran out of
    |   |                            time (swectl.images.store)
    |   +-- SandboxError             a sandbox could not be created, or it broke
    |   |   +-- SandboxLostError     the sandbox (or its exec agent) vanished: container killed, OOM, ...
    |   |   +-- AgentProtocolError   the exec agent answered something that is not the protocol
    |   +-- LeaseError               a lease is no longer valid
    |   |   +-- LeaseExpiredError    the holder stopped heartbeating for longer than the TTL
    |   +-- TrainerLostError         the torchrun trainer workers died or stopped answering; quotes their log
    |   |                            (swectl.actors.trainer); the run restarts them from the last checkpoint
    |   +-- EngineError              an inference engine (SGLang, the CPU engine, an OpenAI endpoint) failed;
    |       |                        the message names the engine's URL and the endpoint
    |       +-- EngineUnavailableError   unreachable, refused, reset mid-request, 5xx, 429: it may come back
    |       |   +-- EngineConnectError   nothing accepted the connection (refused, unknown host, unreachable)
    |       |   +-- EngineTimeoutError   no complete answer within the call's time bound
    |       +-- EngineResponseError  an answer that is not the protocol (bad JSON, missing or mistyped fields);
    |       |                        quotes the first 300 characters of the body
    |       +-- EngineRejectedError  the engine refused the request (4xx, or ``success: false``)
    +-- FormatError                  a model reply without exactly one bash block (swectl.agent.protocol); the agent
    |                                sees it as an observation
    +-- GoldScriptError              a task's gold patch cannot be written as agent commands (swectl.agent.gold)
    +-- EpisodeEnd                   an episode is over: raised by the check that finds it, caught once by the
    |   |                            agent loop, never escapes it (swectl.agent.loop)
    |   +-- Submitted, LimitsExceeded, TimeExceeded, ContextExceeded, FormatErrorsExceeded, Aborted
    +-- TrainerFailedError       the trainer ranks refused a request (bad batch, disk full); they stay up
    |   |                            (swectl.actors.trainer)
    |   +-- TrainerNoSpaceError  a write found its disk full (also an InfraError): a checkpoint is skipped, a
    |                            step restarts from the last checkpoint once there is space
    +-- BadRequest                   the CPU engine's HTTP 400 (swectl.remote.programs.engine_api)
    +-- ApiError                     a `swectl serve` request that fails: HTTP status, message, infra flag
    |                                (swectl.serve.wire)
    +-- CaptureError                 a sandbox's login environment could not be captured; its commands then read
    |                                the profile files each time (swectl.serve.login_shell)
    +-- TransportError               a TrainBatch cannot be written to or read from shared memory; the message
    |                                names the segment
    +-- NoTarget                     a fault to inject finds nothing of its kind in the run right now (tests and
                                     benchmarks only: swectl.testing.chaos)

Outside the tree on purpose: the exec agent (swectl.remote.programs.exec_agent) runs inside sandboxes on the
standard library alone and defines its own errors; the actors' private control-flow exceptions derive from
SwectlError too but are never raised out of their module.

A command that runs inside a sandbox and fails or times out is *not* an error: it is an ExecResult
with a non-zero exit code or ``timed_out=True``, which the agent sees as an observation.

Third-party errors (asyncssh, httpx, OSError from subprocesses) are translated where they are caught and
chained with ``raise ... from exc``.
"""

from __future__ import annotations


class SwectlError(Exception):
    """Base class of every error swectl raises on purpose."""


class ConfigError(SwectlError, ValueError):
    """The configuration is invalid; the message names the knob and how to fix it."""


class TaskDataError(SwectlError, ValueError):
    """Task data cannot be read or a row is malformed; the message names the file:line, the field and what
    was expected."""


class InfraError(SwectlError):
    """Infrastructure failed. Never turned into a reward."""


class NodeError(InfraError):
    """A node cannot be reached or misbehaves; ``node`` is its name."""

    def __init__(self, node: str, message: str) -> None:
        super().__init__(f"node {node!r}: {message}")
        self.node = node


class NodeConnectError(NodeError):
    """Could not connect to the node (refused, auth, unknown host key, timeout)."""


class NodeLostError(NodeError):
    """The node died (or its connection did) while work was on it."""


class CommandError(InfraError):
    """A host-side command (podman, ssh) failed; carries ``argv``, ``exit_code`` (None: it never ran) and ``stderr``."""

    def __init__(self, node: str, argv: list[str], exit_code: int | None, stderr: str) -> None:
        shown = " ".join(argv)
        if len(shown) > 300:
            shown = shown[:300] + "..."
        super().__init__(f"node {node!r}: `{shown}` exited {exit_code}: {stderr.strip()[-2000:]}")
        self.node = node
        self.argv = argv
        self.exit_code = exit_code
        self.stderr = stderr


class SandboxError(InfraError):
    """A sandbox could not be created, or it broke."""


class SandboxLostError(SandboxError):
    """The sandbox (or its exec agent) vanished: container killed, OOM, transport broken."""


class AgentProtocolError(SandboxError):
    """The exec agent answered something that is not the protocol."""


class LeaseError(InfraError):
    """A lease is no longer valid."""


class LeaseExpiredError(LeaseError):
    """The lease holder stopped heartbeating for longer than the TTL."""


class PoolClosedError(SwectlError):
    """The env pool is shutting down: no new leases."""


class SpecError(SwectlError):
    """SWE-bench specifications are missing or do not cover a task (message says how to fix it)."""


class TransportError(SwectlError):
    """A TrainBatch cannot be written to or read from shared memory (missing segment, bytes out of range, a
    frame replaced before it was read, not a batch); the message names the segment."""


# ------------------------------------------------------------ engines (raised by swectl.engine.client)

BODY_QUOTE_CHARS = 300


def quote_body(body: bytes | str) -> str:
    """The first BODY_QUOTE_CHARS characters of a response body, for error messages."""
    text = body.decode("utf-8", errors="replace") if isinstance(body, bytes) else body
    shown = text[:BODY_QUOTE_CHARS]
    return repr(shown) + (f" (+{len(text) - BODY_QUOTE_CHARS} chars)" if len(text) > BODY_QUOTE_CHARS else "")


class EngineError(InfraError):
    """An inference engine failed; ``url`` is the engine's."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(f"engine {url}: {message}")
        self.url = url


class EngineUnavailableError(EngineError):
    """The engine could not be reached or failed on its side; trying again later may work."""


class EngineConnectError(EngineUnavailableError):
    """Nothing accepted the connection: refused (no server on that port), unknown host, network unreachable."""


class EngineTimeoutError(EngineUnavailableError):
    """No complete answer within the call's time bound (``timeout_s``)."""

    def __init__(self, url: str, message: str, timeout_s: float) -> None:
        super().__init__(url, message)
        self.timeout_s = timeout_s


class EngineResponseError(EngineError):
    """The engine answered, but not in the protocol; carries the start of the body."""

    def __init__(self, url: str, message: str, body: bytes | str) -> None:
        super().__init__(url, f"{message}; body: {quote_body(body)}")
        self.body_head = (body.decode("utf-8", errors="replace") if isinstance(body, bytes) else body)[
            :BODY_QUOTE_CHARS
        ]


class EngineRejectedError(EngineError):
    """The engine refused the request (bad input, auth, a weight update that failed on its side)."""

    def __init__(self, url: str, message: str, status: int, detail: str) -> None:
        super().__init__(url, f"{message} (HTTP {status}): {detail}")
        self.status = status
        self.detail = detail
