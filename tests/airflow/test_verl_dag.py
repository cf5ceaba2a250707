"""verl's own trainer in CI, as a DAG: include/runs/verl_tiny_cpu.yaml's three chunks, with warm chunks
(`chunks.handoff: warm`), run through real Airflow code (`airflow dags test`), on Ray jobs running verl's
TaskRunner and PPOTrainerSync.fit() (its FSDP engine, reference model, GRPO advantage, FSDPCheckpointManager;
the hf rollout stands in for vLLM only). Chunk 1's job goes on warm into chunk 2 and is SIGKILLed there (after
step 3, before the checkpoint of step 4); the chunk's try starts a new job that resumes cold from chunk 1's
checkpoint and goes on warm into chunk 3. The run saves off the critical path (`checkpoints.async_save`: verl's
workers copy their shards and write them on threads of their own). Every checkpoint is validated (the smoke check
included) and published to the session's S3.

Against an uninterrupted run of the same spec (one job, `relay train` 0 -> 6, the fifth job, saving synchronously):
every step once, the same LR (the spec's warmup and cosine decay), data order (dataset indices per step), rewards and
resume point, bitwise equal weights and optimizer state at step 6, and the same bytes in its shard files;
and the step trained twice equals its first try (relay.insights.audit): the same reward, loss, KL, LR and data order.
Step 6 resharded 1 -> 2 -> 1 keeps its certificate, and rows rotated in one rank's shard are refused by it.
verl's own lane (`./scripts/test.sh --verl`) holds the graceful stop and the relay-train-only version of this
comparison (tests/trainers/test_verl_cpu_fit.py), and two ranks' swapped shards refused at resume by the certificate
verl's workers compute, the run falling back to a step of the old world size that `relay train` reshards
(tests/trainers/test_verl_reshard_resume.py).

The jobs run on a Ray head of this module's own (relay.devstack.stack.private_ray_head, as `relay train`
starts one with nothing running), named by the spec's Ray connection: a verl chunk holds more logical CPUs
and a logical GPU than the session's head (2 CPUs, for the suite's many small chunk jobs) gives."""

from __future__ import annotations

import shutil
import zipfile

import pytest
import torch
import yaml

from relay.checkpoints import certificate
from relay.checkpoints.gate import admit_dir
from relay.devstack import stack
from relay.insights.audit import audit
from relay.preflight.admission import smoke_check
from relay.runs import layout
from relay.runs.metrics import SUPERSEDED, read_events, read_jsonl
from relay.runs.phases import STARTUP, phase_marks
from relay.s3.store import store_for_spec
from relay.spec.run_spec import load_spec
from support.helpers import assert_bitwise_equal, model_state, read_metrics
from support.verl_jobs import (
    JOB_TIMEOUT,
    SPEC,
    dag_spec,
    dag_with_chunk_2_killed,
    optimizer_state,
    relay_train,
)

pytestmark = pytest.mark.services  # Airflow's own processes or DAG runs, on the session's Ray head and S3

RUN = "ci"


@pytest.fixture(scope="module")
def dag_run(airflow_home, s3_server, tmp_path_factory):
    # Saves off the critical path (checkpoints.async_save) in the DAG's run; the uninterrupted job saves synchronously.
    checkpoints = {**yaml.safe_load(SPEC.read_text())["checkpoints"], "async_save": True}
    spec_path = dag_spec(SPEC, airflow_home["runs"], "relay_verl_ray", chunks={"handoff": "warm"}, checkpoints=checkpoints)
    run_dir = load_spec(spec_path, check_environment=False).run_dir(RUN)
    with stack.private_ray_head() as head:
        # Chunk 1's job, gone on warm into chunk 2: its driver SIGKILLed after step 3's row, before step 4's
        # checkpoint (which it could not commit before chunk 2's admission anyway).
        returncode, out = dag_with_chunk_2_killed(
            airflow_home, "relay_verl_tiny_cpu", RUN, run_dir, {"AIRFLOW_CONN_RELAY_VERL_RAY": head.address}
        )
        # The uninterrupted run: the shipped spec, one job 0 -> 6, on the same head.
        base = tmp_path_factory.mktemp("verl_straight")
        straight, log = base / "run", base / "straight.log"
        straight_rc = relay_train(straight, 6, head.address, log).wait(timeout=JOB_TIMEOUT)
    return {
        "run_dir": run_dir,
        "spec": spec_path,
        "returncode": returncode,
        "out": out,
        "straight": straight,
        "straight_rc": straight_rc,
        "straight_out": log.read_text(errors="replace"),
    }


def test_airflows_retry_resumes_the_killed_chunk_and_every_step_is_trained_once(dag_run):
    assert dag_run["returncode"] == 0, dag_run["out"][-6000:]
    run = dag_run["run_dir"]
    assert layout.read_tracker(run) == 6
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in read_jsonl(run / SUPERSEDED)] == [3], "the killed try's step 3, trained again"
    starts = [e for e in read_events(run) if e["event"] == "chunk_start"]
    assert [(e["chunk"], e["resumed_from"], e["warm"]) for e in starts] == [
        (1, 0, False),
        (2, 2, True),
        (2, 2, False),
        (3, 4, True),
    ], "chunk 2 starts warm in chunk 1's job, is killed, starts again in a new job, which goes on warm into chunk 3"
    assert starts[0]["attempt"] == starts[1]["attempt"] and starts[0]["attempt"].endswith("-c01-t1")
    assert starts[2]["attempt"] == starts[3]["attempt"] and starts[2]["attempt"][-7:] in ("-c02-t1", "-c02-t2"), (
        "the new job is a try of chunk 2's train task (its first, if the kill came before it adopted the warm job)"
    )
    assert "verl resumed at step 2" in dag_run["out"]
    assert all(r["lr"] is not None and r["sample_indices"] for r in read_metrics(run))


def test_every_verl_resume_is_certified_by_verls_own_workers(dag_run):
    """Each save writes the certificate computed in verl's workers; the resume (chunk 2's new job; the warm chunks
    load nothing) recomputes it there after verl's load and finds it exact (relay.checkpoints.certificate)."""
    from relay.checkpoints import certificate, manifest

    run = dag_run["run_dir"]
    for step in (2, 4, 6):
        cert = certificate.read(layout.step_dir(run, step))
        assert cert is not None and cert.step == step and cert.device == "cpu" and len(cert.probe_ids) == 4
        assert cert.optimizer_step == step and len(cert.params) > 10  # one optimizer step a training step
        assert "relay_certificate.json" in manifest.read(layout.step_dir(run, step)).files, "its checksums cover it"
    checks = [e for e in read_events(run) if e["event"] == "resume_certificate"]
    assert [(e["step"], e["certificate"]) for e in checks] == [(2, "certified")]
    assert "certified resume from step 2: probe log-probs differ by at most 0 (exact)" in dag_run["out"]


def test_the_resumed_run_has_the_uninterrupted_runs_lr_data_order_rewards_and_weights(dag_run):
    """Steps 1 to 6 of the DAG's run (three chunks, two of them warm, the killed warm job and the new job from
    step 2) against one job 0 -> 6: the same LR (a warmup and a cosine decay over the run's steps), dataset indices and
    rewards at every step, and the weights and optimizer state of step 6 bit for bit."""
    assert dag_run["returncode"] == 0, dag_run["out"][-6000:]
    assert dag_run["straight_rc"] == 0, dag_run["straight_out"][-6000:]
    straight = dag_run["straight"]
    assert [e["resumed_from"] for e in read_events(straight) if e["event"] == "chunk_start"] == [0]
    rows, base = read_metrics(dag_run["run_dir"]), read_metrics(straight)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] == [r["step"] for r in base]
    for key in ("lr", "sample_indices", "reward_mean"):
        assert [r[key] for r in rows] == [r[key] for r in base], key
    lr = [r["lr"] for r in rows]
    assert lr[0] < lr[1] and lr[5] < lr[2], f"a warmup, then a decay: {lr}"
    chunked, one_job = layout.step_dir(dag_run["run_dir"], 6), layout.step_dir(straight, 6)
    assert_bitwise_equal(model_state(chunked), model_state(one_job))
    a, b = optimizer_state(chunked), optimizer_state(one_job)
    assert a.keys() == b.keys() and any(hasattr(v, "dtype") for v in a.values())
    differ = [k for k in a if not (torch.equal(a[k], b[k]) if hasattr(a[k], "dtype") else a[k] == b[k])]
    assert not differ, f"the optimizer states differ at {differ[:5]}"


def test_verls_workers_saved_off_the_critical_path_the_bytes_of_a_synchronous_save(dag_run):
    """checkpoints.async_save in verl's FSDP workers (relay.trainers.verl_ppo.worker_saves): every checkpoint of the
    DAG's run was copied while training waited and written by the workers' threads, committed only after; the
    uninterrupted job saved synchronously. Step 6's shards hold byte for byte the synchronous save's tensor storages
    (their pickles differ between any two processes: torch writes a random serialization id, and a device mesh's
    hash)."""
    saves = [e for e in read_events(dag_run["run_dir"]) if e["event"] == "checkpoint"]
    assert [e["step"] for e in saves] == [2, 4, 6] and all("written_seconds" in e for e in saves), saves
    assert not any("written_seconds" in e for e in read_events(dag_run["straight"]) if e["event"] == "checkpoint")
    assert "of host buffers allocated before the first step" in dag_run["out"]
    chunked, one_job = layout.step_dir(dag_run["run_dir"], 6) / "actor", layout.step_dir(dag_run["straight"], 6) / "actor"
    for name in (layout.shard_name("model", 1, 0), layout.shard_name("optim", 1, 0)):
        a, b = storages(chunked / name), storages(one_job / name)
        assert a.keys() == b.keys() and len(a) > 10 and a == b, name
    assert not list((dag_run["run_dir"] / ".relay" / "staging").glob("*")), "nothing left in staging"
    # the certificate's digests, taken by the workers from their copies, are those the synchronous save took live
    a, b = (certificate.read(layout.step_dir(r, 6)) for r in (dag_run["run_dir"], dag_run["straight"]))
    assert a.params == b.params and a.optimizer == b.optimizer and a.optimizer_steps == b.optimizer_steps and a.params
    assert "(digests from the saved copies)" in dag_run["out"]


def storages(shard) -> dict[str, bytes]:
    """The tensor storages of a torch.save archive (its data/ records), by name."""
    with zipfile.ZipFile(shard) as z:
        return {n.split("/", 1)[1]: z.read(n) for n in z.namelist() if n.split("/")[1:2] == ["data"]}


def test_the_step_trained_twice_equals_its_first_try(dag_run):
    """verl's generation is seeded per sample and verl restores every RNG it saves: the resumed step 3 repeats
    the killed try's step 3 bit for bit, every logged metric (reward, loss, KL, LR, the dataset indices)."""
    report = audit(dag_run["run_dir"])
    assert report.steps == [3] and report.consistent, report.summary()
    first = read_jsonl(dag_run["run_dir"] / SUPERSEDED)[0]
    assert {"lr", "sample_indices", "reward_mean"} <= set(first)


def test_the_weights_moved_and_every_checkpoint_passed_the_gate_and_was_published(dag_run):
    run = dag_run["run_dir"]
    before, after = model_state(layout.step_dir(run, 2)), model_state(layout.step_dir(run, 6))
    assert any(not (before[k] == after[k]).all() for k in before), "GRPO with an uneven reward moves the policy"
    spec = load_spec(dag_run["spec"], check_environment=False)
    assert [m.step for m in store_for_spec(spec).published(RUN)] == [2, 4, 6]
    for step in (2, 4, 6):
        assert (layout.step_dir(run, step) / "relay_manifest.json").is_file(), f"the DAG's gate admitted step {step}"
        admission = admit_dir(run, step, smoke=smoke_check(spec))  # and again here, every level, the forward pass
        assert admission.ok, admission.explain()
        assert "forward pass" in admission.explain()


def test_each_verl_chunk_records_its_start_up_phases(dag_run):
    events = read_events(dag_run["run_dir"])
    for attempt in [e["attempt"] for e in events if e["event"] == "chunk_start"]:
        assert list(phase_marks(events, attempt)) == list(STARTUP), attempt


def test_a_reshard_keeps_the_certificate_and_rows_rotated_in_one_shard_are_refused(dag_run, tmp_path):
    """Step 6 resharded 1 -> 2 -> 1 (`relay checkpoint reshard`'s code): every parameter's digest is the same at
    any sharding, so the gate's offline check of the certificate passes on the way back. With one tensor's rows
    rotated in rank 1's shard at world size 2 (its checksums made again: an injected fault), the way back is
    refused by the certificate, naming the tensor."""
    from relay.checkpoints.gate import admit_dir
    from relay.checkpoints.reshard import reshard
    from relay.preflight.admission import admit
    from relay.runs.run import Run

    spec = load_spec(dag_run["spec"], check_environment=False)
    at2, rotated = tmp_path / "at2", tmp_path / "rotated"
    reshard(dag_run["run_dir"], 2, step=6, out=at2)
    back = tmp_path / "back"
    reshard(at2, 1, step=6, out=back)
    good = admit(Run(spec, RUN, back), 6)
    assert good.ok and "certificate" in good.manifest.checks, good.explain()

    shutil.copytree(at2, rotated)
    shard = layout.step_dir(rotated, 6) / "actor" / layout.shard_name("model", 2, 1)
    sd = torch.load(shard, weights_only=False)
    key = next(k for k in sd if k.endswith("mlp.gate_proj.weight"))
    local = sd[key].to_local()
    local.copy_(torch.roll(local.clone(), 1, dims=0))
    torch.save(sd, shard)
    (layout.step_dir(rotated, 6) / "relay_manifest.json").unlink(missing_ok=True)
    assert admit_dir(rotated, 6).ok, "shapes, values and checksums hold at world size 2"
    bad_back = tmp_path / "bad_back"
    reshard(rotated, 1, step=6, out=bad_back)
    bad = admit(Run(spec, RUN, bad_back), 6)
    assert not bad.ok and bad.report.failed.name == "certificate", bad.explain()
    assert key in bad.report.failed.detail
