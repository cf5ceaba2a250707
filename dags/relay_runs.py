"""One DAG per run spec in include/runs/ (see plugins/relay/airflow/dag_factory.py)."""

from relay.airflow.dag_factory import build_dags

globals().update(build_dags())
