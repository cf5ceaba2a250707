"""The DAG factory: one DAG per spec, a chunk task group per chunk, a Params form, a light parse."""

import json
import subprocess

from support.helpers import PY, ROOT, write_spec

PARSE = """
import json, sys
sys.path[:0] = [{plugins!r}, {dags!r}]
import relay_runs
dags = {{k: v for k, v in vars(relay_runs).items() if k.startswith("relay_")}}
heavy = sorted(m for m in ("torch", "verl", "ray", "pyarrow", "transformers") if m in sys.modules)
out = {{}}
for dag_id, dag in dags.items():
    out[dag_id] = {{
        "groups": sorted(dag.task_group.children),
        "tasks": sorted(dag.task_dict),
        "params": {{k: dict(dag.params.get_param(k).schema, description=dag.params.get_param(k).description)
                   for k in dag.params}},
        "retries": dag.task_dict.get("chunk_01.train").retries if "chunk_01.train" in dag.task_dict else None,
        "max_active_runs": dag.max_active_runs,
        "schedule": str(dag.schedule), "catchup": dag.catchup, "start_date": dag.start_date.isoformat(),
        "pool": dag.task_dict["chunk_01.train"].pool if "chunk_01.train" in dag.task_dict else None,
        "downstream": {{t.task_id: sorted(t.downstream_task_ids) for t in dag.tasks}},
    }}
print(json.dumps({{"heavy": heavy, "dags": out}}))
"""


def parse(runs_dir) -> dict:
    """Import dags/relay_runs.py in a fresh interpreter, as the DAG processor does."""
    code = PARSE.format(plugins=str(ROOT / "plugins"), dags=str(ROOT / "dags"))
    r = subprocess.run(
        [PY, "-c", code],
        capture_output=True,
        text=True,
        env={"RELAY_RUNS_DIR": str(runs_dir), "PATH": "/usr/bin:/bin", "AIRFLOW_HOME": str(runs_dir / "airflow")},
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_one_dag_per_spec_without_heavy_imports(tmp_path):
    write_spec(tmp_path, name="alpha")
    write_spec(tmp_path, name="beta", total_steps=20, chunk_steps=8)
    out = parse(tmp_path)
    assert out["heavy"] == [], "parsing a DAG file must not import torch, verl, ray or pyarrow"
    assert sorted(out["dags"]) == ["relay_alpha", "relay_beta"]
    beta = out["dags"]["relay_beta"]
    assert beta["groups"] == ["chunk_01", "chunk_02", "chunk_03", "finish", "preflight"]
    assert beta["tasks"] == [
        "chunk_01.publish",
        "chunk_01.train",
        "chunk_01.validate",
        "chunk_02.publish",
        "chunk_02.train",
        "chunk_02.validate",
        "chunk_03.publish",
        "chunk_03.train",
        "chunk_03.validate",
        "finish",
        "preflight.data",
        "preflight.run",
        "preflight.settings",
    ]
    assert beta["downstream"]["preflight.run"] == ["preflight.settings"], "cheap checks first"
    assert beta["downstream"]["preflight.data"] == ["chunk_01.train"]
    assert beta["downstream"]["chunk_01.validate"] == ["chunk_01.publish", "chunk_02.train"], (
        "chunk 1 publishes while chunk 2 trains"
    )
    assert beta["downstream"]["chunk_01.publish"] == ["chunk_02.publish"]
    assert beta["max_active_runs"] == 1 and beta["retries"] == 2


def test_a_scheduled_spec_is_a_scheduled_dag_with_one_trainer_pool(tmp_path):
    write_spec(
        tmp_path,
        name="weekly",
        **{
            "airflow.schedule": "@weekly",
            "airflow.start_date": "2025-01-06",
            "data.train_files": ["/data/prompts-{{ ds_nodash }}.parquet"],
        },
    )
    write_spec(tmp_path, name="manual")
    dags = parse(tmp_path)["dags"]
    weekly, manual = dags["relay_weekly"], dags["relay_manual"]
    assert (weekly["schedule"], weekly["catchup"], weekly["start_date"]) == ("@weekly", False, "2025-01-06T00:00:00+00:00")
    assert weekly["max_active_runs"] == 1, "one GPU cluster is shared"
    assert manual["schedule"] == "None"
    assert weekly["pool"] == manual["pool"] == "relay_trainers"


def test_an_unknown_date_template_makes_no_dag(tmp_path):
    write_spec(
        tmp_path, name="typo", **{"airflow.schedule": "@daily", "data.train_files": ["/data/prompts-{{ ts }}.parquet"]}
    )
    dags = parse(tmp_path)["dags"]
    assert "relay_typo" not in dags and dags["relay_spec_errors"]


def test_params_form_is_typed_described_and_every_field_optional(tmp_path):
    write_spec(tmp_path, name="alpha")
    params = parse(tmp_path)["dags"]["relay_alpha"]["params"]
    assert set(params) == {"run", "fresh_start", "confirm_fresh_start", "allow_drift", "alert_emails", "alert_channels"}
    assert all(p.get("description") for p in params.values())
    # Airflow's UI marks a field required (and disables Trigger while it is empty) unless its type admits null.
    assert all("null" in p["type"] for p in params.values()), {k: p["type"] for k, p in params.items()}
    assert params["run"]["type"] == ["null", "string"] and "pattern" in params["run"]
    assert "boolean" in params["fresh_start"]["type"]
    assert params["alert_emails"]["items"]["type"] == "string"
    # the channels the spec configures (the test spec: e-mail only), as a multi-select of exactly those
    assert params["alert_channels"]["items"] == {"type": "string", "enum": ["email"]}
    assert params["alert_channels"]["examples"] == ["email"]
    # Step counts and chunk sizes are not Params: they shape the DAG and come from the spec.
    assert not {"total_steps", "chunk_steps"} & set(params)


def test_a_bad_spec_makes_no_dag_and_shows_its_error(tmp_path):
    write_spec(tmp_path, name="good")
    write_spec(tmp_path, name="bad", chunk_steps=0)
    dags = parse(tmp_path)["dags"]
    assert "relay_good" in dags and "relay_bad" not in dags
    assert dags["relay_spec_errors"]["tasks"] == ["show_errors"]


def test_the_shipped_specs_all_load():
    out = parse(ROOT / "include" / "runs")
    assert "relay_spec_errors" not in out["dags"] and "relay_demo" in out["dags"]


def test_the_example_evaluation_dag_is_scheduled_on_the_checkpoint_alias():
    code = (
        f"import sys; sys.path[:0] = [{str(ROOT / 'plugins')!r}, {str(ROOT / 'dags')!r}]; "
        "import relay_eval_example as m; "
        "print(repr(m.dag.timetable)); "
        "print(sorted(x for x in ('torch', 'verl', 'ray') if x in sys.modules))"
    )
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "relay_demo_checkpoints" in r.stdout and "[]" in r.stdout.splitlines()[-1]
