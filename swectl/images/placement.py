"""Which node a new sandbox goes to, knowing where its image is: the env pool's placement rule, pure.

In this order:

1. a node that holds the image (or whose images are not known) and may start a sandbox now, least loaded;
2. a node pulling the image with room for one more sandbox: the lease waits for that pull (never a second pull of
   one image on one node);
3. none (wait) while a node that holds the image has room and is only at its cap of starts: a start slot frees
   within a sandbox start, a pull elsewhere costs far more;
4. a node that lacks the image and may start now, least loaded: the lease pulls the image there first.

Load is a node's slots in use (starting, waiting for a pull, leased, warm) plus its pulls in flight, over its
``max_running``: a node busy pulling is less attractive for work that must pull too.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec


class NodeView(msgspec.Struct, frozen=True, kw_only=True):
    """One node as the placement sees it, for one image."""

    healthy: bool
    holds: bool | None  # the node holds the image; None: its images are not known
    pulling: bool  # a pull of the image is in flight there
    starting: int  # sandboxes being started
    max_starting: int
    used: int  # slots in use: starting, waiting for a pull, leased, warm
    max_running: int
    pulls: int = 0  # pulls in flight there, of any image

    @property
    def load(self) -> float:
        return (self.used + self.pulls) / self.max_running

    @property
    def has_room(self) -> bool:
        return self.healthy and self.used < self.max_running

    @property
    def can_start(self) -> bool:
        return self.has_room and self.starting < self.max_starting


def choose_node(nodes: Sequence[NodeView]) -> int | None:
    """The index of the node to use (see the module docstring), or None: wait for a change."""
    def least_loaded(indexes: list[int]) -> int | None:
        return min(indexes, key=lambda i: (nodes[i].load, i)) if indexes else None

    ready = [i for i, n in enumerate(nodes) if n.holds is not False and n.can_start]
    if ready:
        return least_loaded(ready)
    joining = [i for i, n in enumerate(nodes) if n.pulling and n.has_room]
    if joining:
        return least_loaded(joining)
    if any(n.holds and n.has_room for n in nodes):
        return None
    return least_loaded([i for i, n in enumerate(nodes) if n.holds is False and not n.pulling and n.can_start])
