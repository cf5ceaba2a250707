"""A small client of Airflow's REST API v2 (what the UI does), for the demo and the end-to-end tests.

Plain urllib: no Airflow import, so it runs outside Airflow's processes.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from urllib.parse import quote

TIMEOUT_S = 120  # per request: Airflow's API server on a loaded 2-core machine took longer than 30 s
GET_TRIES = 3


class AirflowAPIError(RuntimeError):
    def __init__(self, status: int, body: str):
        self.status = status
        self.body = body
        super().__init__(f"Airflow API answered HTTP {status}: {body[:500]}")


class AirflowAPI:
    def __init__(self, url: str, username: str, password: str):
        self.url = url.rstrip("/")
        self._token = self._post("/auth/token", {"username": username, "password": password}, auth=False)["access_token"]

    def _call(self, method: str, path: str, body=None, auth: bool = True):
        req = urllib.request.Request(
            f"{self.url}{path}", method=method, data=None if body is None else json.dumps(body).encode()
        )
        req.add_header("Content-Type", "application/json")
        if auth:
            req.add_header("Authorization", f"Bearer {self._token}")
        # A GET is asked again when the server did not answer in time (a loaded machine, an API server busy
        # while the scheduler restarts); anything that changes state is sent once.
        tries = GET_TRIES if method == "GET" else 1
        for attempt in range(1, tries + 1):
            try:
                with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
                    raw = r.read()
                break
            except urllib.error.HTTPError as e:
                raise AirflowAPIError(e.code, e.read().decode(errors="replace")) from None
            except (TimeoutError, ConnectionError, urllib.error.URLError):
                if attempt == tries:
                    raise
                time.sleep(2)
        return json.loads(raw) if raw else None

    def _post(self, path: str, body, auth: bool = True):
        return self._call("POST", path, body, auth)

    def get(self, path: str):
        return self._call("GET", path)

    def wait_for_dag(self, dag_id: str, timeout: float = 120) -> dict:
        """Wait until the DAG processor has parsed the DAG; unpause it."""
        deadline = time.time() + timeout
        while True:
            try:
                dag = self.get(f"/api/v2/dags/{dag_id}")
                break
            except AirflowAPIError as e:
                if e.status != 404 or time.time() > deadline:
                    raise
                time.sleep(1)
        if dag.get("is_paused"):
            self._call("PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": False})
        return dag

    def trigger(self, dag_id: str, conf: dict) -> dict:
        return self._post(f"/api/v2/dags/{dag_id}/dagRuns", {"logical_date": None, "conf": conf})

    def dag_run(self, dag_id: str, run_id: str) -> dict:
        return self.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}")

    def task_instances(self, dag_id: str, run_id: str) -> list[dict]:
        return self.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances")["task_instances"]

    def dag_runs(self, dag_id: str) -> list[dict]:
        return self.get(f"/api/v2/dags/{dag_id}/dagRuns?order_by=logical_date&limit=100")["dag_runs"]

    def wait_for_run(self, dag_id: str, run_id: str, timeout: float = 600) -> dict:
        """Wait until a DAG run has ended (success or failed); return it."""
        deadline = time.time() + timeout
        while True:
            run = self.dag_run(dag_id, run_id)
            if run["state"] in ("success", "failed") or time.time() > deadline:
                return run
            time.sleep(1)

    def unfinished_dag_runs(self) -> list[dict]:
        """Every DAG run that is queued or running, of any DAG."""
        return self.get("/api/v2/dags/~/dagRuns?state=queued&state=running&limit=100")["dag_runs"]

    def update_dag_run(self, dag_id: str, run_id: str, **fields) -> dict:
        """Set fields of a DAG run (state, note) as the UI's buttons do."""

        mask = "&".join(f"update_mask={k}" for k in fields)
        return self._call("PATCH", f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}?{mask}", fields)

    def clear_task_instances(self, dag_id: str, run_id: str, task_ids: list[str]) -> list[dict]:
        """Clear tasks of a DAG run and what follows them, as the UI's Clear button does: each runs again
        (a deferred one's trigger is cancelled, and its operator told so)."""
        return self._post(
            f"/api/v2/dags/{dag_id}/clearTaskInstances",
            {
                "dry_run": False,
                "dag_run_id": run_id,
                "task_ids": task_ids,
                "only_failed": False,
                "include_downstream": True,
                "reset_dag_runs": True,
            },
        )["task_instances"]

    def decision(self, dag_id: str, run_id: str, task_id: str) -> dict:
        """A task's human-in-the-loop request (subject, body, options) and its answer, once given."""
        return self.get(f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances/{task_id}/-1/hitlDetails")

    def answer(self, dag_id: str, run_id: str, task_id: str, option: str) -> dict:
        """Answer a task's request as its Required Actions page does."""
        return self._call(
            "PATCH",
            f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances/{task_id}/-1/hitlDetails",
            {"chosen_options": [option]},
        )

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int = 1) -> str:
        """A task try's whole log as the UI shows it, one line per record (its fields as JSON)."""
        got = self.get(
            f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances/{task_id}/logs/"
            f"{try_number}?full_content=true"
        )
        return "\n".join(json.dumps(c) if isinstance(c, dict) else str(c) for c in got.get("content") or [])

    def asset_events(self, **filters) -> list[dict]:
        """Asset events, e.g. source_dag_id=..., oldest first."""
        query = "&".join(f"{k}={v}" for k, v in {**filters, "order_by": "timestamp", "limit": 100}.items())
        return self.get(f"/api/v2/assets/events?{query}")["asset_events"]
