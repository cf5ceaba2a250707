"""Relay inside Airflow's API server (an AirflowPlugin, loaded from plugins/relay_airflow_plugin.py):

- the trigger form's refusals in plain words: Airflow answers a value outside a run DAG's Params with
  jsonschema's text (the regex, the whole schema); the UI shows that answer as it comes. The
  middleware replaces it with relay.airflow.form.explain's words: what is wrong, and an example.
- a rejected decision on the DAG run's note: who rejected what, and that nothing was changed.
- the training run's name on the DAG run: a trigger of a run DAG gets the DAG run id
  "NAME__manual__<time>" (the run list and the grid show ids) unless the person typed one, and the
  note "training run: NAME" (the DAG run's page shows notes).
- a refused trigger's reason in view: Airflow's UI page gets trigger_refusal.js (UiScriptMiddleware), which
  scrolls the dialog's answer into view and puts it in the toast, wrapped at words.
- Relay's pages under /relay, behind Airflow's own login (the UI's session cookie) and its DAG
  permissions: the run report, built when it is opened, so a link to it never expires. A browser without a
  session is sent to the login page and back.

Only the API server mounts these; other processes that load plugins import this module and build
nothing else.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import quote, unquote

from airflow.plugins_manager import AirflowPlugin
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import HTMLResponse, RedirectResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from relay.airflow import form
from relay.airflow.links import RELAY_APP_PREFIX
from relay.common.errors import RelayError
from relay.ops import run_history, runs

log = logging.getLogger(__name__)

TRIGGER_PATH = re.compile(r"/api/v2/dags/(?P<dag_id>[^/]+)/dagRuns/?")
NOTE_MAX = 1000  # Airflow's dag_run_note.content
ANSWER_PATH = re.compile(
    r"/api/v2/dags/(?P<dag_id>[^/]+)/dagRuns/(?P<run_id>[^/]+)/taskInstances/(?P<task_id>[^/]+)/"
    r"(?P<map_index>-?[0-9]+)/hitlDetails"
)


def run_name_of(spec, conf: dict, logical_date: str | None) -> str:
    """The run a trigger names, as preflight.run resolves it (relay.ops.runs.asked_run_name)."""
    return runs.asked_run_name(spec, conf.get("run"), datetime.fromisoformat(logical_date) if logical_date else None)


class TriggerFormMiddleware:
    """ASGI middleware on the API server: see the module's docstring. Only POSTs that trigger a run DAG
    are touched; Airflow still validates, authorizes and creates the DAG run itself."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] == "http"
            and scope["method"] == "PATCH"
            and (answered := ANSWER_PATH.fullmatch(scope.get("path", ""))) is not None
        ):
            return await self.app(scope, receive, _note_rejections(send, answered))
        match = TRIGGER_PATH.fullmatch(scope.get("path", "")) if scope["type"] == "http" else None
        if match is None or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        spec = runs.spec_for_dag(match["dag_id"])
        if spec is None:
            return await self.app(scope, receive, send)
        body = await _read_body(receive)
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None
        conf = payload.get("conf") if isinstance(payload, dict) else None
        if isinstance(payload, dict) and isinstance(conf or {}, dict) and not form.explain(spec, conf or {}):
            try:
                body = json.dumps(
                    _named(payload, run_name_of(spec, payload.get("conf") or {}, payload.get("logical_date")))
                ).encode()
            except Exception as e:  # noqa: BLE001 - an unparsable date, say: Airflow refuses it itself
                log.debug("trigger left as it came: %s", e)
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        await self.app(scope, _replay(body), _plain_refusals(send, spec, conf))


UI_SCRIPT = Path(__file__).with_name("trigger_refusal.js")


class UiScriptMiddleware:
    """ASGI middleware on the API server: Airflow's UI page (its index.html, served for every UI path) gets Relay's
    trigger_refusal.js before </head>. Only GETs whose answer is that page are touched, asked uncompressed (the page
    is a few hundred bytes); the API, Relay's pages and static files pass as they are."""

    def __init__(self, app):
        self.app = app
        self.tag = f"<script>\n{UI_SCRIPT.read_text()}</script>\n".encode()

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if scope["type"] != "http" or scope["method"] != "GET" or path.startswith(("/api/", "/static/", "/relay/")):
            return await self.app(scope, receive, send)
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"accept-encoding"]
        await self.app({**scope, "headers": headers}, receive, _with_script(send, self.tag))


def _with_script(send, tag: bytes):
    """Wrap `send`: an HTML answer that is Airflow's UI page gets `tag` before its </head>."""

    def html(start) -> bool:
        kinds = [v for k, v in start["headers"] if k.lower() == b"content-type"]
        return bool(kinds) and kinds[0].startswith(b"text/html")

    def inject(body: bytes) -> bytes:
        if b'<div id="root"' in body and b"</head>" in body:
            return body.replace(b"</head>", tag + b"</head>", 1)
        return body

    return _rewritten(send, html, inject)


def _rewritten(send, wanted, rewrite):
    """Wrap `send`: an answer whose start message is wanted(start) is held whole and sent as rewrite(body), with its
    content-length set again; any other passes as it comes."""
    start = None
    chunks: list[bytes] = []

    async def wrapped(message):
        nonlocal start
        if message["type"] == "http.response.start" and wanted(message):
            start = message
            return
        if start is None or message["type"] != "http.response.body":
            return await send(message)
        chunks.append(message.get("body", b""))
        if message.get("more_body"):
            return
        body = rewrite(b"".join(chunks))
        headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
        await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    return wrapped


def _named(payload: dict, run: str) -> dict:
    """The trigger with the training run in its DAG run id (the run list shows ids) and its note (the DAG
    run's page shows it), unless the person gave their own."""
    out = dict(payload)
    if not out.get("dag_run_id"):
        out["dag_run_id"] = f"{run}__manual__{datetime.now(UTC).isoformat()}"
    note = f"training run: {run}"
    out["note"] = f"{out['note']}\n\n{note}" if out.get("note") else note
    return out


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def _replay(body: bytes):
    sent = False

    async def receive():
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


def _plain_refusals(send, spec, conf):
    """Wrap `send`: a 400 that refuses a Param gets relay.airflow.form.explain's words instead of jsonschema's."""
    return _rewritten(send, lambda start: start["status"] == 400, lambda body: _explained(body, spec, conf))


def _explained(body: bytes, spec, conf) -> bytes:
    try:
        detail = json.loads(body).get("detail")
    except (ValueError, AttributeError):
        return body
    if not (isinstance(detail, str) and detail.startswith("Invalid input for param")):
        return body
    problems = form.explain(spec, conf)
    if not problems:  # Airflow refused something Relay does not know: keep its first line only
        problems = [detail.splitlines()[0]]
    text = (
        f"Nothing was triggered. {' '.join(problems)}"
        if len(problems) == 1
        else "Nothing was triggered:\n" + "\n".join(f"- {p}" for p in problems)
    )
    return json.dumps({"detail": text}).encode()


def _note_rejections(send, answered: re.Match):
    """Wrap `send`: once a person's answer to a Relay decision is accepted (200) and it does not go on, the DAG run's
    note says who rejected what and that nothing was changed (the task's own log says the same)."""
    status, chunks = 0, []

    async def wrapped(message):
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body" and status == 200:
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                try:
                    answer = json.loads(b"".join(chunks))
                    await asyncio.to_thread(
                        note_rejection,
                        unquote(answered["dag_id"]),
                        unquote(answered["run_id"]),
                        unquote(answered["task_id"]),
                        int(answered["map_index"]),
                        answer,
                    )
                except Exception as e:  # noqa: BLE001 - a note is never worth the person's answer
                    log.warning("the DAG run's note was not written: %s", e)
        await send(message)

    return wrapped


def note_rejection(dag_id: str, run_id: str, task_id: str, map_index: int, answer: dict) -> str | None:
    """If `answer` rejects the Relay decision the task asked, write it on the DAG run's note; the note, or None."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import select

    from relay.airflow.decisions import rejection_text

    with create_session() as session:
        ti = session.scalar(
            select(TaskInstance).where(
                TaskInstance.dag_id == dag_id,
                TaskInstance.run_id == run_id,
                TaskInstance.task_id == task_id,
                TaskInstance.map_index == map_index,
            )
        )
        decision = _found(ti.next_kwargs if ti is not None else None, "decision")
        chosen = (answer.get("chosen_options") or [""])[0]
        if not isinstance(decision, dict) or chosen in (decision.get("proceed") or []):
            return None
        who = (answer.get("responded_by") or {}).get("name") or "someone"
        run = (decision.get("data") or {}).get("run") or "?"
        note = f"{rejection_text(run, decision.get('subject', ''), chosen, f'{who} in the Airflow UI')}."
        dag_run = session.scalar(select(DagRun).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id))
        if dag_run is not None and dag_run.dag_run_note is None:
            dag_run.note = (note[:NOTE_MAX], None)
        elif dag_run is not None:  # the training run's note of the trigger: kept, the rejection below it
            dag_run.dag_run_note.content = f"{dag_run.dag_run_note.content}\n\n{note}"[:NOTE_MAX]
        return note


def _found(node, key: str):
    """`key`'s value in a task's next_kwargs, however Airflow serialized them ({"__var": ...} wrappers)."""
    if isinstance(node, dict):
        if key in node:
            value = node[key]
            return _found(value, "__var") if isinstance(value, dict) and "__var" in value else value
        for value in node.values():
            if (hit := _found(value, key)) is not None:
                return hit
    return None


# ------------------------------------------------------------------------------------- Relay's pages
def _pages() -> FastAPI:
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
    from airflow.api_fastapi.core_api.security import requires_access_dag

    app = FastAPI(title="Relay", docs_url=None, redoc_url=None, openapi_url=None)
    can_read_runs = [Depends(requires_access_dag(method="GET", access_entity=DagAccessEntity.RUN))]

    @app.exception_handler(StarletteHTTPException)
    async def login_first(request: Request, exc: StarletteHTTPException):
        """A browser without an Airflow session (a link opened from an alert, by a colleague) is sent to Airflow's
        login page, and back here once logged in, as Airflow's own pages do; an API client gets the 401."""
        if exc.status_code == 401 and "text/html" in request.headers.get("accept", ""):
            return RedirectResponse(login_url(request), status_code=303)
        return await http_exception_handler(request, exc)

    @app.get("/dags/{dag_id}/runs/{run}/report", response_class=HTMLResponse, dependencies=can_read_runs)
    def run_report(dag_id: str, run: str, dag_run: str | None = None) -> HTMLResponse:
        """The run report, built now from the run's folder (or S3 where this server cannot see it); `dag_run`: the
        DAG run the link came from, linked back to."""
        spec = runs.spec_for_dag(dag_id)
        if spec is None:
            raise HTTPException(404, f"{dag_id} is not a DAG of a Relay run spec in include/runs")
        try:
            from airflow.configuration import conf

            from relay.airflow.hooks import checkpoint_store

            base = (conf.get("api", "base_url", fallback="") or "").rstrip("/")
            back = f"{base}/dags/{quote(dag_id)}" + (f"/runs/{quote(dag_run, safe='')}" if dag_run else "")
            return HTMLResponse(run_history.report_page(runs.Run.of(spec, run), checkpoint_store(spec), back=back))
        except RelayError as e:
            raise HTTPException(404, f"{e.what}. {e.fix}") from None

    return app


def login_url(request: Request) -> str:
    """Airflow's login page, with the page asked for as where to come back to (on the UI's own base URL)."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.configuration import conf

    here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    base = conf.get("api", "base_url", fallback="") or str(request.base_url)
    return get_auth_manager().get_url_login(next_url=base.rstrip("/") + here)


class RelayPlugin(AirflowPlugin):
    # Airflow's plugin loader reads these class attributes; AirflowPlugin declares them as plain lists.
    name = "relay"
    fastapi_root_middlewares = [
        {
            "middleware": TriggerFormMiddleware,
            "args": [],
            "kwargs": {},
            "name": "Relay: the trigger form in plain words, the training run as a note",
        },
        {
            "middleware": UiScriptMiddleware,
            "args": [],
            "kwargs": {},
            "name": "Relay: a refused trigger's reason in view in Airflow's UI",
        },
    ]
    fastapi_apps = [{"app": _pages(), "url_prefix": RELAY_APP_PREFIX, "name": "Relay pages"}]
