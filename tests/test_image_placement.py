"""Where images are, as the env pool uses it (swectl/images/placement.py, swectl/images/presence.py), pure: the
placement rule (a node that holds the image first, then joining a pull in flight, waiting for a holder that is only
at its start cap, pulling on the least-loaded node last), the eviction order (least recently leased first, never an
image in use or in transfer) and a node's image bookkeeping."""

from __future__ import annotations

import anyio
import pytest

from swectl.errors import InfraError
from swectl.images.placement import NodeView, choose_node
from swectl.images.presence import NodeImages, eviction_order, image_key


def node(*, holds: bool | None = False, pulling: bool = False, starting: int = 0, used: int = 0, pulls: int = 0,
         healthy: bool = True, max_starting: int = 2, max_running: int = 10) -> NodeView:
    return NodeView(healthy=healthy, holds=holds, pulling=pulling, starting=starting, max_starting=max_starting,
                    used=used, max_running=max_running, pulls=pulls)


# ------------------------------------------------------------------------------------------- placement


def test_a_node_that_holds_the_image_wins_over_a_less_loaded_one_that_lacks_it() -> None:
    assert choose_node([node(holds=False, used=0), node(holds=True, used=7)]) == 1


def test_among_holders_the_least_loaded_wins_and_pulls_count_in_the_load() -> None:
    assert choose_node([node(holds=True, used=3), node(holds=True, used=2)]) == 1
    assert choose_node([node(holds=True, used=3), node(holds=True, used=2, pulls=2)]) == 0


def test_a_lease_joins_the_pull_in_flight_rather_than_starting_another() -> None:
    # the pulling node is at its start cap: waiting for its pull needs no start slot
    assert choose_node([node(holds=False, used=0), node(holds=False, pulling=True, starting=2, used=5)]) == 1


def test_a_holder_only_at_its_start_cap_is_waited_for_not_pulled_around() -> None:
    assert choose_node([node(holds=False), node(holds=True, starting=2, used=2)]) is None


def test_a_full_holder_sends_the_lease_to_pull_on_the_least_loaded_other_node() -> None:
    nodes = [node(holds=True, used=10), node(holds=False, used=4), node(holds=False, used=1, pulls=1),
             node(holds=False, used=1)]
    assert choose_node(nodes) == 3


def test_nobody_has_it_the_least_loaded_node_pulls_and_unhealthy_or_full_nodes_never_get_it() -> None:
    assert choose_node([node(used=5), node(used=2)]) == 1
    assert choose_node([node(healthy=False), node(used=10), node(starting=2, used=2)]) is None


def test_nodes_whose_images_are_not_known_are_placed_on_as_before() -> None:
    # no store (Docker) or no listing: the least-loaded node that may start, as without image knowledge
    assert choose_node([node(holds=None, used=3), node(holds=None, used=1)]) == 1
    assert choose_node([node(holds=None, starting=2, used=2)]) is None


# ------------------------------------------------------------------------------------------- eviction order


def test_eviction_goes_least_recently_leased_first_never_listed_and_unused_before_used() -> None:
    last_used = {"a": 30.0, "b": 10.0, "c": 0.0, "d": 20.0, "e": 0.0}
    assert eviction_order(last_used, set()) == ["c", "e", "b", "d", "a"]


def test_eviction_never_picks_a_protected_image() -> None:
    last_used = {"a": 30.0, "b": 10.0, "c": 0.0}
    assert eviction_order(last_used, {"c", "b"}) == ["a"]
    assert eviction_order(last_used, {"a", "b", "c"}) == []


def test_image_keys_are_the_names_a_store_lists() -> None:
    assert image_key("swebench/sweb.eval.x") == "docker.io/swebench/sweb.eval.x:latest"
    assert image_key("localhost/swectl-base:bookworm") == "localhost/swectl-base:bookworm"
    assert image_key("swectl-base:bookworm") == "localhost/swectl-base:bookworm"
    assert image_key("10.0.0.5:5000/x/y") == "10.0.0.5:5000/x/y:latest"


# ------------------------------------------------------------------------------------------- a node's images


def test_node_images_track_presence_uses_and_transfers() -> None:
    async def main() -> None:
        images = NodeImages()
        assert images.holds("a") is None  # not listed yet
        images.reset(["localhost/a:latest", "localhost/b:latest"])
        assert images.holds("localhost/a") is True and images.holds("localhost/c") is False
        images.touch("localhost/a", 5.0)
        # b was never leased: it goes first; a transfer in flight or a protected image never goes
        assert images.eviction_order(set()) == ["localhost/b:latest", "localhost/a:latest"]
        assert images.eviction_order({"localhost/b"}) == ["localhost/a:latest"]

        pull = images.begin("localhost/c", "pull")
        assert images.transfer("localhost/c:latest") is pull and images.pulls() == 1
        with pytest.raises(AssertionError):
            images.begin("localhost/c", "pull")  # one transfer per (node, image)
        images.end(pull, 9.0, present=True)
        assert pull.done.is_set() and images.holds("localhost/c") and images.pulls() == 0
        assert images.eviction_order(set())[-1] == "localhost/c:latest"  # a fresh pull counts as a use

        removal = images.begin("localhost/b", "remove")
        assert images.holds("localhost/b") is False  # nothing is placed on it while it goes
        assert "localhost/b:latest" not in images.eviction_order(set())
        images.end(removal, 10.0, present=False)
        assert images.present == ["localhost/a:latest", "localhost/c:latest"]

        failed = images.begin("localhost/d", "pull")
        failed.error = InfraError("manifest unknown")
        images.end(failed, 20.0, present=False)
        assert str(images.recent_failure("localhost/d", 25.0, 30.0)) == "manifest unknown"
        assert images.recent_failure("localhost/d", 51.0, 30.0) is None

        images.reset(["localhost/a:latest"])  # a rejoin: the listing wins, known uses stay
        assert images.present == ["localhost/a:latest"]
        assert images.eviction_order(set()) == ["localhost/a:latest"]

    anyio.run(main)
