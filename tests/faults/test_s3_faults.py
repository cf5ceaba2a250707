"""S3 faults and a new worker host, at the trainer level (`relay train` and `relay checkpoint publish`
children of a fork server), against the session's SeaweedFS: through a fault-injecting proxy that
answers 500 and 503 (SlowDown) for a while, or all the time; and a next chunk on a host whose checkpoint
folder is empty. Each case: the run finishes bitwise equal to an uninterrupted run; `latest` never
names an incomplete checkpoint; the steps lost are at most those since the last published checkpoint."""

from __future__ import annotations

import pytest

from relay.runs.metrics import SUPERSEDED, read_events, read_jsonl
from relay.s3.store import CheckpointStore, s3_client
from relay.spec.run_spec import load_spec
from support.faults import ForkServer, data_lost
from support.helpers import assert_bitwise_equal, model_state, write_spec
from support.s3proxy import FaultyS3Proxy

STEPS = 12


@pytest.fixture(scope="module")
def world(tmp_path_factory, s3_server, uninterrupted):
    folder = tmp_path_factory.mktemp("s3faults")
    spec_path = write_spec(folder, **{"trainer.settings.save_freq": 3})
    server = ForkServer()
    proxy = FaultyS3Proxy(s3_server)
    w = {
        "folder": folder,
        "spec_path": spec_path,
        "spec": load_spec(spec_path, check_environment=False),
        "server": server,
        "proxy": proxy,
        "baseline": uninterrupted,
    }
    yield w
    proxy.stop()
    server.close()


def _train(w, run_dir, to_step, *, offline=False, endpoint=None) -> int:
    argv = ["train", str(w["spec_path"]), "--to-step", str(to_step), "--checkpoint-dir", str(run_dir)]
    env = {"AWS_ENDPOINT_URL": endpoint} if endpoint else {}
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    w["last_log"] = run_dir.parent / f"{run_dir.name}.train-{to_step}.log"
    return w["server"].run(argv + (["--offline"] if offline else []), w["last_log"], env)


def _publish(w, run_dir, step, endpoint=None) -> tuple[int, str]:
    log = run_dir.parent / f"{run_dir.name}.publish-{step}.log"
    rc = w["server"].run(
        ["checkpoint", "publish", str(run_dir), w["spec"].s3.uri, "--step", str(step)],
        log,
        {"AWS_ENDPOINT_URL": endpoint} if endpoint else {},
    )
    return rc, log.read_text()


def _new_host(host_a, name: str):
    """A host whose checkpoint folder holds no checkpoint, only the run's record: the run's incarnation,
    which the DAG's chunk request carries to whichever host runs the chunk (an empty folder that knows no
    incarnation restores nothing: it is not the published run's own, `relay checkpoint restore` is)."""
    from relay.runs.record import read_record, write_record

    host_b = host_a.parent.parent / name / host_a.name
    write_record(host_b, read_record(host_a))
    return host_b


def _store(w) -> CheckpointStore:
    return CheckpointStore(s3_client(), w["spec"].s3.uri)  # straight to SeaweedFS, past the proxy


def test_s3_answering_500_and_503_for_a_while_costs_nothing(world, fault_row):
    """Every third request through the proxy fails (503 SlowDown and 500 in turn) while a checkpoint is
    published and while a new host restores it: botocore's retries carry both through."""
    proxy = world["proxy"]
    host_a = world["folder"] / "flaky-a" / "flaky"
    assert _train(world, host_a, 6, offline=True) == 0
    proxy.mode, before = "flaky", sum(proxy.injected.values())
    try:
        rc, out = _publish(world, host_a, 6, proxy.endpoint)
        assert rc == 0, out[-3000:]
        host_b = _new_host(host_a, "flaky-b")
        assert _train(world, host_b, STEPS, endpoint=proxy.endpoint) == 0, world["last_log"].read_text()[-3000:]
    finally:
        proxy.mode = "pass"
    injected = sum(proxy.injected.values()) - before
    assert injected >= 5, f"only {injected} errors were injected"
    log = world["last_log"].read_text()
    assert "restored step 6 from s3://" in log and "resumes from step 6" in log
    store = _store(world)
    assert store.latest("flaky")["step"] == 6
    store.verify("flaky", store.manifest("flaky", 6))
    assert_bitwise_equal(model_state(host_b / f"global_step_{STEPS}"), world["baseline"])
    assert data_lost(host_b, store) == "no", "the run's history came back with its checkpoint"
    fault_row(
        case="s3-errors",
        layer="trainer + S3 (proxy)",
        fault=f"S3 answers 500 InternalError and 503 SlowDown to every third request ({injected} errors) "
        "during a publish and a restore",
        action="botocore's standard retries (5 attempts) carried every request through; the publish "
        "completed and verified against its manifest, latest moved to step 6 only after it; the "
        "restore verified each file's CRC64NVME",
        steps_lost=0,
        run_dir=host_b,
        store=store,
    )


def test_s3_down_during_a_publish_leaves_latest_alone_and_a_later_publish_completes(world, fault_row):
    proxy = world["proxy"]
    run_dir = world["folder"] / "down-a" / "down"
    assert _train(world, run_dir, 9, offline=True) == 0
    assert _publish(world, run_dir, 3, proxy.endpoint)[0] == 0
    proxy.mode = "down"
    try:
        rc, out = _publish(world, run_dir, 6, proxy.endpoint)
    finally:
        proxy.mode = "pass"
    assert rc == 1 and "SlowDown" in out and "What to do:" in out and "Traceback" not in out, out[-3000:]
    store = _store(world)
    assert store.latest("down")["step"] == 3, "latest never names an incomplete publication"
    assert store.manifest("down", 6) is None
    rc, out = _publish(world, run_dir, 6, proxy.endpoint)
    assert rc == 0, out[-3000:]
    assert store.latest("down")["step"] == 6
    store.verify("down", store.manifest("down", 6))
    # The run goes on from its local checkpoint and ends as the uninterrupted run.
    assert _train(world, run_dir, STEPS, offline=True) == 0
    assert_bitwise_equal(model_state(run_dir / f"global_step_{STEPS}"), world["baseline"])
    fault_row(
        case="s3-errors",
        layer="trainer + S3 (proxy)",
        fault="S3 answers 503 SlowDown to every request during a publish, then recovers",
        action="the publish failed after botocore's retries with an error naming the request and what to "
        "do; latest stayed on step 3 and step 6 had no manifest (not published); publishing "
        "again completed it and moved latest to 6",
        steps_lost=0,
        run_dir=run_dir,
        store=store,
    )


def test_a_new_worker_host_with_an_empty_checkpoint_dir_restores_from_s3(world, fault_row):
    host_a = world["folder"] / "host-a" / "moved"
    assert _train(world, host_a, 9, offline=True) == 0  # checkpoints 3, 6, 9 on host A's disk
    assert _publish(world, host_a, 6)[0] == 0  # chunk 1 (steps 1-6) was published; host A is then lost
    host_b = _new_host(host_a, "host-b")
    assert _train(world, host_b, STEPS) == 0, world["last_log"].read_text()[-3000:]
    log = world["last_log"].read_text()
    assert "restored step 6 from s3://" in log and "resumes from step 6" in log
    assert_bitwise_equal(model_state(host_b / f"global_step_{STEPS}"), world["baseline"])
    # The run's history came back with its checkpoint: each step's row (steps 7-9 of host A, trained again on
    # host B, as first tries in metrics.superseded.jsonl), host A's events before B's.
    assert data_lost(host_b, _store(world)) == "no"
    assert [r["step"] for r in read_jsonl(host_b / "metrics.jsonl")] == list(range(1, STEPS + 1))
    assert [r["step"] for r in read_jsonl(host_b / SUPERSEDED)] == [7, 8, 9]
    starts = [e["resumed_from"] for e in read_events(host_b) if e["event"] == "chunk_start"]
    assert starts == [0, 6], "host A's chunk start, then host B's"
    fault_row(
        case="new-worker-host",
        fault="the next chunk runs on a host whose checkpoint folder has no "
        "checkpoint (host A, with unpublished step 9, is gone)",
        action="no valid local checkpoint: restored the newest valid published one of the run's own "
        "incarnation (step 6) from S3, verified each file's CRC64NVME and validated it, then resumed "
        "from it",
        steps_lost=3,
        run_dir=host_b,
        store=_store(world),
    )


def test_a_restore_leaves_no_download_behind_and_refuses_a_volume_too_small(world, tmp_path):
    """A restore preallocates each download at full size: a candidate that fails (a damaged object) is removed
    before the next one is tried; what a killed restore left is removed by the next; and a checkpoint that does
    not fit on the volume is refused before anything is written, with the bytes needed and free."""
    import subprocess

    from relay.common.faultpoint import KILL_ENV
    from relay.runs import layout
    from support.helpers import relay_cli

    host_a = world["folder"] / "leak-a" / "leak"
    assert _train(world, host_a, 6, offline=True) == 0
    for step in (3, 6):
        assert _publish(world, host_a, step)[0] == 0
    store, uri = _store(world), world["spec"].s3.uri
    m6 = store.manifest("leak", 6)
    rel = max(m6.files, key=lambda r: m6.files[r]["size"])
    store.client.put_object(
        Bucket=store.bucket, Key=store.step_key("leak", 6, rel), Body=b"\0" * m6.files[rel]["size"]
    )  # same size, other bytes: its CRC64NVME differs

    def leftovers(run_dir):
        staging = layout.relay_dir(run_dir, "staging")
        return sorted(p.name for p in staging.iterdir()) if staging.is_dir() else []

    fresh = tmp_path / "b" / "leak"
    r = relay_cli("checkpoint", "restore", uri, str(fresh))
    assert r.returncode == 0 and "restored step 3" in r.stdout, r.stdout + r.stderr
    assert "skipping" in r.stdout + r.stderr and leftovers(fresh) == [], "the damaged candidate's download is gone"

    killed = tmp_path / "c" / "leak"
    r = relay_cli("checkpoint", "restore", uri, str(killed), env={KILL_ENV: "restore_downloaded@3"})
    assert r.returncode == -9 and leftovers(killed) == ["restore-global_step_3"]
    r = relay_cli("checkpoint", "restore", uri, str(killed))
    assert r.returncode == 0 and leftovers(killed) == [], r.stdout + r.stderr

    small = tmp_path / "small"
    small.mkdir()
    half = store.manifest("leak", 3).total_bytes // 2 // 1024  # KiB: room for half the checkpoint
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={half}k", "tmpfs", str(small)], capture_output=True, text=True
    )
    assert mounted.returncode == 0, f"this case mounts a tmpfs (root or CAP_SYS_ADMIN): {mounted.stderr}"
    try:
        r = relay_cli("checkpoint", "restore", uri, str(small / "leak"))
        assert r.returncode == 1 and "needs" in r.stderr and "bytes" in r.stderr and "free" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and leftovers(small / "leak") == []
        assert not layout.step_dir(small / "leak", 3).exists()
    finally:
        subprocess.run(["umount", "-l", str(small)], capture_output=True)
