"""The buttons on a chunk's tasks (operator extra links): its Ray job, its checkpoint, the run report.

How Airflow 3.3 shows them (read in airflow/sdk/execution_time/task_runner.py::finalize and
airflow/api_fastapi/core_api/routes/public/extra_links.py): whenever a try of the task stops running
in its worker (it ends, or it defers), the worker calls get_link() of each link its operator class
declares and stores the URL as an XCom under the link's xcom_key; the API server reads that XCom
back. So a deferred train task already shows its Ray job's link while the job trains. A link
declared on the operator class needs no AirflowPlugin registration.

The report and checkpoint links point at Relay's pages in the API server (relay.airflow.api_plugin),
which build the report when clicked: the links never expire while the run exists.
"""

from __future__ import annotations

from urllib.parse import quote

from airflow.sdk import BaseOperatorLink

from relay.ops import runs

RELAY_APP_PREFIX = "/relay"  # where relay.airflow.api_plugin mounts Relay's pages in the API server
RAY_JOB_XCOM = "ray_job"  # {"submission_id", "url"}: pushed by the train task when it submits or re-attaches


def relay_page(path: str) -> str:
    """A Relay page's URL as people open it: [api] base_url (AIRFLOW__API__BASE_URL), else a path on
    the page's own server."""
    from airflow.configuration import conf

    base = (conf.get("api", "base_url", fallback="") or "").rstrip("/")
    return f"{base}{RELAY_APP_PREFIX}{path}"


def report_page(dag_id: str, run: str, dag_run: str | None = None) -> str:
    """The run report's page; with the DAG run a link comes from, the report links back to it."""
    page = relay_page(f"/dags/{quote(dag_id)}/runs/{quote(run)}/report")
    return f"{page}?dag_run={quote(dag_run, safe='')}" if dag_run else page


def ray_job_page(dashboard: str, submission_id: str) -> str:
    """The Ray dashboard's page of one job (its status, driver log, workers)."""
    return f"{dashboard.rstrip('/')}/#/jobs/{quote(submission_id)}"


def _run_of(operator, ti_key) -> str | None:
    """The training run this DAG run's preflight.run resolved (None before it succeeded)."""
    from airflow.sdk.execution_time.xcom import XCom

    resolved = XCom.get_one(key="return_value", task_id=operator.run_from_task, dag_id=ti_key.dag_id, run_id=ti_key.run_id)
    return (resolved or {}).get("run_name")


class RunReportLink(BaseOperatorLink):
    """The run report: curves, chunks, resumes, fingerprints, built fresh when clicked."""

    name = "Run report"

    def get_link(self, operator, *, ti_key) -> str:
        run = _run_of(operator, ti_key)
        return report_page(ti_key.dag_id, run, ti_key.run_id) if run else ""


class CheckpointLink(BaseOperatorLink):
    """The chunk's checkpoint: its row of the run report's checkpoint table (size, validation, S3 URI)."""

    name = "Checkpoint"

    def get_link(self, operator, *, ti_key) -> str:
        run = _run_of(operator, ti_key)
        if not run:
            return ""
        step = runs.chunk_of(operator.spec_path, operator.chunk_index).end_step
        return f"{report_page(ti_key.dag_id, run, ti_key.run_id)}#step-{step}"


class RayJobLink(BaseOperatorLink):
    """The Ray dashboard's page of the job this try submitted or re-attached to (none: no job ran)."""

    name = "Ray job"

    def get_link(self, operator, *, ti_key) -> str:
        from airflow.sdk.execution_time.xcom import XCom

        job = XCom.get_one(
            key=RAY_JOB_XCOM, task_id=ti_key.task_id, dag_id=ti_key.dag_id, run_id=ti_key.run_id, map_index=ti_key.map_index
        )
        return (job or {}).get("url", "")
