"""The "Run report" button of a chunk's tasks: an operator extra link to the run's report.html in S3.

How Airflow 3.3 shows it (read in airflow/sdk/execution_time/task_runner.py::finalize and
airflow/serialization/serialized_objects.py): when a task ends, the worker calls get_link() of each
link its operator class declares and stores the URL as an XCom under the link's xcom_key; the DAG
is serialized with {link name: xcom_key}, and the API server reads that XCom back. So a link
declared on the operator class needs no AirflowPlugin registration (a plugin only attaches links
to operators that do not declare them).
"""

from __future__ import annotations

from airflow.sdk import BaseOperatorLink


class RunReportLink(BaseOperatorLink):
    """For operators with `spec_path` and `run_from_task` (the chunk operators): the run is the one
    the DAG run's preflight task resolved, the URL that of its published report.html."""

    name = "Run report"

    def get_link(self, operator, *, ti_key) -> str:
        from airflow.sdk.execution_time.xcom import XCom

        from relay import report
        from relay.airflow.hooks import checkpoint_store
        from relay.spec import load_spec

        resolved = XCom.get_one(key="return_value", task_id=operator.run_from_task, dag_id=ti_key.dag_id,
                                run_id=ti_key.run_id)
        spec = load_spec(operator.spec_path, check_environment=False)
        if not resolved or spec.s3 is None:
            return ""  # no run resolved (preflight failed), or a spec that publishes nowhere: no button
        return report.page_url(checkpoint_store(spec), resolved["run_name"])

