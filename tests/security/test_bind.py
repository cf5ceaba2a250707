"""The local stack listens on 127.0.0.1 only where Relay decides it: the S3 server (every SeaweedFS port),
the Ray dashboard (the Jobs API: whoever reaches it runs code) and the Airflow API. Read from the
kernel's table of listening sockets of the session's running services, not from their flags.

Ray's own gRPC ports (GCS, raylet, object manager, workers) and Airflow's log servers bind every
interface whatever they are told; docs/SECURITY.md lists them with what to do on a shared host."""

from __future__ import annotations

import ipaddress

import psutil
import pytest

from relay.devstack import stack
from support.private_stack import PrivateS3


def listening(port: int) -> list[str]:
    """The local addresses of every listening TCP socket on `port`."""
    return sorted(
        {
            c.laddr.ip
            for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
        }
    )


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    if getattr(addr, "ipv4_mapped", None):
        addr = addr.ipv4_mapped
    return addr.is_loopback


@pytest.mark.services
def test_every_s3_port_listens_on_loopback_only(s3_server):
    ports = stack.ports()
    seen = {name: listening(ports[name]) for name in PrivateS3.PORTS}
    assert seen["RELAY_S3_PORT"], "the session's S3 server is not listening"
    exposed = {name: ips for name, ips in seen.items() if any(not is_loopback(ip) for ip in ips)}
    assert not exposed, f"S3 ports listening beyond loopback: {exposed}"


@pytest.mark.services
def test_the_ray_dashboard_listens_on_loopback_only(ray_address):
    ips = listening(stack.ports()["RELAY_RAY_DASHBOARD_PORT"])
    assert ips, f"nothing listens on the Ray dashboard port ({ray_address})"
    assert all(is_loopback(ip) for ip in ips), f"the Ray dashboard (Jobs API) listens on {ips}"


def test_the_airflow_api_is_told_to_bind_loopback(tmp_path):
    """The listening socket itself is checked by tests/e2e, which runs an API server."""
    env = stack.airflow_env(tmp_path / "home")
    assert env["AIRFLOW__API__HOST"] == "127.0.0.1" and env["AIRFLOW__API__BASE_URL"].startswith("http://127.0.0.1:")
