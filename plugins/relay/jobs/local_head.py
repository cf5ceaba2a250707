"""A Ray head of one command's own (`relay train` with no cluster running), and its watchdog.

    with local_head(ray_cli, env, num_gpus=1) as address:   # http://127.0.0.1:<dashboard port>
        RayJobs(address).submit(...)

The head runs on ports nobody else uses: every port `ray start` opens is given, each one the OS found
free (and none of `avoid`: the local stack's), and its workers bind ports the OS picks
(--min-worker-port=0 --max-worker-port=0), so it never meets the stack's head or another command's.
Its temp dir (--temp-dir) is its own too, under /tmp (Ray's socket paths live there and must stay
short), and so is its `ray_current_cluster` file: `ray.init("auto")` elsewhere never finds it.

It ends with the command, however the command ends:
  * normally, or by an exception (Ctrl-C, SIGTERM turned into one): the context manager stops it;
  * by SIGKILL: a watchdog (`python -m relay.jobs.local_head --watch PID ...`), started before the
    head, detached in a session of its own (a Ctrl-C in the terminal does not reach it), polls the
    command's pid and stops the head once the command is gone.
Ray daemonizes its processes (`ray start` exits; gcs_server, raylet and the dashboard are re-parented
to init; a job's driver runs in a session of its own), so neither a process group nor PR_SET_PDEATHSIG
on `ray start` reaches them all. A head's processes are found instead by what marks them: the session
`ray start` began (its daemons stay in it; SID_FILE), the environment variable MARKER (every process
of the head inherits it, a job's driver too, which runs in a session of its own), the temp dir in
their command line, and everything these started. `ray stop` is never used: it stops every Ray on the
machine.

Imports nothing heavy at module level (no ray, no psutil): the CLI imports it on every start.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from relay.common.processes import runs, started_at

MARKER = "RELAY_LOCAL_HEAD"  # in the environment of every process of a private head: its temp dir's name
JOB_FILE = "relay-job.json"  # in the head's temp dir: the job to stop when the command is gone
SID_FILE = "ray-start.sid"  # in the head's temp dir: the session of `ray start` and the daemons it leaves
WATCH_POLL_S = 0.5
WATCHING = "watching"  # the watchdog's first line: it is ready
START_TIMEOUT_S = 180

# Every port of a node that `ray start` opens, by its option (a worker node's: `ray start --address`).
NODE_PORT_OPTIONS = (
    "node-manager-port",
    "object-manager-port",
    "runtime-env-agent-port",
    "dashboard-agent-grpc-port",
    "dashboard-agent-listen-port",
    "metrics-export-port",
)
# Every port `ray start --head` opens, by its option; min/max worker ports come as 0: the OS picks each one.
PORT_OPTIONS = ("port", "dashboard-port", "ray-client-server-port", *NODE_PORT_OPTIONS)
WORKER_PORT_OPTIONS = ("min-worker-port", "max-worker-port")


class HeadError(RuntimeError):
    """A private head that could not be started."""


# ------------------------------------------------------------------------------------ the head


def head_command(
    ray_cli: list[str],
    ports: dict[str, int],
    *,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    temp_dir: Path | str | None = None,
) -> list[str]:
    """`ray start --head` on 127.0.0.1 with its dashboard, on `ports` (option -> port: PORT_OPTIONS and
    WORKER_PORT_OPTIONS). The local stack's head (relay.devstack.stack.ray_start) and a private one
    both start from here."""
    missing = [o for o in (*PORT_OPTIONS, *WORKER_PORT_OPTIONS) if o not in ports]
    if missing:
        raise ValueError(f"no port for {', '.join(missing)}")
    return [
        *ray_cli,
        "start",
        "--head",
        *([f"--num-cpus={num_cpus}"] if num_cpus is not None else []),
        "--disable-usage-stats",
        "--node-ip-address=127.0.0.1",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        *(f"--{option}={ports[option]}" for option in (*PORT_OPTIONS, *WORKER_PORT_OPTIONS)),
        *([f"--temp-dir={temp_dir}"] if temp_dir is not None else []),
        *([f"--num-gpus={num_gpus}"] if num_gpus is not None else []),
    ]


def node_command(
    ray_cli: list[str],
    gcs_address: str,
    ports: dict[str, int],
    *,
    num_cpus: int,
    num_gpus: int | None,
    temp_dir: Path | str,
    labels: dict[str, str],
    object_store_bytes: int,
) -> list[str]:
    """`ray start --address=GCS`: one more node of the cluster on this host, its own raylet on `ports` (option -> port:
    NODE_PORT_OPTIONS and WORKER_PORT_OPTIONS), its own temp dir (so that it can be lost alone: its processes are
    found by it), its logical CPUs and GPUs, node labels, and a small object store (several share the host's memory)."""
    missing = [o for o in (*NODE_PORT_OPTIONS, *WORKER_PORT_OPTIONS) if o not in ports]
    if missing:
        raise ValueError(f"no port for {', '.join(missing)}")
    return [
        *ray_cli,
        "start",
        f"--address={gcs_address}",
        f"--num-cpus={num_cpus}",
        *([f"--num-gpus={num_gpus}"] if num_gpus is not None else []),
        "--disable-usage-stats",
        "--node-ip-address=127.0.0.1",
        f"--object-store-memory={object_store_bytes}",
        f"--labels={','.join(f'{k}={v}' for k, v in labels.items())}",
        *(f"--{option}={ports[option]}" for option in (*NODE_PORT_OPTIONS, *WORKER_PORT_OPTIONS)),
        f"--temp-dir={temp_dir}",
    ]


def run_ray_start(
    cmd: list[str], env: dict[str, str], cwd: Path, log: Path, sid_file: Path | None = None, timeout: float = START_TIMEOUT_S
) -> None:
    """Run `ray start` (it returns once the head's daemons are up), its output in `log`. With sid_file: in a
    session of its own, whose id (every daemon of the head stays in it) is written there."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=sid_file is not None
        )
        if sid_file is not None:
            sid_file.write_text(str(proc.pid))  # a new session's id is its leader's pid
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = None
        except BaseException:  # Ctrl-C while it starts: do not leave `ray start` behind
            proc.kill()
            proc.wait()
            raise
    if rc != 0:
        raise RuntimeError(
            f"`ray start` failed ({f'exit {rc}' if rc is not None else f'no answer in {timeout:.0f}s'}); see {log}"
        )


def pick_ports(avoid: Iterable[int] = ()) -> dict[str, int]:
    """A free port for each of PORT_OPTIONS, all different and none in `avoid`; worker ports 0 (the OS's)."""
    avoid = set(avoid)
    held: list[socket.socket] = []  # kept bound until all are picked, so that no two are the same
    out: dict[str, int] = {}
    try:
        while len(out) < len(PORT_OPTIONS):
            s = socket.socket()
            held.append(s)
            s.bind(("0.0.0.0", 0))  # free on every address: Ray binds some of them on all of them
            port = s.getsockname()[1]
            if port not in avoid:
                out[PORT_OPTIONS[len(out)]] = port
    finally:
        for s in held:
            s.close()
    return {**out, **{o: 0 for o in WORKER_PORT_OPTIONS}}


def _answers(url: str, timeout: float = 2) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status < 500
    except urllib.error.HTTPError as e:
        return e.code < 500
    except Exception:  # noqa: BLE001 - refused, reset, timed out: not (yet) answering
        return False


@dataclass
class Guarded:
    """A folder of this process's (a private head's temp dir) that a watchdog looks after: once this
    process is gone, it stops the job named by watch_job, every process of the head in the folder, and
    removes the folder."""

    folder: Path
    address: str = ""  # the Jobs API of the cluster the job runs on (a private head's own dashboard)
    watchdog_pid: int = 0

    def watch_job(self, address: str, submission_id: str) -> None:
        """Name the job the watchdog stops (through the Jobs API) if this process dies without a word: on a
        cluster that is not this process's own, the head's end does not end the job."""
        tmp = self.folder / f".{JOB_FILE}.tmp"
        tmp.write_text(json.dumps({"address": address, "submission_id": submission_id}))
        os.replace(tmp, self.folder / JOB_FILE)


@dataclass
class LocalHead(Guarded):
    ports: dict[str, int] = field(default_factory=dict)  # `ray start` option -> port


@contextmanager
def guarded(address: str = "") -> Iterator[Guarded]:
    """A new folder under /tmp, and a watchdog that cleans up after this process if it dies (see Guarded);
    on the way out, what a head in it started is stopped and the folder is removed. address: the cluster
    a job of watch_job runs on, when it is not a head in the folder."""
    folder = Path(tempfile.mkdtemp(prefix="relay-head-", dir="/tmp"))  # short: Ray's socket paths live in it
    watchdog = None
    try:
        watchdog = start_watchdog(os.getpid(), folder)
        yield Guarded(folder, address, watchdog.pid)
    finally:
        stop_head(folder, exclude={watchdog.pid} if watchdog else ())
        if watchdog:
            _end(watchdog)
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def local_head(
    ray_cli: list[str],
    env: dict[str, str],
    *,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    avoid: Iterable[int] = (),
    start_timeout: float = START_TIMEOUT_S,
    attempts: int = 2,
    say=None,
) -> Iterator[LocalHead]:
    """A Ray head of this process's own, on free ports; yields it (.address: its dashboard, the Jobs API) and
    stops it on the way out. A watchdog stops it too if this process dies without a word (SIGKILL).

    ray_cli: how to run Ray's CLI (its interpreter is the one the head and its jobs run on); env: the
    head's environment (a job's driver inherits it); num_gpus: logical GPUs to advertise (None: Ray
    counts them); avoid: ports never to take (the local stack's)."""
    with guarded() as guard:
        temp = guard.folder
        for attempt in range(1, attempts + 1):
            ports = pick_ports(avoid)
            cmd = head_command(ray_cli, ports, num_cpus=num_cpus, num_gpus=num_gpus, temp_dir=temp)
            if say:
                say(
                    f"starting a private Ray head: dashboard port {ports['dashboard-port']}, GCS port {ports['port']}, "
                    f"temp dir {temp}"
                )
            address = f"http://127.0.0.1:{ports['dashboard-port']}"
            try:
                run_ray_start(
                    cmd,
                    {**env, MARKER: temp.name},
                    cwd=temp,
                    log=temp / "ray-start.log",
                    sid_file=temp / SID_FILE,
                    timeout=start_timeout,
                )
                deadline = time.time() + start_timeout
                while not _answers(f"{address}/api/version"):
                    if time.time() > deadline:
                        raise RuntimeError(f"its dashboard did not answer at {address} within {start_timeout:.0f}s")
                    time.sleep(0.5)
                break
            except RuntimeError as e:  # a port taken between the pick and Ray's bind, say: once more, elsewhere
                log = _tail(temp / "ray-start.log")
                stop_head(temp, exclude={guard.watchdog_pid})
                if attempt == attempts:
                    raise HeadError(f"could not start a private Ray head: {e}\n{log}") from None
        yield LocalHead(temp, address, guard.watchdog_pid, ports)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def head_processes(temp_dir: Path | str, exclude: Iterable[int] = ()) -> list:
    """The live processes of the head in temp_dir (psutil.Process): those in the session `ray start` began
    (SID_FILE), with its MARKER in their environment or its temp dir in their command line, and all
    they started."""
    import psutil

    token = Path(temp_dir).name
    try:
        sid = int((Path(temp_dir) / SID_FILE).read_text())
    except (OSError, ValueError):
        sid = None
    temp_dir = str(temp_dir)
    skip = {os.getpid(), *exclude}
    found: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["cmdline"]):
        if p.pid in skip:
            continue
        try:
            hit = any(temp_dir in part for part in p.info["cmdline"] or ())
            if not hit and sid is not None:
                hit = _sid(p.pid) == sid
            if not hit:
                hit = p.environ().get(MARKER) == token
            if hit:
                found[p.pid] = p
                found.update((c.pid, c) for c in p.children(recursive=True))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return [p for pid, p in found.items() if pid not in skip and _alive(p)]


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def stop_head(temp_dir: Path | str, grace_s: float = 1, exclude: Iterable[int] = (), timeout: float = 30) -> int:
    """Stop the head in temp_dir and everything it started: SIGTERM, then SIGKILL after grace_s (gcs_server
    and raylet take longer than that to go on SIGTERM, and a private head keeps nothing worth waiting
    for once its job has ended); looks again until none is left (a raylet may start a worker meanwhile).
    Returns how many processes it signalled."""
    import psutil

    signalled: set[int] = set()
    deadline = time.time() + timeout
    killing = grace_s <= 0
    term_until = time.time() + grace_s
    while time.time() < deadline:
        procs = head_processes(temp_dir, exclude)
        if not procs:
            break
        if not killing and time.time() >= term_until:
            killing = True
        for p in procs:
            try:
                p.send_signal(signal.SIGKILL if killing else signal.SIGTERM)
                signalled.add(p.pid)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=0.5)
    return len(signalled)


def _alive(p) -> bool:
    import psutil

    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ------------------------------------------------------------------------------------ the watchdog


def start_watchdog(pid: int, temp_dir: Path, ready_timeout: float = 30) -> subprocess.Popen:
    """`python -m relay.jobs.local_head --watch PID --temp-dir DIR`, detached (a session of its own, so a
    Ctrl-C in the terminal does not reach it; its output in DIR/watchdog.log): once pid is gone, it stops
    the job named in DIR/JOB_FILE and the head in temp_dir. Returns once it watches."""
    created = started_at(pid)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(_package_root()), os.environ.get("PYTHONPATH")) if p)}
    log_path = temp_dir / "watchdog.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "relay.jobs.local_head",
                "--watch",
                str(pid),
                "--created",
                repr(created),
                "--temp-dir",
                str(temp_dir),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            env=env,
            cwd=temp_dir,
        )
    deadline = time.time() + ready_timeout
    while WATCHING not in log_path.read_text(errors="replace"):
        if proc.poll() is not None or time.time() > deadline:
            _end(proc)
            raise HeadError(f"the watchdog of {temp_dir} did not start:\n{_tail(log_path)}")
        time.sleep(0.05)
    return proc


def _package_root() -> Path:
    return Path(__file__).resolve().parents[2]


def stop_job_over_http(address: str, submission_id: str, timeout: float = 10) -> bool:
    req = urllib.request.Request(f"{address.rstrip('/')}/api/jobs/{submission_id}/stop", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status < 400
    except Exception:  # noqa: BLE001 - the head may be gone already
        return False


def watch(pid: int, created: float, temp_dir: Path, poll_s: float = WATCH_POLL_S) -> int:
    """The watchdog's loop: once pid is gone, stop the job named in the job file, then the head, and
    remove its temp dir. Ends at once on SIGTERM (the owner stopping the head itself)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    print(f"{time.strftime('%H:%M:%S')} {WATCHING} process {pid}", flush=True)
    while runs(pid, created):
        time.sleep(poll_s)
    print(f"{time.strftime('%H:%M:%S')} process {pid} is gone: stopping its Ray job and head in {temp_dir}", flush=True)
    job_file = temp_dir / JOB_FILE
    if job_file.exists():
        try:
            job = json.loads(job_file.read_text())
            print(f"stop job {job['submission_id']}: {stop_job_over_http(job['address'], job['submission_id'])}", flush=True)
        except (OSError, ValueError, KeyError) as e:
            print(f"job file unreadable: {e}", flush=True)
    n = stop_head(temp_dir)
    print(f"stopped {n} process(es) of the head; removing {temp_dir}", flush=True)
    shutil.rmtree(temp_dir, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m relay.jobs.local_head", description="watchdog of a private Ray head: stops it once PID is gone"
    )
    p.add_argument("--watch", type=int, required=True, metavar="PID")
    p.add_argument("--created", type=float, required=True, help="PID's start time (psutil's create_time)")
    p.add_argument("--temp-dir", type=Path, required=True)
    args = p.parse_args(argv)
    return watch(args.watch, args.created, args.temp_dir)


if __name__ == "__main__":
    sys.exit(main())
