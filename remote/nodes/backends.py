"""Build the sandbox backend for each configured node (the plug-in seam's factory)."""

from __future__ import annotations

from collections.abc import Sequence

from swectl.config import ClusterConfig, LocalNodeConfig, NodeConfig, SshNodeConfig
from swectl.remote.nodes.docker_sandbox import DockerBackend
from swectl.remote.nodes.namespace_sandbox import NamespaceBackend
from swectl.remote.nodes.node import LocalNode, Node
from swectl.remote.nodes.podman_sandbox import PodmanBackend
from swectl.remote.nodes.ssh import SshNode
from swectl.sandbox import SandboxBackend

BACKENDS = ("podman", "namespace", "docker")
AnyBackend = PodmanBackend | NamespaceBackend | DockerBackend
# the backends whose node keeps an image store its sandboxes start from (``backend.cli``: podman's or dockerd's; the
# namespace backend unpacks podman's images); every backend today, a future one need not be
IMAGE_STORE_BACKENDS = (PodmanBackend, NamespaceBackend, DockerBackend)


def make_node(config: NodeConfig) -> Node:
    match config:
        case LocalNodeConfig():
            return LocalNode(config.name)
        case SshNodeConfig():
            return SshNode(config)


def make_backend(node: NodeConfig, config: ClusterConfig) -> AnyBackend:
    match config.sandbox.backend:
        case "podman":
            return PodmanBackend(make_node(node), config.sandbox, node.containers_conf)
        case "namespace":
            return NamespaceBackend(make_node(node), config.sandbox, node.containers_conf)
        case "docker":
            return DockerBackend(make_node(node), config.sandbox)
    raise ValueError(f"sandbox.backend: unknown backend {config.sandbox.backend!r}; valid: {BACKENDS}")


def make_backends(config: ClusterConfig) -> list[tuple[NodeConfig, AnyBackend]]:
    return [(node, make_backend(node, config)) for node in config.sandbox_nodes()]


def namespace_probe(node: Node, config: ClusterConfig) -> NamespaceBackend:
    """A namespace backend on ``node``, only to ask whether the node could run namespace sandboxes (`check()`),
    whatever backend the run uses."""
    return NamespaceBackend(node, config.sandbox)


async def close_backends(backends: Sequence[tuple[NodeConfig, SandboxBackend]]) -> None:
    for _, backend in backends:
        await backend.aclose()
