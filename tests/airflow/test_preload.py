"""The scheduler's preload (relay.airflow.preload): only `airflow scheduler` with the LocalExecutor imports the
tasks' modules, RELAY_PRELOAD=0 turns it off, and the stack writes its settings file only where there is none."""

from __future__ import annotations

from types import SimpleNamespace

from relay.airflow import preload
from relay.devstack import stack


def test_only_a_local_executor_scheduler_preloads(monkeypatch):
    imported = []
    monkeypatch.setattr(preload, "importlib", SimpleNamespace(import_module=imported.append))
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", "LocalExecutor")
    assert preload.preload_task_modules(["airflow", "dags", "test", "relay_demo"]) == []
    assert preload.preload_task_modules(["airflow", "triggerer"]) == [] and imported == []
    monkeypatch.setenv("RELAY_PRELOAD", "0")
    assert preload.preload_task_modules(["airflow", "scheduler"]) == []
    monkeypatch.delenv("RELAY_PRELOAD")
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", "CeleryExecutor")
    assert preload.preload_task_modules(["airflow", "scheduler"]) == []
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", "LocalExecutor")
    assert preload.preload_task_modules(["airflow", "scheduler"]) == list(preload.TASK_MODULES) == imported


def test_the_stack_writes_its_local_settings_only_where_there_are_none(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(stack, "airflow_cli", lambda env, *args, **kw: calls.append(args))
    monkeypatch.setattr(stack, "ensure_pools", lambda env: [])
    monkeypatch.setattr(stack, "_wait_http", lambda *a, **kw: None)
    settings = tmp_path / "home" / "config" / "airflow_local_settings.py"
    stack.airflow_start({"AIRFLOW_HOME": str(tmp_path / "home")}, components=())
    assert "preload_task_modules()" in settings.read_text() and calls == [("db", "migrate")]
    settings.write_text("# a team's own\n")
    stack.airflow_start({"AIRFLOW_HOME": str(tmp_path / "home")}, components=())
    assert settings.read_text() == "# a team's own\n"
