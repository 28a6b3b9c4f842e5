"""What the env pool knows of one node's images: which it holds, when each was last leased, the one transfer (a pull
or a removal) of each image in flight there, pulls that failed lately, and the order in which images go when the
node is over its disk budget.

Bookkeeping only, no I/O (the node's store is swectl/images/store.py, the env pool does the calls): the pool lists
a node's images when the node joins or rejoins (``reset``), and updates them as its pulls and removals end. Images are
keyed by ``image_key`` (the name as podman lists it), so ``swebench/x`` and ``docker.io/swebench/x:latest`` are one.

Eviction order (``eviction_order``): least recently leased first (an image listed at the start and never leased
since counts as leased at time 0; ties by name), never one in ``protected`` (the pool passes the images of live
sandboxes and pending leases, its ``sandbox.image``, and those with a transfer in flight).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, field
from typing import Literal

import anyio

from swectl.errors import InfraError
from swectl.images.registry import normal_name


def image_key(image: str) -> str:
    """``image`` as a node's store lists it: qualified, tagged; a bare local name is ``localhost/NAME``."""
    name = normal_name(image)
    return name if "/" in name.split("@", 1)[0] else f"localhost/{name}"


def eviction_order(last_used: Mapping[str, float], protected: Set[str]) -> list[str]:
    """The images of ``last_used`` (image -> when last leased) that may go, least recently leased first."""
    return sorted((i for i in last_used if i not in protected), key=lambda i: (last_used[i], i))


@dataclass(eq=False)
class Transfer:
    """One pull or removal of one image on one node; ``done`` is set when it ends, with ``error`` when it failed."""

    image: str  # its key (image_key)
    kind: Literal["pull", "remove"]
    requested: str = ""  # the name it was asked for (what podman is given)
    done: anyio.Event = field(default_factory=anyio.Event)
    pulled: bool = False  # a pull that moved the image (not one that found it already there)
    error: InfraError | None = None


class NodeImages:
    """One node's images as the pool knows them (see the module docstring)."""

    def __init__(self) -> None:
        self.known = False  # listed since the node last (re)joined; unknown: every image may be there
        self._last_used: dict[str, float] = {}  # present image -> when last leased (0: not since the pool started)
        self.transfers: dict[str, Transfer] = {}
        self._failed: dict[str, tuple[float, InfraError]] = {}  # image -> (when, why) of its last failed pull
        self.disk_bytes: int | None = None  # what its images take, as last measured (with a budget only)
        self.over_budget_said = False  # the "over budget, nothing may go" warning was given since it last fit

    def reset(self, names: Iterable[str]) -> None:
        """The node's listing: these images are present (each keeps its last use if it had one)."""
        keys = {image_key(n) for n in names}
        self._last_used = {k: self._last_used.get(k, 0.0) for k in keys}
        self._failed.clear()
        self.known = True

    def holds(self, image: str) -> bool | None:
        """Whether the node holds ``image``; None when its images are not known (and no pull has found it since)."""
        if image_key(image) in self._last_used:
            return True
        return False if self.known else None

    @property
    def present(self) -> list[str]:
        return sorted(self._last_used)

    def pulls(self) -> int:
        """Pulls in flight on the node."""
        return sum(t.kind == "pull" for t in self.transfers.values())

    def transfer(self, image: str) -> Transfer | None:
        return self.transfers.get(image_key(image))

    def begin(self, image: str, kind: Literal["pull", "remove"]) -> Transfer:
        """Register the one transfer of ``image`` on the node (none may be in flight). A removal takes the image
        out of the present ones at once, so nothing is placed on it meanwhile."""
        key = image_key(image)
        assert key not in self.transfers, f"a transfer of {key} is in flight already"
        self.transfers[key] = transfer = Transfer(image=key, kind=kind, requested=image)
        if kind == "remove":
            self._last_used.pop(key, None)
        return transfer

    def end(self, transfer: Transfer, now: float, *, present: bool) -> None:
        """``transfer`` ended: the image is present (``present``) or not; its waiters wake up."""
        self.transfers.pop(transfer.image, None)
        if present:
            self._last_used[transfer.image] = max(self._last_used.get(transfer.image, 0.0), now)
            self._failed.pop(transfer.image, None)
        else:
            self._last_used.pop(transfer.image, None)
            if transfer.kind == "pull" and transfer.error is not None:
                self._failed[transfer.image] = (now, transfer.error)
        transfer.done.set()

    def recent_failure(self, image: str, now: float, within_s: float) -> InfraError | None:
        """The error of ``image``'s last pull on the node if it failed less than ``within_s`` ago."""
        failed = self._failed.get(image_key(image))
        return failed[1] if failed is not None and now - failed[0] < within_s else None

    def touch(self, image: str, now: float) -> None:
        """``image`` was leased (or given back) at ``now``."""
        key = image_key(image)
        if key in self._last_used:
            self._last_used[key] = max(self._last_used[key], now)

    def eviction_order(self, protected: Set[str]) -> list[str]:
        return eviction_order(self._last_used, {image_key(p) for p in protected} | set(self.transfers))
