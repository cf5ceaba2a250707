"""Supervised mode's tasks compose into the DAG shape dag_factory.build_dag gets for a supervised spec."""

from __future__ import annotations

from datetime import datetime

from relay.spec.run_spec import spec_from_dict


def supervised_spec(tmp_path, mode="supervised"):
    d = {
        "name": "gsm",
        "trainer": {"kind": "verl_ppo", "settings": {"model_path": "/m", "mode": mode}},
        "total_steps": 30,
        "chunk_steps": 10,
        "seed": 1,
        "threads": 1,
        "checkpoint_dir": str(tmp_path / "c"),
        "data": {"train_files": ["/t.parquet"], "val_files": ["/v.parquet"]},
        "s3": {"uri": "s3://relay/runs"},
    }
    return spec_from_dict(d, check_environment=False)


def test_the_supervised_shape(tmp_path):
    from airflow.providers.standard.operators.empty import EmptyOperator
    from airflow.sdk import DAG, TaskGroup

    from relay.airflow.supervised import (
        SupervisedRunOperator,
        SupervisedValidateOperator,
        is_supervised,
        supervise_task,
        validate_task,
    )
    from relay.spec.plan import ChunkPlan

    spec = supervised_spec(tmp_path)
    assert is_supervised(spec) and not is_supervised(supervised_spec(tmp_path, "chunked"))
    with DAG("relay_gsm", schedule=None, start_date=datetime(2025, 1, 1)) as dag:
        data = EmptyOperator(task_id="data")
        supervisor = supervise_task(spec)
        data >> supervisor
        upstream = data
        for chunk in ChunkPlan.from_spec(spec).chunks:
            with TaskGroup(chunk.task_group_id):
                validate = validate_task(spec, chunk)
                upstream >> validate
            upstream = validate
        done = EmptyOperator(task_id="finish")
        upstream >> done
        supervisor >> done
    sup = dag.get_task("supervise")
    assert isinstance(sup, SupervisedRunOperator) and sup.chunk_index == 1
    assert sup.upstream_task_ids == {"data"} and sup.downstream_task_ids == {"finish"}
    v2 = dag.get_task("chunk_02.validate")
    assert isinstance(v2, SupervisedValidateOperator) and v2.train_task is None and v2.retries == 0
    assert v2.upstream_task_ids == {"chunk_01.validate"}
    assert dag.get_task("chunk_01.validate").upstream_task_ids == {"data"}
