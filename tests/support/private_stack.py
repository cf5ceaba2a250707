"""Servers of a fault case's own: a Ray cluster (a head, and a worker node when asked) and an S3 server
(SeaweedFS), on free ports, under the case's folder. The session's Ray head and S3 server are shared by
every test running alongside, so a case that kills or stops a server kills its own. (`ray stop` would
stop every Ray on the machine: a node here is killed by its own processes, found by its temp dir.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import psutil

from relay.devstack import stack
from support.polling import wait_for
from support.ports import bindable, free_port, free_ports


@contextmanager
def stack_env(overrides: dict[str, str]):
    """os.environ with overrides, for the while: relay.devstack.stack reads its ports and state folder from it."""
    saved = {k: os.environ.get(k) for k in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class PrivateS3:
    """SeaweedFS started and killed through relay.devstack.stack, on ports and a data folder of its own."""

    PORTS = (
        "RELAY_S3_PORT",
        "RELAY_S3_GRPC_PORT",
        "RELAY_WEED_MASTER_PORT",
        "RELAY_WEED_MASTER_GRPC_PORT",
        "RELAY_WEED_VOLUME_PORT",
        "RELAY_WEED_VOLUME_GRPC_PORT",
        "RELAY_WEED_FILER_PORT",
        "RELAY_WEED_FILER_GRPC_PORT",
    )

    def __init__(self, folder: Path):
        ports = free_ports(len(self.PORTS))  # distinct: free_port() per key can hand one out twice
        self.env = {"RELAY_STACK_DIR": str(folder), **{p: str(port) for p, port in zip(self.PORTS, ports, strict=True)}}
        self.endpoint = f"http://127.0.0.1:{self.env['RELAY_S3_PORT']}"

    def start(self) -> None:
        with stack_env(self.env):
            stack.s3_start()

    def kill(self) -> None:
        """SIGKILL the server, as a crash would: its data folder stays, so a restart has every object."""
        with stack_env(self.env):
            stack.kill_process("s3")

    def answers(self) -> bool:
        return stack._http_ok(self.endpoint)

    def client_env(self) -> dict[str, str]:
        """What Airflow's hooks and the CLI read: the aws_default connection and AWS_ENDPOINT_URL."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AIRFLOW_CONN_AWS_DEFAULT": json.dumps(
                {
                    "conn_type": "aws",
                    "login": stack.LOCAL_S3_ENV["AWS_ACCESS_KEY_ID"],
                    "password": stack.LOCAL_S3_ENV["AWS_SECRET_ACCESS_KEY"],
                    "extra": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
                }
            ),
        }


class PrivateRay:
    """A Ray cluster on this machine: `start_head()`, `add_worker(resources)`, `kill_head()` (the head
    node dies: its processes and everything they started; a worker node's processes live on)."""

    def __init__(self, folder: Path, num_cpus: int = 1):
        self.folder = folder
        self.dashboard_port = free_port()
        self.address = f"http://127.0.0.1:{self.dashboard_port}"
        self.tag = uuid.uuid4().hex[:6]
        self.num_cpus = num_cpus
        self.gcs_port: int | None = None
        self.client_port: int | None = None  # the head's Ray client server
        self.nodes: list[str] = []  # temp dirs, one per node started (short: Ray's socket paths live there)

    def _port_besides(self) -> int:
        """A free port other than the ones this cluster has chosen but may not have bound yet (the dashboard's and
        the GCS's before the head starts, the client server's): free_port() alone can hand one of those out again."""
        chosen = {self.gcs_port, self.dashboard_port, self.client_port}
        return next(port for port in free_ports(len(chosen) + 1) if port not in chosen)

    def _start(self, role: str, args: list[str], resources: dict | None) -> str:
        temp = f"/tmp/rf-{self.tag}-{role}{len(self.nodes)}"
        ports = 24000 + 500 * (len(self.nodes) % 2)  # worker ports outside the session head's 11000-11999
        cmd = [
            *stack.ray_cli(),
            "start",
            *args,
            f"--num-cpus={self.num_cpus}",
            "--disable-usage-stats",
            "--node-ip-address=127.0.0.1",
            f"--temp-dir={temp}",
            f"--min-worker-port={ports}",
            f"--max-worker-port={ports + 499}",
            f"--dashboard-agent-listen-port={self._port_besides()}",
            *([f"--resources={json.dumps(resources)}"] if resources else []),
        ]
        log = self.folder / f"ray-{role}{len(self.nodes)}.log"
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as out:
            rc = subprocess.call(
                cmd, cwd=self.folder, env=stack.ray_env(), stdout=out, stderr=subprocess.STDOUT, timeout=180
            )
        if rc != 0:
            raise RuntimeError(f"`ray start` ({role}) failed (exit {rc}):\n{log.read_text()[-3000:]}")
        self.nodes.append(temp)
        return temp

    def start_head(self, resources: dict | None = None, new_gcs_port: bool = False) -> None:
        """A head on the same dashboard port (what the Airflow connection names); its GCS on the port of
        the last head, unless new_gcs_port (a replacement head somewhere else: the old nodes never
        reach it)."""
        if self.gcs_port is None or new_gcs_port:
            self.gcs_port = self._port_besides()
        self.client_port = self._port_besides()
        if self.nodes:  # a head that comes back: the killed one's sockets may still be closing
            for port in (self.dashboard_port, self.gcs_port):
                wait_for(lambda p=port: bindable(p), 30, f"port {port} of the killed head to be free again")
        self._start(
            "h",
            [
                "--head",
                f"--port={self.gcs_port}",
                f"--dashboard-port={self.dashboard_port}",
                "--dashboard-host=127.0.0.1",
                "--include-dashboard=true",
                f"--ray-client-server-port={self.client_port}",
            ],
            resources,
        )
        stack._wait_http(f"{self.address}/api/version", 120, "private Ray head")
        self.head = self.nodes[-1]

    def add_worker(self, resources: dict) -> None:
        self._start("w", [f"--address=127.0.0.1:{self.gcs_port}"], resources)

    def node_pids(self, temp_dir: str) -> set[int]:
        """A node's processes (their command lines name its temp dir) and all they started."""
        pids = set()
        for p in psutil.process_iter(["cmdline"]):
            try:
                if any(temp_dir in part for part in p.info["cmdline"] or ()):
                    pids.add(p.pid)
                    pids.update(c.pid for c in p.children(recursive=True))
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return {pid for pid in pids if _running(pid)}

    def kill_node(self, temp_dir: str) -> None:
        """SIGKILL a node's processes and all they started; return once every one of them is gone."""
        pids = self.node_pids(temp_dir)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.time() + 20
        while any(_running(p) for p in pids | self.node_pids(temp_dir)) and time.time() < deadline:
            time.sleep(0.1)

    def kill_head(self) -> None:
        self.kill_node(self.head)

    def stop(self) -> None:
        for temp in self.nodes:
            self.kill_node(temp)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed process nobody has reaped yet is gone for good)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def node_port_base(nodes: int) -> int:
    """A RELAY_RAY_NODE_PORT_BASE whose nodes' raylet ports are all free now."""
    import socket

    from relay.jobs.local_head import NODE_PORT_OPTIONS

    for base in range(14000, 24000, stack.NODE_PORT_BLOCK * nodes):  # below the OS's ephemeral ports
        wanted = [base + (n * stack.NODE_PORT_BLOCK) + i for n in range(nodes) for i in range(len(NODE_PORT_OPTIONS))]
        held = []
        try:
            for port in wanted:
                s = socket.socket()
                held.append(s)
                s.bind(("0.0.0.0", port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise AssertionError("no free block of ports for the worker nodes")


@contextmanager
def node_stack_env(folder: Path, nodes: int = 2):
    """The environment of a local stack of its own (`relay stack up --ray-nodes N`): its folder, its head's ports and
    its nodes'; set in os.environ for the while and yielded. On the way out its Ray nodes are stopped and their
    temp dirs removed (the caller starts what it needs: `relay stack up --no-airflow --ray-nodes N`)."""
    import shutil

    from support.helpers import relay_cli

    env = {"RELAY_STACK_DIR": str(folder), "RELAY_RAY_NODE_PORT_BASE": str(node_port_base(nodes))}
    head = [key for key in stack.RAY_HEAD_PORTS.values() if "WORKER_PORT" not in key]
    env.update(zip(head, map(str, free_ports(len(head))), strict=True))
    env.update(RELAY_RAY_MIN_WORKER_PORT="0", RELAY_RAY_MAX_WORKER_PORT="0")  # the head's workers: ports the OS picks
    with stack_env(env):
        try:
            yield env
        finally:
            try:
                relay_cli("stack", "down", env=env, timeout=120)
            finally:  # the command could not run (a broken fork server): its nodes are stopped all the same
                stack.ray_stop()
            for node in range(nodes + 1):  # the nodes' temp dirs under /tmp, named after this stack's folder
                shutil.rmtree(stack.ray_temp_dir(node), ignore_errors=True)
