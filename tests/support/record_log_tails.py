"""Record the log tails that tests/runs/test_failure_cause.py classifies, from real failures on a private Ray head
(Ray 2.60): `python tests/support/record_log_tails.py [verl]` (re)writes tests/support/log_tails/*.txt (with `verl`,
verl's alone).

Each file is what the train task reads of a failed chunk job: the driver's exit code (`exit_code: N`), Ray's job
message (it ends with the log's last lines) after a `--- message ---` line, and the log's last 200 lines (what the
trigger keeps) after a `--- log tail ---` line. The memory-monitor cases
run on a head whose memory-usage threshold is lowered, so that Ray kills what a node that runs out of host memory
would lose: a task that allocates (the job's driver reports it), or, below what the node already uses, the job's
own supervisor."""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "plugins"))

from relay.devstack import stack  # noqa: E402
from relay.jobs import local_head  # noqa: E402

OUT = ROOT / "tests" / "support" / "log_tails"
MESSAGE, TAIL = "--- message ---", "--- log tail ---"

JOBS = {
    # user code (a reward function) whose exception message mentions a preemption
    "ray_exception_mentions_preempted": (
        "def compute_score(answer):\n"
        "    raise RuntimeError('reward server unavailable: its spot node was preempted')\n"
        "compute_score('7')\n"
    ),
    # a worker (an actor) SIGKILLed from outside, as an OOM killer, a preemption or `ray stop --force` ends one
    "ray_actor_sigkilled": (
        "import os, signal, ray\n"
        "ray.init()\n"
        "@ray.remote(max_restarts=0, max_task_retries=0)\n"
        "class RolloutWorker:\n"
        "    def generate(self):\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "ray.get(RolloutWorker.remote().generate.remote())\n"
    ),
    # user code that cannot reach a service it calls
    "ray_user_connection_refused": (
        "import socket\n"
        "def fetch_reference(host, port):\n"
        "    return socket.create_connection((host, port), timeout=5)\n"
        "fetch_reference('127.0.0.1', 9)\n"
    ),
}

MEMORY_JOBS = {
    # a Ray task that Ray's memory monitor kills: the node ran out of host memory (another node, for the driver)
    "ray_memory_monitor_kill_task": (
        0.2,
        (
            "import ray, time\n"
            "ray.init()\n"
            "@ray.remote(max_retries=0)\n"
            "def rollout():\n"
            "    hog = bytearray(b'\\x01') * (6 * 2**30)\n"
            "    time.sleep(30)\n"
            "    return len(hog)\n"
            "ray.get(rollout.remote())\n"
        ),
    ),
    # the threshold below what the node already uses: Ray kills the job's supervisor actor itself
    "ray_memory_monitor_kill_supervisor": (0.01, "print('never reached')\n"),
}


VERL_REWARD = """\
import socket


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    # a reward model served over HTTP that is not up
    with socket.create_connection(("127.0.0.1", 9), timeout=5):
        return 0.0
"""


def record_verl() -> None:
    """verl 0.9.1's trainer (the CPU spec, one step) whose reward function cannot reach its reward server: the chunk's
    Ray job, submitted as `relay train` submits it, on a private head; its exit code, Ray's message and its log's
    tail, as the train task reads them."""
    import tempfile

    import yaml
    from ray.job_submission import JobSubmissionClient

    from relay.jobs import chunk_job
    from relay.jobs.ray_jobs import RayJobs
    from relay.preflight.prepare import prepare_run
    from relay.spec.run_spec import load_spec

    with tempfile.TemporaryDirectory() as tmp:
        reward = Path(tmp, "reward_client.py")
        reward.write_text(VERL_REWARD)
        spec = yaml.safe_load((ROOT / "include" / "runs" / "verl_tiny_cpu.yaml").read_text())
        spec["checkpoint_dir"] = str(Path(tmp, "ckpt"))
        spec["trainer"]["settings"]["overrides"] = [
            o if not o.startswith("reward.custom_reward_function.path=") else f"reward.custom_reward_function.path={reward}"
            for o in spec["trainer"]["settings"]["overrides"]
        ]
        path = Path(tmp, "spec.yaml")
        path.write_text(yaml.safe_dump(spec))
        loaded = load_spec(path, check_environment=False)
        run = prepare_run(loaded).run(loaded)
        with stack.private_ray_head(num_gpus=getattr(loaded.settings, "gpus", 1)) as head:
            sub = chunk_job.local_submission_id(run)
            chunk_job.submit_chunk(RayJobs(head.address), run, 1, sub, restore=False)
            client = JobSubmissionClient(head.address)
            while str(client.get_job_status(sub)) not in ("SUCCEEDED", "FAILED", "STOPPED"):
                time.sleep(1)
            info = client.get_job_info(sub)
            tail = "\n".join(client.get_job_logs(sub).splitlines()[-200:])
    (OUT / "verl_reward_connection_refused.txt").write_text(
        f"exit_code: {info.driver_exit_code}\n{MESSAGE}\n{info.message or ''}\n{TAIL}\n{tail}\n"
    )
    print(f"verl_reward_connection_refused: {info.status}, exit code {info.driver_exit_code}")


def main() -> int:
    from ray.job_submission import JobSubmissionClient

    if sys.argv[1:] == ["verl"]:  # only verl's (minutes of CPU), e.g. after a verl upgrade
        record_verl()
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    runs = [({}, JOBS)] + [
        ({"RAY_memory_usage_threshold": str(threshold), "RAY_memory_monitor_refresh_ms": "100"}, {name: code})
        for name, (threshold, code) in MEMORY_JOBS.items()
    ]
    for extra_env, jobs in runs:
        with local_head.local_head(
            stack.ray_cli(), {**stack.ray_env(local_s3=False), **extra_env}, num_cpus=2, num_gpus=0
        ) as head:
            client = JobSubmissionClient(head.address)
            for name, code in jobs.items():
                script = OUT / f".{name}.py"
                script.write_text(code)
                sub = client.submit_job(entrypoint=f"python {script.name}", runtime_env={"working_dir": str(OUT)})
                while str(client.get_job_status(sub)) not in ("SUCCEEDED", "FAILED", "STOPPED"):
                    time.sleep(0.5)
                info = client.get_job_info(sub)
                tail = "\n".join(client.get_job_logs(sub).splitlines()[-200:])
                (OUT / f"{name}.txt").write_text(
                    f"exit_code: {info.driver_exit_code}\n{MESSAGE}\n{info.message or ''}\n{TAIL}\n{tail}\n"
                )
                script.unlink()
                print(f"{name}: {info.status}, exit code {info.driver_exit_code}")
    record_verl()
    return 0


if __name__ == "__main__":
    sys.exit(main())
