"""Build the sandbox backend for each configured node (the plug-in seam's factory)."""

from __future__ import annotations

from collections.abc import Sequence

from swectl.config import ClusterConfig, LocalNodeConfig, NodeConfig, SshNodeConfig
from swectl.remote.nodes.node import LocalNode, Node
from swectl.remote.nodes.podman_sandbox import PodmanBackend
from swectl.remote.nodes.ssh import SshNode
from swectl.sandbox import SandboxBackend

BACKENDS = ("podman",)


def make_node(config: NodeConfig) -> Node:
    match config:
        case LocalNodeConfig():
            return LocalNode(config.name)
        case SshNodeConfig():
            return SshNode(config)


def make_backends(config: ClusterConfig) -> list[tuple[NodeConfig, PodmanBackend]]:
    if config.sandbox.backend not in BACKENDS:
        raise ValueError(f"sandbox.backend: unknown backend {config.sandbox.backend!r}; valid: {BACKENDS}")
    return [
        (node, PodmanBackend(make_node(node), config.sandbox, node.containers_conf))
        for node in config.sandbox_nodes()
    ]


async def close_backends(backends: Sequence[tuple[NodeConfig, SandboxBackend]]) -> None:
    for _, backend in backends:
        await backend.aclose()
