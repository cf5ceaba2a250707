"""RayJobsHook: the Ray cluster an Airflow connection names (default `relay_ray`), built lazily."""

from __future__ import annotations

from functools import cached_property

from airflow.sdk import BaseHook

from relay.ray_jobs import RayJobs


class RayJobsHook(BaseHook):
    """Reach a Ray cluster's Jobs API. Connection: `http://HOST:PORT` of the Ray dashboard.

    The connection's extra may carry {"address": "http://..."} to give the address whole.
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
    def jobs(self) -> RayJobs:
        return RayJobs(self.address)
