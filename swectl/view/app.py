"""`swectl view`'s web page and JSON API over one or more run folders, and the self-contained HTML export.

    GET /                                   the page (swectl/view/page.html)
    GET /api/runs                           each run's summary (kind, steps, episodes, config)
    GET /api/runs/{i}/metrics               its metrics.jsonl rows
    GET /api/runs/{i}/tasks                 per task: episodes, resolved, per step, groups with/without signal
    GET /api/runs/{i}/episodes?instance_id=&phase=&step=&sample=&exit_status=&resolved=&reward_min=&reward_max=
                               &weight_version=
    GET /api/runs/{i}/episode?id=FOLDER     one episode: turns, steps, context cuts, format errors, diff, grade,
                                            test log tail, the other episodes of its group

Each API call first brings the run's index up to date (new metrics lines, new episode folders), so the page
polling it shows a live run. Off loopback every request needs ``key=`` (the page passes the one in its URL).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from swectl.view.index import RunIndex

N = TypeVar("N", int, float)


def page_html() -> str:
    return resources.files("swectl.view").joinpath("page.html").read_text(encoding="utf-8")


def _json(content: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(content), status_code=status, media_type="application/json")


def _number(text: str, kind: Callable[[str], N]) -> N | None:
    return kind(text) if text.strip() else None


def build_app(runs: list[RunIndex], *, api_key: str | None = None) -> Starlette:
    def run_of(request: Request) -> RunIndex:
        index = int(request.path_params["i"])
        if not 0 <= index < len(runs):
            raise KeyError(index)
        run = runs[index]
        run.refresh()
        return run

    async def page(request: Request) -> Response:
        return HTMLResponse(page_html())

    async def list_runs(request: Request) -> Response:
        for run in runs:
            run.refresh()
        return _json([run.summary() for run in runs])

    async def metrics(request: Request) -> Response:
        return _json(run_of(request).metrics)

    async def tasks(request: Request) -> Response:
        return _json(run_of(request).tasks())

    async def episodes(request: Request) -> Response:
        q = request.query_params
        resolved = q.get("resolved", "")
        try:
            step, sample = _number(q.get("step", ""), int), _number(q.get("sample", ""), int)
            reward_min, reward_max = _number(q.get("reward_min", ""), float), _number(q.get("reward_max", ""), float)
        except ValueError:
            return _json({"error": "step and sample must be whole numbers, reward_min and reward_max numbers"}, 400)
        rows = run_of(request).episode_rows(
            instance_id=q.get("instance_id", ""), phase=q.get("phase", ""), step=step, sample=sample,
            exit_status=q.get("exit_status", ""), resolved=None if resolved == "" else resolved == "true",
            reward_min=reward_min, reward_max=reward_max, weight_version=q.get("weight_version", ""))
        return _json(rows)

    async def episode(request: Request) -> Response:
        try:
            return _json(run_of(request).episode(request.query_params.get("id", "")))
        except KeyError:
            return _json({"error": "no such episode in this run"}, 404)

    app = Starlette(routes=[
        Route("/", page), Route("/api/runs", list_runs), Route("/api/runs/{i:int}/metrics", metrics),
        Route("/api/runs/{i:int}/tasks", tasks), Route("/api/runs/{i:int}/episodes", episodes),
        Route("/api/runs/{i:int}/episode", episode),
    ], exception_handlers={KeyError: lambda request, exc: _json({"error": "no such run"}, 404)})
    if api_key:
        inner = app

        async def keyed(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http":
                given = Request(scope).query_params.get("key", "")
                if not hmac.compare_digest(given.encode(), api_key.encode()):
                    await JSONResponse({"error": "add ?key=<the key> to the address"}, 401)(scope, receive, send)
                    return
            await inner(scope, receive, send)

        return keyed  # type: ignore[return-value]
    return app


def export_html(runs: list[RunIndex]) -> str:
    """One self-contained page: the page with every API answer it can ask for embedded (no server, no network)."""
    data: dict[str, Any] = {"/api/runs": [run.summary() for run in runs]}
    for i, run in enumerate(runs):
        data[f"/api/runs/{i}/metrics"] = run.metrics
        data[f"/api/runs/{i}/tasks"] = run.tasks()
        rows = data[f"/api/runs/{i}/episodes"] = run.episode_rows()
        for row in rows:  # reading each episode also fills in its row's weight versions (encoded below)
            data[f"/api/runs/{i}/episode?id={_quote(row.id)}"] = run.episode(row.id)
    blob = json.dumps(msgspec.to_builtins(data)).replace("</", "<\\/")  # never closes the script element
    return page_html().replace("<script>\n\"use strict\";", f"<script>window.SWECTL_DATA = {blob};</script>\n"
                                                            "<script>\n\"use strict\";", 1)


def _quote(text: str) -> str:
    """As the page's encodeURIComponent writes an episode id into the address."""
    return quote(text, safe="-_.!~*'()")


def write_html(out: Path, runs: list[RunIndex]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(export_html(runs), encoding="utf-8")
