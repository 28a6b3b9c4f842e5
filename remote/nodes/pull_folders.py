"""Where a podman pull keeps its downloads, and the removal of those a stopped pull left.

Measured with podman 4.3: a pull stopped by any signal (INT, TERM, HUP, KILL; or its SSH session gone) leaves the
layers it was downloading in its temporary folder, never reused and never removed (the layers it had already
committed stay in the store, without an image, and a later pull reuses them). So each pull runs with a temporary
folder of its own (``TMPDIR``, ``swectl-pull.*`` under the node's ``$TMPDIR`` or ``/var/tmp``), locked (``flock``)
while the pull runs and removed when podman ends; a sweep removes the unlocked ones, the downloads of pulls that
were stopped. Without ``flock`` on the node, pulls use podman's own folder and a sweep finds nothing.

Plain shell, run on the node through the Node protocol (local or SSH alike).
"""

from __future__ import annotations

from swectl.remote.nodes.node import Node

# sh -c PULL_SCRIPT swectl-pull PULL-ARGV...: the pull in a locked temporary folder of its own, removed after.
# The lock file is renamed into place only once locked, so a sweep never sees an unlocked one of a live pull.
PULL_SCRIPT = r"""
command -v flock >/dev/null 2>&1 || exec "$@"
d=$(mktemp -d "${TMPDIR:-/var/tmp}/swectl-pull.XXXXXX") || exit 125
exec 9>"$d/lock.new" && flock 9 && mv "$d/lock.new" "$d/lock" || { rm -rf "$d"; exit 125; }
TMPDIR="$d" "$@"
code=$?
rm -rf "$d"
exit "$code"
"""
# sh -c SWEEP_SCRIPT swectl-sweep [ROOT]: remove the folders of pulls that were stopped (unlocked; one without its lock
# file only when an hour old); prints how many and their KB.
SWEEP_SCRIPT = r"""
command -v flock >/dev/null 2>&1 || { echo "0 0"; exit 0; }
root="${1:-${TMPDIR:-/var/tmp}}"
n=0
kb=0
for d in "$root"/swectl-pull.*; do
  [ -d "$d" ] || continue
  size=$(du -sk "$d" 2>/dev/null | cut -f1)
  if [ -e "$d/lock" ]; then
    flock -n "$d/lock" rm -rf "$d" || continue
  elif [ -n "$(find "$d" -maxdepth 0 -mmin +60)" ]; then
    rm -rf "$d"
  else
    continue
  fi
  n=$((n + 1))
  kb=$((kb + ${size:-0}))
done
echo "$n $kb"
"""


def in_own_folder(argv: list[str]) -> list[str]:
    """The command line that runs the pull ``argv`` in a locked temporary folder of its own."""
    return ["sh", "-c", PULL_SCRIPT, "swectl-pull", *argv]


async def sweep(node: Node, root: str = "") -> tuple[int, int]:
    """Remove the folders stopped pulls left on ``node`` under ``root`` (default: the node's ``$TMPDIR`` or
    /var/tmp): (folders removed, their KB); (0, 0) when the node cannot say."""
    out = await node.run(["sh", "-c", SWEEP_SCRIPT, "swectl-sweep", *([root] if root else [])])
    parts = out.stdout.decode(errors="replace").split()
    if out.exit_code != 0 or len(parts) != 2 or not all(p.isdigit() for p in parts):
        return 0, 0
    return int(parts[0]), int(parts[1])
