"""Task sources: read rows from a file or a Hugging Face dataset and normalise every row style into ``Task``.

Two layers, kept apart:

- reading rows (``read_rows``): ``.jsonl`` / ``.jsonl.gz`` (location ``file:LINE``), ``.json`` / ``.json.gz``
  (an array, or an object with a "rows" or "instances" list; location ``file[INDEX]``), ``.parquet``
  (``file[ROW]``), or a Hugging Face dataset ``owner/name[:split]`` (``owner/name:split[INDEX]``);
- normalising one row (``normalise_row``, pure): classic SWE-bench (test lists as lists or JSON strings),
  SWE-bench 5.x rows that carry image / eval_script / log_parser, SWE-Gym, SWE-smith (``patch`` there is the
  bug-introducing diff: it becomes ``setup_patch`` and its reverse becomes the fix) and swectl factory rows.

A malformed row becomes a ``RowProblem`` (location, field, message) and is skipped; ``strict=True`` raises the
first one as ``TaskDataError``. Nothing is dropped silently.
"""

from __future__ import annotations

import datetime as dt
import difflib
import functools
import gzip
import json
import logging
import os
import re
import socket
import threading
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, get_args

import msgspec

from swectl.errors import TaskDataError
from swectl.tasks.diffs import DiffError, reverse_diff
from swectl.tasks.harbor import HarborTaskError, is_harbor_dir, read_task, task_folders
from swectl.tasks.record import Task, TaskSource

TASK_SOURCES: tuple[str, ...] = get_args(TaskSource)
_NEWLINE = b"\n"
_log = logging.getLogger(__name__)
ROW = "(row)"  # the `field` of a problem with the row as a whole (bad JSON, not an object)
HUB_PROBE_TIMEOUT_S = 5.0

# The 11 repositories of SWE-Gym (SWE-Gym/SWE-Gym on Hugging Face); none of them is in SWE-bench.
SWE_GYM_REPOS = frozenset(
    {
        "getmoto/moto",
        "Project-MONAI/MONAI",
        "pandas-dev/pandas",
        "python/mypy",
        "dask/dask",
        "iterative/dvc",
        "conan-io/conan",
        "pydantic/pydantic",
        "facebookresearch/hydra",
        "bokeh/bokeh",
        "modin-project/modin",
    }
)

_REQUIRED_STR = ("instance_id", "repo", "problem_statement")
_NON_EMPTY = ("instance_id", "repo")
_OPTIONAL_STR = (
    "base_commit",
    "patch",
    "test_patch",
    "version",
    "environment_setup_commit",
    "hints_text",
    "created_at",
    "image",
    "eval_script",
    "log_parser",
    "setup_patch",
)
_EVAL_TYPES = ("pass_and_fail", "fail_only", "reward")  # reward: a Harbor task's reward file
_HF_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(?::[\w.-]+)?$")
_FILE_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet")


class RowProblem(msgspec.Struct, frozen=True):
    """Why one row was not loaded: where (``tasks.jsonl:17``), which field, and what was expected."""

    location: str
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.location}: {self.field}: {self.message}"


class RowProblemError(TaskDataError):
    """A malformed row; ``problem`` says where and why."""

    def __init__(self, problem: RowProblem, hint: str = "") -> None:
        super().__init__(str(problem) + (f"\n  hint: {hint}" if hint else ""))
        self.problem = problem


class LoadResult(msgspec.Struct):
    """The tasks read from a source, the rows that were rejected (with where and why) and counts."""
    tasks: list[Task]
    problems: list[RowProblem]
    rows_read: int = 0
    source: str = ""


ProblemCallback = Callable[[RowProblem], None]


def load_tasks(
    source: str | os.PathLike[str],
    *,
    strict: bool = False,
    split: str = "test",
    on_problem: ProblemCallback | None = None,
    source_hint: TaskSource | None = None,
) -> LoadResult:
    """Read and normalise every row of ``source``; bad rows and duplicate instance_ids become problems.

    ``on_problem`` sees each problem as it is found. ``strict`` raises the first one (a ``RowProblemError``).
    ``source_hint`` names the row style for rows that do not say it themselves (a row's ``source`` wins).
    """
    if source_hint is not None and source_hint not in TASK_SOURCES:
        raise TaskDataError(f"source hint {source_hint!r}: expected one of {', '.join(TASK_SOURCES)}")
    result = LoadResult(tasks=[], problems=[], source=str(source))
    if is_harbor_dir(Path(source)):
        return _harbor_tasks(Path(source), result, strict=strict, on_problem=on_problem)
    first_seen: dict[str, str] = {}
    for location, row in read_rows(source, split=split):
        result.rows_read += 1
        try:
            if isinstance(row, RowProblem):
                raise RowProblemError(row)
            task = normalise_row(row, location, source_hint)
            if task.instance_id in first_seen:
                message = f"duplicate instance_id {task.instance_id!r} (first seen at {first_seen[task.instance_id]})"
                raise RowProblemError(RowProblem(location, "instance_id", message))
        except RowProblemError as exc:
            if on_problem is not None:
                on_problem(exc.problem)
            if strict:
                hint = "fix the row, or load without strict mode to skip bad rows and list them"
                raise RowProblemError(exc.problem, hint) from None
            result.problems.append(exc.problem)
            _log.info("skipped row %s", exc.problem)
            continue
        first_seen[task.instance_id] = location
        result.tasks.append(task)
    return result


def _harbor_tasks(folder: Path, result: LoadResult, *, strict: bool, on_problem: ProblemCallback | None) -> LoadResult:
    """A folder of Harbor task folders (or one): each a Task, or a problem naming the folder (swectl.tasks.harbor).
    Their images are built, and their gold patches made, by swectl.images.harbor.prepare_harbor_tasks."""
    for task_folder in task_folders(folder):
        result.rows_read += 1
        try:
            result.tasks.append(read_task(task_folder))
        except HarborTaskError as exc:
            problem = RowProblem(str(task_folder), "task", str(exc))
            if on_problem is not None:
                on_problem(problem)
            if strict:
                raise RowProblemError(problem, "fix the task folder, or load without strict mode to skip it") from None
            result.problems.append(problem)
    return result


# ---------------------------------------------------------------------------------------------- reading rows

RawRow = tuple[str, Any]  # (location, decoded row or a RowProblem for a line that could not be decoded)


def read_rows(source: str | os.PathLike[str], *, split: str = "test") -> Iterator[RawRow]:
    """Yield ``(location, row)`` for every row of a file or a Hugging Face dataset, in order."""
    path = Path(source)
    if path.is_dir():
        raise TaskDataError(f"{source}: is a directory and holds no Harbor task folders (task.toml); pass one .jsonl, "
                            ".json or .parquet file, or a folder of Harbor tasks")
    if path.exists():
        return _file_rows(path, str(source))
    text = str(source)
    if _HF_NAME.match(text) and not text.lower().endswith(_FILE_SUFFIXES):
        name, _, explicit_split = text.partition(":")
        return _hub_rows(name, explicit_split or split)
    raise TaskDataError(
        f"{source}: no such file\n  hint: pass a .jsonl, .json or .parquet file, "
        "or a Hugging Face dataset name like owner/name or owner/name:split"
    )


def _file_rows(path: Path, shown: str) -> Iterator[RawRow]:
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz", ".ndjson")):
        return _jsonl_rows(path, shown)
    if name.endswith((".json", ".json.gz")):
        return _json_rows(path, shown)
    if name.endswith(".parquet"):
        return _parquet_rows(path, shown)
    raise TaskDataError(f"{shown}: unknown file type; expected .jsonl, .jsonl.gz, .json, .json.gz or .parquet")


def _open(path: Path) -> IO[bytes]:
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else path.open("rb")


def _jsonl_rows(path: Path, shown: str) -> Iterator[RawRow]:
    return ((location, row) for location, _, row in jsonl_lines(path, shown))


def jsonl_lines(path: Path, shown: str = "") -> Iterator[tuple[str, int, Any]]:
    """``(location, line number, decoded row or a RowProblem)`` for every non-blank line of a JSONL file (``.gz``
    read through gzip, a UTF-8 byte-order mark ignored); the one JSONL reader of task files and SFT data. A file
    that cannot be read raises TaskDataError; ``shown`` names it in locations (default: its path)."""
    shown = shown or str(path)
    try:
        with _open(path) as stream:
            for number, raw in enumerate(stream, start=1):
                if number == 1:
                    raw = raw.removeprefix(b"\xef\xbb\xbf")
                if not raw.strip():
                    continue
                location = f"{shown}:{number}"
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    yield location, number, RowProblem(location, ROW, f"not UTF-8 (byte {exc.start}: "
                                                       f"{raw[exc.start:exc.start + 1]!r})")
                    continue
                try:
                    yield location, number, msgspec.json.decode(text)
                except msgspec.DecodeError:
                    # msgspec refuses lone surrogate escapes ("\\ud800") as "truncated": the standard library
                    # decodes them (the content checks then name the field) and says where real errors are
                    try:
                        yield location, number, json.loads(text)
                    except ValueError as exc:
                        yield location, number, RowProblem(location, ROW, f"not valid JSON ({exc})")
    except (OSError, EOFError) as exc:
        raise TaskDataError(f"{shown}: cannot read: {exc}") from exc


def _json_rows(path: Path, shown: str) -> Iterator[RawRow]:
    try:
        with _open(path) as stream:
            data = stream.read()
    except (OSError, EOFError) as exc:
        raise TaskDataError(f"{shown}: cannot read: {exc}") from exc
    try:
        document = msgspec.json.decode(data.removeprefix(b"\xef\xbb\xbf"))
    except msgspec.DecodeError as exc:
        raise TaskDataError(f"{shown}{_json_error_line(data, str(exc))}: not valid JSON ({exc})") from exc
    if isinstance(document, list):
        yield from ((f"{shown}[{i}]", row) for i, row in enumerate(document))
        return
    if isinstance(document, dict):
        for key in ("rows", "instances"):
            if isinstance(document.get(key), list):
                yield from ((f"{shown}:{key}[{i}]", row) for i, row in enumerate(document[key]))
                return
        if "instance_id" in document:  # a file holding a single row
            yield f"{shown}[0]", document
            return
    raise TaskDataError(
        f'{shown}: expected a JSON array of rows, or an object with a "rows" or "instances" list; got {_kind(document)}'
    )


def _json_error_line(data: bytes, message: str) -> str:
    """``:LINE`` for msgspec's "(byte N)" in a decode error, else nothing."""
    found = re.search(r"byte (\d+)", message)
    if not found:
        return ""
    return f":{data[: int(found.group(1))].count(_NEWLINE) + 1}"


def _parquet_rows(path: Path, shown: str) -> Iterator[RawRow]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise TaskDataError(f"{shown}: reading parquet needs pyarrow (pip install pyarrow)") from exc
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=256)
        index = 0
        for batch in batches:
            for row in batch.to_pylist():
                yield f"{shown}[{index}]", row
                index += 1
    except (OSError, ValueError) as exc:  # pyarrow.ArrowInvalid is a ValueError
        raise TaskDataError(f"{shown}: cannot read parquet: {exc}") from exc


def _hub_rows(name: str, split: str) -> Iterator[RawRow]:
    try:
        import datasets
    except ImportError as exc:
        raise TaskDataError(
            f"{name}: looks like a Hugging Face dataset name, but the `datasets` package is not installed\n"
            "  hint: pip install datasets, or pass a local .jsonl, .json or .parquet file"
        ) from exc
    offline = _env_true("HF_HUB_OFFLINE") or _env_true("HF_DATASETS_OFFLINE")
    host, port = _hub_address()
    if not offline and not _proxy_configured() and not _hub_reachable(host, port):
        raise TaskDataError(
            f"{name}: could not reach the Hugging Face Hub ({host}:{port}) within {HUB_PROBE_TIMEOUT_S:g}s\n"
            "  hint: download the dataset where the Hub is reachable and pass the local file (.jsonl, .json or "
            ".parquet), or set HF_HUB_OFFLINE=1 to use a copy already in the Hugging Face cache"
        )
    try:
        dataset = datasets.load_dataset(name, split=split)
    except Exception as exc:  # datasets raises many unrelated types (ConnectionError, ValueError, FileNotFound...)
        raise TaskDataError(_hub_failure(name, split, exc, offline)) from exc
    for index, row in enumerate(dataset):
        yield f"{name}:{split}[{index}]", dict(row)


def _hub_failure(name: str, split: str, exc: Exception, offline: bool) -> str:
    if offline and isinstance(exc, ConnectionError):
        return (
            f"{name}: not in the local Hugging Face cache, and HF_HUB_OFFLINE / HF_DATASETS_OFFLINE forbid the Hub "
            f"({exc})\n  hint: pass a local .jsonl, .json or .parquet file, or unset the offline variable"
        )
    if isinstance(exc, ConnectionError):
        return (
            f"{name}: could not reach the Hugging Face Hub ({exc})\n"
            "  hint: pass a local .jsonl, .json or .parquet file instead"
        )
    if "split" in str(exc).lower():
        return f"{name}: no split {split!r} ({exc})\n  hint: name the split as {name}:SPLIT or with --split"
    return f"{name}: cannot load the dataset: {type(exc).__name__}: {exc}"


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _proxy_configured() -> bool:
    return any(os.environ.get(n) for n in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"))


def _hub_address() -> tuple[str, int]:
    endpoint = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    default_port = 80 if endpoint.scheme == "http" else 443
    return endpoint.hostname or "huggingface.co", endpoint.port or default_port


def _hub_reachable(host: str, port: int, timeout: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """One TCP connect, bounded by ``timeout`` (DNS included: it runs in a thread we stop waiting for)."""
    outcome: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                outcome.append(True)
        except OSError:
            outcome.append(False)

    thread = threading.Thread(target=probe, name="swectl-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(outcome and outcome[0])


# --------------------------------------------------------------------------------------- normalising one row


def detect_source(row: Mapping[str, Any], source_hint: TaskSource | None = None) -> TaskSource:
    """The row style: the row's own ``source``, else the caller's hint, else ``data_source``, else the shape."""
    explicit = row.get("source")
    if explicit in TASK_SOURCES:
        return explicit
    if source_hint is not None:
        return source_hint
    data_source = row.get("data_source")
    if isinstance(data_source, str):
        squashed = re.sub(r"[-_\s]", "", data_source.lower())
        for needle, style in (("swesmith", "swe-smith"), ("swegym", "swe-gym"), ("swebench", "swe-bench")):
            if needle in squashed:
                return style
    repo = row.get("repo")
    if (isinstance(repo, str) and repo.startswith("swesmith/")) or ("image_name" in row and "test_patch" not in row):
        return "swe-smith"
    if isinstance(repo, str) and repo in SWE_GYM_REPOS and "environment_setup_commit" not in row:
        return "swe-gym"
    return "swe-bench"


def normalise_row(row: Mapping[str, Any], location: str, source_hint: TaskSource | None = None) -> Task:
    """One row of any supported style as a ``Task``; raises ``RowProblemError`` naming the field at fault."""
    if not isinstance(row, Mapping):
        raise _problem(location, ROW, f"expected an object of fields, got {_kind(row)}")
    style = detect_source(row, source_hint)
    fields: dict[str, Any] = {name: _string(row, name, location, required=True) for name in _REQUIRED_STR}
    fields.update({name: _string(row, name, location, required=False) for name in _OPTIONAL_STR})
    # a Harbor task is graded by its verifier's reward file, not by test lists
    fields["FAIL_TO_PASS"] = _test_list(row, "FAIL_TO_PASS", location, required=style != "harbor")
    fields["PASS_TO_PASS"] = _test_list(row, "PASS_TO_PASS", location, required=False)
    fields["eval_type"] = _eval_type(row, location)
    consumed = {*_REQUIRED_STR, *_OPTIONAL_STR, "FAIL_TO_PASS", "PASS_TO_PASS", "eval_type"}
    if row.get("source") in TASK_SOURCES:
        consumed.add("source")
    if not fields["image"] and "image_name" in row:
        fields["image"] = _string(row, "image_name", location, required=False)
        consumed.add("image_name")
    extra = {key: value for key, value in row.items() if key not in consumed}
    if style == "swe-smith":
        _smith(fields, extra, row, location)
    _check_environment(fields, style, location, extra)
    return Task(**fields, source=style, extra=extra)


def _smith(fields: dict[str, Any], extra: dict[str, Any], row: Mapping[str, Any], location: str) -> None:
    """SWE-smith's ``patch`` introduces the bug: it becomes ``setup_patch``, its reverse the fix.

    Its ``base_commit`` is the bug commit on a branch of the swesmith mirror repository, which the image does not
    hold; it is kept as ``extra["bug_commit"]`` so nobody checks it out and then applies the bug a second time.
    Rows that already carry ``setup_patch`` (a normalised row read back) are left as they are.
    """
    if row.get("setup_patch"):
        return
    bug = fields["patch"]
    if not bug.strip():
        raise _problem(location, "patch", "a SWE-smith row needs its bug-introducing diff in `patch`; it is empty")
    try:
        fix = reverse_diff(bug)
    except DiffError as exc:
        raise _problem(location, "patch", f"cannot reverse the bug-introducing diff into a fix: {exc}") from exc
    fields["setup_patch"], fields["patch"] = bug, fix
    if fields["base_commit"]:
        extra["bug_commit"] = fields["base_commit"]
        fields["base_commit"] = ""


def _check_environment(fields: dict[str, Any], style: str, location: str, extra: dict[str, Any]) -> None:
    if style == "swectl-synth":
        for name in ("image", "eval_script", "log_parser", "setup_patch"):
            if not fields[name]:
                raise _problem(location, name, f"a swectl-synth row must carry {name}; it is missing or empty")
    if fields["eval_script"]:
        for name in ("image", "log_parser"):
            if not fields[name]:
                raise _problem(location, name, f"a row with an eval_script (SWE-bench 5.x style) must also set {name}")
    if style == "harbor":  # a Harbor task read back from a row: its verifier and settings must have come along
        if fields["log_parser"] != "harbor" or not fields["eval_script"] or not isinstance(extra.get("harbor"), dict):
            raise _problem(location, "source", "a harbor row must carry its verifier (eval_script, log_parser "
                           "'harbor') and extra.harbor; read Harbor tasks from their task folders")
        return
    parser = fields["log_parser"]
    known = _known_log_parsers() if parser else frozenset()
    if known and parser not in known:
        close = difflib.get_close_matches(parser, sorted(known), n=1)
        suggestion = f" (did you mean {close[0]!r}?)" if close else ""
        raise _problem(
            location,
            "log_parser",
            f"unknown log parser {parser!r}{suggestion}; expected a key of swebench's PARSER_REGISTRY",
        )


@functools.cache
def _known_log_parsers() -> frozenset[str]:
    """swebench's parser names, or nothing to check against where swebench is not installed."""
    try:
        from swebench.harness.log_parsers import PARSER_REGISTRY
    except ImportError:
        return frozenset()
    return frozenset(PARSER_REGISTRY)


def _string(row: Mapping[str, Any], name: str, location: str, *, required: bool) -> str:
    value = row.get(name)
    if value is None:
        if required:
            raise _problem(location, name, "required field is " + ("null" if name in row else "missing"))
        return ""
    if name == "created_at" and isinstance(value, dt.date):
        return value.isoformat()
    if not isinstance(value, str):
        raise _problem(location, name, f"expected a string, got {_kind(value)}")
    if required and name in _NON_EMPTY and not value.strip():
        raise _problem(location, name, "expected a non-empty string")
    return value


def _test_list(row: Mapping[str, Any], name: str, location: str, *, required: bool) -> list[str]:
    """A list of test names; JSON-encoded strings (Hugging Face's SWE-bench) are decoded."""
    value = row.get(name)
    if value is None:
        if required:
            raise _problem(location, name, "required field is " + ("null" if name in row else "missing"))
        return []
    encoded = isinstance(value, str)
    if encoded:
        if not value.strip():
            if required:
                raise _problem(location, name, "expected a non-empty list of test names, got an empty string")
            return []
        try:
            value = msgspec.json.decode(value)
        except msgspec.DecodeError:
            raise _problem(
                location,
                name,
                f"expected a list of test names or a JSON string of one; got the "
                f"string {_clip(row[name])!r}, which is not JSON",
            ) from None
    if not isinstance(value, list | tuple):
        encoded_note = " (decoded from its JSON string)" if encoded else ""
        raise _problem(location, name, f"expected a list of test names, got {_kind(value)}{encoded_note}")
    for index, item in enumerate(value):
        if not isinstance(item, str) or not item:
            message = f"expected a test name (a non-empty string), got {_kind(item)}"
            raise _problem(location, f"{name}[{index}]", message)
    if required and not value:
        raise _problem(location, name, "expected a non-empty list of test names, got an empty list")
    return list(value)


def _eval_type(row: Mapping[str, Any], location: str) -> str:
    value = row.get("eval_type")
    if value is None or value == "":
        return "pass_and_fail"
    if value not in _EVAL_TYPES:
        raise _problem(location, "eval_type", f"expected one of {', '.join(_EVAL_TYPES)}, got {_kind(value)}")
    return value


def _problem(location: str, field: str, message: str) -> RowProblemError:
    return RowProblemError(RowProblem(location, field, message))


def _kind(value: Any) -> str:
    """A short description of a value for messages: ``int 3``, ``a list of 2 items``, ``null``."""
    if value is None:
        return "null"
    if isinstance(value, bool | int | float):
        return f"{type(value).__name__} {value!r}"
    if isinstance(value, str):
        return f"the string {_clip(value)!r}" if value else "an empty string"
    if isinstance(value, list | tuple):
        return f"a list of {len(value)} items"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
