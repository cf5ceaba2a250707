"""The DAG factory: one DAG per spec, a chunk task group per chunk, a Params form, a light parse."""

import json
import subprocess

import pytest

from support.helpers import PY, ROOT, write_spec

pytestmark = pytest.mark.processes  # every case parsed in a fresh interpreter: not in the fast lane

PARSE = """
import importlib, json, os, sys
sys.path[:0] = [{plugins!r}, {dags!r}]
results = {{}}
for case, folder in json.loads(sys.argv[1]).items():
    os.environ["RELAY_RUNS_DIR"] = folder  # as a DAG processor re-parses the file after the folder changed
    sys.modules.pop("relay_runs", None)  # a module of its own each time: no DAG of the folder before
    relay_runs = importlib.import_module("relay_runs")
    dags = {{k: v for k, v in vars(relay_runs).items() if k.startswith("relay_")}}
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
            "watched": {{t.task_id: t.watched for t in dag.tasks if hasattr(t, "watched")}},
        }}
    results[case] = out
heavy = sorted(m for m in ("torch", "verl", "ray", "pyarrow", "transformers") if m in sys.modules)
print(json.dumps({{"heavy": heavy, "cases": results}}))
"""


def one_spec(folder):
    write_spec(folder, name="alpha")


def two_specs(folder):
    write_spec(folder, name="alpha", **{"chunks.handoff": "warm"})
    write_spec(folder, name="beta", total_steps=20, chunk_steps=8)


def scheduled(folder):
    schedule = {
        "airflow.schedule": "@weekly",
        "airflow.start_date": "2025-01-06",
        "data.train_files": ["/data/prompts-{{ ds_nodash }}.parquet"],
    }
    write_spec(folder, name="weekly", **schedule)
    write_spec(folder, name="manual")


def unknown_template(folder):
    write_spec(folder, name="typo", **{"airflow.schedule": "@daily", "data.train_files": ["/data/prompts-{{ ts }}.parquet"]})


def good_and_bad(folder):
    write_spec(folder, name="good")
    write_spec(folder, name="bad", chunk_steps=0)


CASES = {f.__name__: f for f in (one_spec, two_specs, scheduled, unknown_template, good_and_bad)}


@pytest.fixture(scope="module")
def parsed(tmp_path_factory):
    """Each case's runs folder, and the shipped specs, parsed: dags/relay_runs.py imported with RELAY_RUNS_DIR
    naming each folder in turn, in one fresh interpreter, as the DAG processor does. {"heavy": [...], "cases":
    {case: {dag_id: what the DAG holds}}}"""
    root = tmp_path_factory.mktemp("parse")
    folders = {}
    for case, make in CASES.items():
        folders[case] = root / case
        make(folders[case])
    folders["shipped"] = ROOT / "include" / "runs"
    code = PARSE.format(plugins=str(ROOT / "plugins"), dags=str(ROOT / "dags"))
    r = subprocess.run(
        [PY, "-c", code, json.dumps({k: str(v) for k, v in folders.items()})],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "AIRFLOW_HOME": str(root / "airflow")},
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_one_dag_per_spec_without_heavy_imports(parsed):
    assert parsed["heavy"] == [], "parsing a DAG file must not import torch, verl, ray or pyarrow"
    dags = parsed["cases"]["two_specs"]
    assert sorted(dags) == ["relay_alpha", "relay_beta"]
    beta = dags["relay_beta"]
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
    alpha = dags["relay_alpha"]  # warm chunks: chunk 1's job, going on into chunk 2, is followed until its admission
    assert alpha["downstream"]["chunk_01.train"] == ["chunk_01.ahead", "chunk_01.validate"]
    assert alpha["downstream"]["chunk_01.ahead"] == [], "a leaf: it never holds up the next chunk's admission"
    assert "chunk_02.ahead" not in alpha["tasks"], "the last chunk has no next chunk to train ahead"
    # what ends the job's chance of admission: its validation failed, the next train task failed or skipped
    assert alpha["watched"]["chunk_01.ahead"] == ["chunk_01.validate", "chunk_02.train"]
    assert set(alpha["watched"]["chunk_01.ahead"]) <= set(alpha["tasks"])


def test_a_scheduled_spec_is_a_scheduled_dag_with_one_trainer_pool(parsed):
    dags = parsed["cases"]["scheduled"]
    weekly, manual = dags["relay_weekly"], dags["relay_manual"]
    assert (weekly["schedule"], weekly["catchup"], weekly["start_date"]) == ("@weekly", False, "2025-01-06T00:00:00+00:00")
    assert weekly["max_active_runs"] == 1, "one GPU cluster is shared"
    assert manual["schedule"] == "None"
    assert weekly["pool"] == manual["pool"] == "relay_trainers"


def test_an_unknown_date_template_makes_no_dag(parsed):
    dags = parsed["cases"]["unknown_template"]
    assert "relay_typo" not in dags and dags["relay_spec_errors"]


def test_params_form_is_typed_described_and_every_field_optional(parsed):
    params = parsed["cases"]["one_spec"]["relay_alpha"]["params"]
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


def test_a_bad_spec_makes_no_dag_and_shows_its_error(parsed):
    dags = parsed["cases"]["good_and_bad"]
    assert "relay_good" in dags and "relay_bad" not in dags
    assert dags["relay_spec_errors"]["tasks"] == ["show_errors"]


def test_the_shipped_specs_all_load(parsed):
    dags = parsed["cases"]["shipped"]
    assert "relay_spec_errors" not in dags and "relay_demo" in dags


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
