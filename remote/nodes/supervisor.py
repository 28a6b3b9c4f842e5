"""The ``sh`` supervisor every long-lived server or worker runs under on a node (engines, trainer ranks).

Started through the node's ``spawn`` (a child process here, an SSH channel on an ssh node) as
``sh -c SUPERVISOR NAME ARGV...``. Its stdin: first line an API key (may be empty; exported as
``$SWECTL_ENGINE_API_KEY`` and substituted for API_KEY_PLACEHOLDER in argv, so it never appears on an SSH
command line), then held open. It merges the program's stdout and stderr into the pipe the controller reads,
prints ``swectl-engine pid N`` and ``swectl-engine exit N``, and kills the program and its process group (TERM,
then KILL after STOP_GRACE_S) when its stdin closes, and whatever the group left behind when the program exits:
when the controller stops it, dies, or loses the SSH connection, nothing is left running on the node. A guard
kills the program's group when the supervisor itself dies (``kill -9`` of the shell), so a server never goes on as
an orphan the controller no longer watches: its output pipe closes and the controller sees the server gone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import anyio

from swectl.remote.nodes.node import NodeProcess

API_KEY_PLACEHOLDER = "@SWECTL_ENGINE_API_KEY@"
STOP_GRACE_S = 10  # TERM, then KILL this long after
GUARD_POLL_S = 1  # how often the guard looks whether the supervisor is still alive

# argv: the program's command line. stdin: first line the API key (may be empty), then held open; EOF = stop.
SUPERVISOR = r"""
exec 2>&1
IFS= read -r key || key=""
if [ -n "$key" ]; then export SWECTL_ENGINE_API_KEY="$key"; fi
for arg in "$@"; do
  shift
  if [ "$arg" = "@SWECTL_ENGINE_API_KEY@" ]; then arg="$key"; fi
  set -- "$@" "$arg"
done
export PYTHONUNBUFFERED=1
exec 3<&0
# The program leads a process group of its own (setsid execs it in place: same pid), so stopping it stops what it
# started too (vLLM's engine core and workers, torchrun's ranks); without setsid only the program is signalled.
if command -v setsid >/dev/null 2>&1; then group=-; setsid "$@" </dev/null 3<&- & else group=; "$@" </dev/null 3<&- & fi
pid=$!
echo "swectl-engine pid $pid"
( cat <&3 >/dev/null; kill -TERM "$group$pid" 2>/dev/null; sleep GRACE
  kill -KILL "$group$pid" 2>/dev/null ) >/dev/null 2>&1 &
watcher=$!
exec 3<&-
# The program never outlives this supervisor: should it die (kill -9), the guard kills the program's group within a
# second, the pipe to the controller closes, and the controller restarts the server as it does after a crash.
sup=$$
( while kill -0 "$sup" 2>/dev/null; do sleep GUARD; done; kill -KILL "$group$pid" ) </dev/null >/dev/null 2>&1 &
guard=$!
wait "$pid"
code=$?
echo "swectl-engine exit $code"
# what the program left running when it died (killed before it could stop its children)
[ -n "$group" ] && kill -KILL "$group$pid" 2>/dev/null
kill "$watcher" "$guard" 2>/dev/null
exit "$code"
""".replace("GRACE", str(STOP_GRACE_S)).replace("GUARD", str(GUARD_POLL_S))


async def copy_output(proc: NodeProcess, log_path: Path | None, on_line: Callable[[str], None]) -> None:
    """Copy a supervised program's output to ``log_path`` (appended, flushed per chunk) and hand each complete line
    to ``on_line`` until the channel closes. A line that never ends does not grow without bound."""
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") if log_path is not None else contextlib.nullcontext() as log:
        pending = b""
        while chunk := await proc.receive():
            if log is not None:
                log.write(chunk)
                log.flush()
            *lines, pending = (pending + chunk).split(b"\n")
            pending = pending[-65536:]
            for raw in lines:
                on_line(raw.decode(errors="replace").rstrip("\r"))


async def stop_supervised(proc: NodeProcess) -> None:
    """Close the supervisor's stdin (it stops the program: TERM, then KILL), wait for it, close the channel."""
    with contextlib.suppress(BrokenPipeError, OSError):
        await proc.close_input()
    with anyio.move_on_after(STOP_GRACE_S + 5):
        await proc.wait()
    await proc.aclose()
