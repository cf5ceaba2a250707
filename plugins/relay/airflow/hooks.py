"""RayJobsHook: the Ray cluster an Airflow connection names (default `relay_ray`), built lazily."""

from __future__ import annotations

from functools import cached_property

from airflow.sdk import BaseHook

from relay.ops import connections
from relay.ops.connections import RayJobs


class RayJobsHook(BaseHook):
    """Reach a Ray cluster's Jobs API. Connection: `http://HOST:PORT` of the Ray dashboard.

    The connection's extra may carry {"address": "http://..."} to give the address whole, and
    {"dashboard_url": "https://..."} for the links people follow to a job's page.
    """

    conn_name_attr = "ray_conn_id"
    default_conn_name = "relay_ray"
    conn_type = "http"
    hook_name = "Ray Jobs API"

    def __init__(self, ray_conn_id: str = default_conn_name):
        super().__init__()
        self.ray_conn_id = ray_conn_id

    @cached_property
    def address(self) -> str:
        conn = self.get_connection(self.ray_conn_id)
        if address := conn.extra_dejson.get("address"):
            return address
        scheme = "https" if conn.conn_type == "https" or conn.schema == "https" else "http"
        return f"{scheme}://{conn.host}:{conn.port or 8265}"

    @cached_property
    def dashboard_url(self) -> str:
        """The Ray dashboard as a person's browser reaches it: the extra's "dashboard_url" where the
        workers reach the Jobs API by another address (a cluster-internal name), else the same address."""
        return self.get_connection(self.ray_conn_id).extra_dejson.get("dashboard_url") or self.address

    @cached_property
    def jobs(self) -> RayJobs:
        return connections.ray_jobs(self.address)


def checkpoint_store(spec, *, probe: bool = False):
    """The spec's checkpoint store through the Amazon provider's connection (None without an s3 section).

    probe: one quick try (an alert asking whether a step is published must not wait on a dead S3).
    """
    if spec.s3 is None:
        return None
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    config = connections.s3_config(probe=probe)
    return connections.spec_store(spec, S3Hook(aws_conn_id=spec.s3.conn_id, config=config).get_conn())
