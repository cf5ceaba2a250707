"""The cause of a failed chunk, as the train task, the alerts and `relay train` classify it: from what Ray
and the job's log say (logs below are the real messages of Ray, torch, NCCL and Relay), and from real
processes that fail (a reward function that raises, a trainer that exhausts a memory limit)."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay.common.errors import SpecError
from relay.insights import doctor
from relay.runs import failure_cause as fc
from relay.runs.metrics import read_events
from relay.runs.run import Run
from relay.spec.run_spec import load_spec
from support.helpers import relay_cli, write_spec

RAY_FAILED = "Job entrypoint command failed with exit code {code}, last available logs (truncated to 20,000 chars):\n"

REWARD_TRACEBACK = """\
[relay] step 4 loss=0.12 reward_mean=0.31
Traceback (most recent call last):
  File "/work/relay/trainers/tiny_grpo/trainer.py", line 251, in train_step
    rewards = torch.tensor([self.score(task.decode_response(r.tolist()), i, step) for r, i in zip(resp, rows)])
  File "/work/rewards/arith.py", line 7, in compute_score
    raise ValueError(f"cannot score ground truth {ground_truth!r}")
ValueError: cannot score ground truth 'seven'
"""

CUDA_OOM = """\
  File "/usr/local/lib/python3.11/site-packages/torch/nn/modules/linear.py", line 125, in forward
    return F.linear(input, self.weight, self.bias)
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB \
of which 1.02 GiB is free. Including non-PyTorch memory, this process has 78.08 GiB memory in use.
"""

NCCL_WATCHDOG = """\
[rank3]:[E1201 10:01:02.123456 ProcessGroupNCCL.cpp:616] [Rank 3] Watchdog caught collective operation timeout: \
WorkNCCL(SeqNum=12, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600054 milliseconds before \
timing out.
"""


def test_an_exception_at_a_step_is_classified_with_its_signature_and_traceback():
    cause = fc.classify("FAILED", RAY_FAILED.format(code=1) + REWARD_TRACEBACK, "", 1, step=5)
    assert (cause.cause, cause.step) == (fc.EXCEPTION, 5)
    assert cause.signature == "ValueError: cannot score ground truth 'seven'"
    assert cause.evidence == [
        'File "/work/rewards/arith.py", line 7, in compute_score',
        "ValueError: cannot score ground truth 'seven'",
    ]
    report = cause.report()
    assert report.startswith("cause: exception at step 5, an exception in the training code")
    assert "what to do: read the traceback" in report and "arith.py" in report
    assert fc.policy(cause) == fc.RETRY


def test_an_exception_raised_in_a_ray_actor_keeps_its_own_type():
    log = (
        'Traceback (most recent call last):\n  File "/verl/trainer/ppo/ray_trainer.py", line 1200, in fit\n'
        "ray.exceptions.RayTaskError(KeyError): ray::WorkerDict.actor_rollout_compute_log_prob() "
        "(pid=123, ip=10.0.0.2)\n"
    )
    cause = fc.classify("FAILED", "", log, 1, step=3)
    assert cause.cause == fc.EXCEPTION and cause.signature.startswith("KeyError: ray::WorkerDict")


def test_out_of_memory_on_the_accelerator_stops_and_names_the_batch_size_keys():
    cause = fc.classify("FAILED", RAY_FAILED.format(code=1), "Traceback (most recent call last):\n" + CUDA_OOM, 1)
    assert cause.cause == fc.ACCELERATOR_OOM
    assert "CUDA out of memory" in cause.evidence[-1]
    assert fc.policy(cause) == fc.STOP, "the same batch size would run out of memory again"
    assert "ppo_micro_batch_size_per_gpu" in cause.todo


def test_a_collective_timeout_is_classified_as_one():
    cause = fc.classify("FAILED", "", NCCL_WATCHDOG, 1)
    assert cause.cause == fc.COLLECTIVE_TIMEOUT and fc.policy(cause) == fc.BACKOFF


@pytest.mark.parametrize("exit_code", [-9, 137])
def test_a_bare_sigkill_is_an_outside_kill_unless_the_oom_killer_acted(exit_code):
    killed = fc.classify("FAILED", RAY_FAILED.format(code=exit_code) + "[relay] step 3 loss=0.1\n", "", exit_code)
    assert killed.cause == fc.PREEMPTED and "SIGKILL" in killed.evidence[0]
    assert fc.policy(killed) == fc.RETRY
    oom = fc.classify("FAILED", "", "[relay] step 3 loss=0.1", exit_code, oom_kills=1)
    assert oom.cause == fc.HOST_OOM and "OOM killer" in oom.evidence[0]


def test_the_triggers_own_verdicts_and_relays_refusals_have_their_causes():
    assert fc.classify("STALLED", "no new step for 300s; job x stopped").cause == fc.STALLED
    assert fc.classify("TIMEOUT", "ran past the chunk's timeout").cause == fc.STALLED
    assert fc.classify("LOST", "job x is unknown to the cluster").cause == fc.PREEMPTED
    assert fc.classify("UNREACHABLE", "Ray Jobs API unreachable for 300s").cause == fc.INFRASTRUCTURE
    assert fc.classify("STOPPED", "Job was intentionally stopped.").cause == fc.PREEMPTED
    refused = fc.classify(
        "FAILED", "", "[relay] chunk 2 of run r failed: settings drifted\n[relay] cause: refused (DriftError)", 1
    )
    assert refused.cause == fc.REFUSED and fc.policy(refused) == fc.STOP
    assert refused.evidence[0].startswith("[relay] chunk 2 of run r failed")
    s3 = fc.classify("FAILED", "", "[relay] chunk 2 of run r failed: S3 down\n[relay] cause: infrastructure (StoreError)", 1)
    assert s3.cause == fc.INFRASTRUCTURE
    assert fc.classify("FAILED", "", "something odd", 1).cause == fc.UNKNOWN


def test_relays_errors_say_their_cause():
    from relay.common.errors import DiskFullError, LeaseLost, StoreError
    from relay.common.filelock import LockTimeout
    from relay.preflight.guard import DriftError

    assert [e.cause for e in (SpecError, LeaseLost, DriftError)] == [fc.REFUSED] * 3
    assert [e.cause for e in (StoreError, LockTimeout, DiskFullError)] == [fc.INFRASTRUCTURE] * 3


TAILS = Path(__file__).resolve().parents[1] / "support" / "log_tails"  # tests/support/record_log_tails.py


def recorded(name: str, step: int | None = 3, oom_nodes: list[str] | None = None) -> fc.Cause:
    """Classify a log tail recorded from a real failure (Ray 2.60, verl 0.9.1) as the train task does."""
    head, _, rest = (TAILS / f"{name}.txt").read_text().partition("\n--- message ---\n")
    message, _, tail = rest.partition("\n--- log tail ---\n")
    code = head.removeprefix("exit_code: ").strip()
    assert code.lstrip("-").isdigit() or code == "None", f"{name}.txt: its header is no exit code: {head!r}"
    exit_code = int(code) if code != "None" else None
    if oom_nodes is None:
        assert fc.could_be_oom_kill(message, tail, exit_code) == (name == "ray_actor_sigkilled"), name
    return fc.classify("FAILED", message, tail, exit_code, step=step, oom_nodes=oom_nodes)


def test_a_traceback_outranks_keywords_in_real_log_tails():
    """An exception in user code is an exception, whatever its message or type says: one that mentions a
    preemption, a ConnectionRefusedError of a reward function (in verl's reward workers, the chunk's traceback
    ends in verl's own RuntimeError), so that the same exception at the same step twice stops the retries."""
    preempted = recorded("ray_exception_mentions_preempted")
    assert preempted.cause == fc.EXCEPTION, preempted.report()
    assert preempted.signature == "RuntimeError: reward server unavailable: its spot node was preempted"
    refused = recorded("ray_user_connection_refused")
    assert refused.cause == fc.EXCEPTION and refused.signature.startswith("ConnectionRefusedError"), refused.report()
    verl = recorded("verl_reward_connection_refused", step=1)
    assert verl.cause == fc.EXCEPTION, verl.report()
    assert verl.signature.startswith("RuntimeError: Sync replay buffer selected terminal groups"), verl.signature
    for cause in (preempted, refused, verl):
        same = {"event": fc.EVENT, "cause": cause.cause, "step": cause.step, "signature": cause.signature}
        assert fc.repeats(cause, [same]), "the same exception at the same step twice: no more retries"


def test_a_killed_worker_is_preempted_unless_a_nodes_oom_kill_count_rose():
    """Ray's text for a SIGKILLed worker lists the OOM killer among "some common causes": no evidence. A node whose
    kernel OOM-kill count rose while the job ran is (tests/jobs/test_node_oom.py reads it on a real cluster)."""
    killed = recorded("ray_actor_sigkilled")
    assert killed.cause == fc.PREEMPTED and killed.signature.startswith("ActorDiedError"), killed.report()
    node = "node 10.0.0.7 (a1b2c3d4e5f6): the kernel's OOM killer ended 1 process(es) there while the job ran"
    oom = recorded("ray_actor_sigkilled", oom_nodes=[node])
    assert oom.cause == fc.HOST_OOM and oom.evidence[0] == node, oom.report()


def test_a_host_out_of_memory_on_another_node_is_read_from_rays_own_messages():
    """No cgroup of this host saw it: Ray's memory monitor killed a task of the job, or the job's supervisor."""
    for name in ("ray_memory_monitor_kill_task", "ray_memory_monitor_kill_supervisor"):
        cause = recorded(name)
        assert cause.cause == fc.HOST_OOM, cause.report()
        assert any("running low on memory" in line for line in cause.evidence), cause.evidence


def test_every_relay_error_says_whether_a_retry_can_help():
    """An explicit attribute on every error class, and on every bare RelayError raised; the job's cause line
    carries it, and the policy follows it: verl ending before the chunk's end is retried."""
    import ast
    import importlib
    import pkgutil

    import relay
    from relay.common.errors import RelayError

    for mod in pkgutil.walk_packages(relay.__path__, "relay."):
        if not mod.name.startswith(("relay.airflow", "relay.devstack", "relay.__main__")):
            importlib.import_module(mod.name)

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    undecided = [
        c.__qualname__
        for c in subclasses(RelayError)
        if c.__module__.startswith("relay.") and not isinstance(c.retry_helps, bool)
    ]
    assert not undecided, f"error classes that do not say whether a retry can help: {undecided}"
    bare = []
    for path in Path(relay.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "RelayError"
                and not any(k.arg == "retry_helps" for k in node.keywords)
            ):
                bare.append(f"{path.name}:{node.lineno}")
    assert not bare, f"RelayError raised without saying whether a retry can help: {bare}"

    ended = fc.classify(
        "FAILED",
        "",
        "[relay] chunk 2 of run r failed: verl ended at step 3, before the chunk's end "
        "step 4\n[relay] cause: unknown (ChunkEndedEarly; a retry can help)",
        1,
    )
    assert fc.policy(ended) != fc.STOP
    refused = fc.classify(
        "FAILED", "", "[relay] chunk 2 of run r failed: drifted\n[relay] cause: refused (DriftError; a retry cannot help)", 1
    )
    assert refused.cause == fc.REFUSED and fc.policy(refused) == fc.STOP


def test_the_same_exception_at_the_same_step_twice_is_deterministic():
    cause = fc.classify("FAILED", "", REWARD_TRACEBACK, 1, step=5)
    same = {"event": fc.EVENT, "cause": fc.EXCEPTION, "step": 5, "signature": cause.signature}
    assert fc.repeats(cause, [same])
    assert not fc.repeats(cause, [{**same, "step": 4}])
    assert not fc.repeats(cause, [{**same, "signature": "ValueError: another"}])
    assert not fc.repeats(fc.classify("FAILED", "", "", -9, step=5), [same])


def test_a_spec_sets_the_policy_of_a_cause_and_an_unknown_cause_is_refused(tmp_path):
    spec = load_spec(write_spec(tmp_path, **{"airflow.retry_on": {"preempted": "stop"}}), check_environment=False)
    assert fc.policy(fc.Cause(fc.PREEMPTED), spec.airflow.retry_on) == fc.STOP
    assert fc.policy(fc.Cause(fc.EXCEPTION), spec.airflow.retry_on) == fc.RETRY
    with pytest.raises(SpecError) as e:
        load_spec(write_spec(tmp_path, name="bad", **{"airflow.retry_on": {"oom": "stop"}}), check_environment=False)
    assert "airflow.retry_on" in str(e.value) and "host_oom" in str(e.value)


def test_the_oom_killers_count_is_read_from_the_cgroup_or_the_host(tmp_path):
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "cgroup").write_text("4:memory:/job/abc\n0::/\n")
    (tmp_path / "vmstat").write_text("pgfault 9\noom_kill 7\n")
    assert fc.cgroup_oom_kills(tmp_path / "nocgroup", tmp_path) == 7
    v1 = tmp_path / "cg" / "memory" / "job" / "abc"
    v1.mkdir(parents=True)
    (v1 / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    assert fc.cgroup_oom_kills(tmp_path / "cg", tmp_path) == 2


# ------------------------------------------------------------------------------ real processes

SMALL = {
    "trainer.settings.train_batch_size": 4,
    "trainer.settings.rollout_n": 2,
    "trainer.settings.ppo_mini_batch_size": 2,
}  # a step of seconds: these tests are about how it ends


def failed_training(tmp_path, env: dict, to_step: int = 3, **overrides):
    spec_path = write_spec(tmp_path, **SMALL, **overrides)
    run_dir = load_spec(spec_path, check_environment=False).run_dir("r")
    r = relay_cli("train", str(spec_path), "--to-step", str(to_step), "--run", "r", "--offline", env=env)
    assert r.returncode != 0, r.stdout[-2000:]
    attempt = [e for e in read_events(run_dir) if e["event"] == "chunk_start"][-1]["attempt"]
    return r, run_dir, attempt


def test_a_reward_function_that_raises_is_an_exception_at_its_step_and_repeats(tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if extra_info['global_step'] == 2:\n"
        "        raise ValueError(f'cannot score row {extra_info[\"index\"]}')\n"
        "    return float(solution_str == ground_truth)\n"
    )
    overrides = {"trainer.settings.custom_reward_function": {"path": str(reward)}}
    r, run_dir, attempt = failed_training(tmp_path, {}, **overrides)
    cause = fc.classify("FAILED", "", r.stdout + r.stderr, r.returncode, step=fc.step_of_failure(run_dir, attempt))
    assert (cause.cause, cause.step) == (fc.EXCEPTION, 2), cause.report()
    assert cause.signature.startswith("ValueError: cannot score row ")
    assert any("reward.py" in line for line in cause.evidence)
    fc.record_failure(run_dir, cause, chunk=1, attempt=attempt)

    # The next try: the same rows reach the reward function at the same step, and it raises the same way.
    r2, _, attempt2 = failed_training(tmp_path, {}, **overrides)
    again = fc.classify("FAILED", "", r2.stdout + r2.stderr, r2.returncode, step=fc.step_of_failure(run_dir, attempt2))
    assert again.signature == cause.signature and fc.repeats(again, fc.earlier_failures(run_dir, 1))
    fc.record_failure(run_dir, again, chunk=1, attempt=attempt2, policy=fc.STOP)

    # `relay doctor` names the last failure's cause and what to do, as a warning (a resume is not unsafe).
    spec = load_spec(tmp_path / "t.yaml", check_environment=False)
    finding = doctor.last_failure(Run.of(spec, "r"))
    assert finding is not None and finding.ok and finding.warning
    assert "cause: exception at step 2" in finding.detail and "policy stop" in finding.detail
    assert "reward.py" in finding.detail
    assert "fix the reward function" in finding.fix


def test_a_trainer_that_exhausts_a_memory_limit_is_out_of_host_memory(tmp_path):
    r, run_dir, attempt = failed_training(tmp_path, {"RELAY_FAULT_ALLOC_AT": "after_step@1"})
    assert "MemoryError" in r.stderr
    cause = fc.classify("FAILED", "", r.stdout + r.stderr, r.returncode, step=fc.step_of_failure(run_dir, attempt))
    assert cause.cause == fc.HOST_OOM, cause.report()
    assert cause.step == 2, "step 1 was trained; the failure is in the step after"
    assert "data.train_batch_size" in cause.todo
