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


def make_node(config: NodeConfig) -> Node:
    match config:
        case LocalNodeConfig():
            return LocalNode(config.name)
        case SshNodeConfig():
            return SshNode(config)


def make_backend(node: NodeConfig, config: ClusterConfig) -> PodmanBackend | NamespaceBackend | DockerBackend:
    match config.sandbox.backend:
        case "podman":
            return PodmanBackend(make_node(node), config.sandbox, node.containers_conf)
        case "namespace":
            return NamespaceBackend(make_node(node), config.sandbox, node.containers_conf)
        case "docker":
            return DockerBackend(make_node(node), config.sandbox)
    raise ValueError(f"sandbox.backend: unknown backend {config.sandbox.backend!r}; valid: {BACKENDS}")


def make_backends(config: ClusterConfig) -> list[tuple[NodeConfig, PodmanBackend | NamespaceBackend | DockerBackend]]:
    return [(node, make_backend(node, config)) for node in config.sandbox_nodes()]


async def close_backends(backends: Sequence[tuple[NodeConfig, SandboxBackend]]) -> None:
    for _, backend in backends:
        await backend.aclose()
