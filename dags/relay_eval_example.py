"""Example downstream DAG: runs whenever a run of the demo spec publishes a checkpoint (an asset event on
the run's asset, through the spec's asset alias), loads the published model and reports its step. A
template for real evaluations."""

from datetime import datetime

from airflow.providers.standard.operators.python import PythonOperator
from airflow.sdk import DAG

from relay.airflow.assets import checkpoint_alias
from relay.airflow.tasks import evaluate_published
from relay.common import project
from relay.spec.run_spec import load_spec

SPEC = project.root() / "include" / "runs" / "demo.yaml"
spec = load_spec(SPEC, check_environment=False)

with DAG(
    dag_id="relay_eval_demo",
    schedule=[checkpoint_alias(spec)],
    start_date=datetime(2025, 1, 1),
    catchup=False,
    tags=["relay", "example"],
    doc_md=__doc__,
) as dag:
    PythonOperator(task_id="evaluate", python_callable=evaluate_published, op_kwargs={"spec_path": str(SPEC)})
