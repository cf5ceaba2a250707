"""The Ray cluster and the S3 store a run reaches, built from what a front-end found: an Airflow connection's
address and S3 client, or a command's --ray-address and the environment's AWS settings."""

from __future__ import annotations

from typing import Any

from relay.jobs.ray_jobs import RayJobs
from relay.s3.store import CheckpointStore, client_config, parse_uri, s3_client, store_for_spec, upload_args
from relay.spec.run_spec import RunSpec

__all__ = ["RayJobs", "check_s3_uri", "ray_jobs", "s3_config", "spec_store", "store_at"]


def ray_jobs(address: str) -> RayJobs:
    """The Jobs API of the Ray cluster at `address` (its dashboard, http://HOST:8265)."""
    return RayJobs(address)


def s3_config(*, probe: bool = False) -> Any:
    """botocore's client config for checkpoint transfers; `probe`: one quick try (an alert asking whether a step is
    published must not wait on a dead S3)."""
    config = client_config()
    if probe:
        from botocore.config import Config

        config = config.merge(Config(connect_timeout=3, read_timeout=5, retries={"mode": "standard", "max_attempts": 1}))
    return config


def spec_store(spec: RunSpec, client: Any = None) -> CheckpointStore:
    """The spec's checkpoint store (its s3 section), on `client` (default: one from the environment)."""
    return store_for_spec(spec, client)


def store_at(uri: str, *, sse: str | None = None, kms_key_id: str | None = None, acl: str | None = None) -> CheckpointStore:
    """A store on s3://BUCKET/PREFIX; an upload's server-side encryption, KMS key and ACL go with every object."""
    return CheckpointStore(s3_client(), uri, extra_args=upload_args(sse, kms_key_id, acl))


def check_s3_uri(value: str) -> None:
    """Raise UsageError unless `value` is s3://BUCKET/PREFIX."""
    parse_uri(value)
