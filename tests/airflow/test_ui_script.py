"""Relay's script in Airflow's UI page (relay.airflow.api_plugin.UiScriptMiddleware): the page that the UI serves for
every path gets it; the API, Relay's own pages and compressed answers do not break."""

from __future__ import annotations

import json

from fastapi import FastAPI
from fastapi.middleware.gzip import GZipMiddleware
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.testclient import TestClient

from relay.airflow.api_plugin import UI_SCRIPT, UiScriptMiddleware

PAGE = '<!doctype html><html><head><title>Airflow</title></head><body><div id="root"></div></body></html>' + " " * 2000


def client() -> TestClient:
    app = FastAPI()

    @app.get("/api/v2/dags")
    def dags():
        return JSONResponse({"dags": ["x" * 3000]})

    @app.get("/relay/report")
    def report():
        return HTMLResponse("<html><head></head><body>report</body></html>")

    @app.get("/{rest:path}")
    def ui(rest: str):
        return HTMLResponse(PAGE)

    app.add_middleware(GZipMiddleware, minimum_size=1024)  # Airflow compresses its answers too
    app.add_middleware(UiScriptMiddleware)
    return TestClient(app)


def test_the_ui_page_gets_the_refusal_script_before_its_head_ends():
    c = client()
    for path in ("/", "/dags/relay_demo", "/dags/relay_demo/runs/x"):
        r = c.get(path, headers={"accept": "text/html", "accept-encoding": "gzip"})
        assert r.status_code == 200
        head = r.text.split("</head>")[0]
        assert "Nothing was triggered" in head and "MutationObserver" in head, path
        assert r.text.count("<script>") == 1 and int(r.headers["content-length"]) == len(r.content)


def test_the_api_and_relay_pages_are_left_as_they_are():
    c = client()
    r = c.get("/api/v2/dags", headers={"accept-encoding": "gzip"})
    assert r.headers.get("content-encoding") == "gzip" and json.loads(r.text) == {"dags": ["x" * 3000]}
    assert "<script>" not in c.get("/relay/report").text


def test_the_script_is_what_the_ui_runs():
    text = UI_SCRIPT.read_text()
    assert "</script>" not in text, "it is inlined in a <script> element"
    assert "Bad Request" in text and '[data-scope="toast"]' in text
