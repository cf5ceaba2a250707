"""The Airflow assets of published checkpoints: one per training run (its S3 prefix), announced through
one alias per spec, on which the DAGs that evaluate checkpoints are scheduled."""

from __future__ import annotations

from airflow.sdk import Asset, AssetAlias

from relay.ops.runs import Run, RunSpec


def checkpoint_alias(spec: RunSpec) -> AssetAlias:
    """The spec's published checkpoints: each publication's asset event goes to its run's asset
    (run_checkpoints) through this alias, and DAGs that evaluate them are scheduled on the alias."""
    return AssetAlias(name=f"relay_{spec.name}_checkpoints")


def run_checkpoints(run: Run) -> Asset:
    """One training run's published checkpoints: its S3 prefix, named by it (its URI is the truth;
    Airflow keeps URIs without a trailing slash)."""
    assert run.spec.s3 is not None  # only specs that publish (have s3) have publish tasks
    uri = f"{run.spec.s3.uri.rstrip('/')}/{run.name}"
    return Asset(name=uri, uri=uri, group="relay")
