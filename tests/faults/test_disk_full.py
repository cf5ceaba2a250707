"""The checkpoint disk fills during a save, full stack: a run DAG through real Airflow code (`airflow dags
test`) on the session's Ray head and S3, its checkpoints on a small tmpfs of the case's own (mounting one
needs root or CAP_SYS_ADMIN, which the test machines and CI have). The trainer is held inside step 12's
save (actor shards written, data.pt not yet: RELAY_FAULT_PAUSE_AT=mid_save@12, once), the disk is filled
to the last page with another file, and the save goes on into ENOSPC. The chunk must fail saying so,
remove its partial checkpoint, leave checkpoint 9 intact and named by the tracker; once space is freed,
Airflow's retry resumes from step 9 and the run ends bitwise equal to an uninterrupted one."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from relay.checkpoints.validate import validate_checkpoint
from relay.jobs.ray_jobs import RayJobs
from relay.runs import layout
from relay.runs.metrics import read_events
from relay.spec.run_spec import load_spec
from support.faults import alive, assert_finished_as
from support.helpers import jobs_of_run, start_dags_test, write_spec
from support.polling import wait_for

STEPS, LAST_SAVED = 12, 9


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(disk)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(
            f"this fault case mounts a 48 MiB tmpfs as the checkpoint disk and could not ({r.stderr.strip()}); "
            "run the tests as root or with CAP_SYS_ADMIN"
        )
    yield disk
    subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def fill(disk: Path) -> Path:
    """Another file takes every free byte of the disk. Unbuffered: a buffered file's close would flush what the last
    write could not, and raise ENOSPC once more."""
    ballast = disk / "someone-elses-file"
    with open(ballast, "wb", buffering=0) as f:
        block = b"\0" * 65536
        try:
            while True:
                f.write(block)
        except OSError:
            pass
    assert shutil.disk_usage(disk).free < 65536
    return ballast


def test_the_checkpoint_disk_fills_during_a_save(airflow_home, ray_address, small_disk, tmp_path, fault_row, uninterrupted):
    marker = tmp_path / "paused"
    spec_path = write_spec(
        airflow_home["runs"],
        name="diskfull",
        **{
            "checkpoint_dir": str(small_disk),
            "trainer.settings.save_freq": 3,
            "ray.env_vars": {
                "RELAY_FAULT_PAUSE_AT": f"mid_save@{STEPS}",
                "RELAY_FAULT_ONCE": str(marker),
                "RELAY_FAULT_PAUSE_S": "300",
            },
        },
    )
    run_dir = load_spec(spec_path, check_environment=False).run_dir("diskfull")
    t0 = time.time()
    dag = start_dags_test(airflow_home, "relay_diskfull", {})
    trainer = int(
        wait_for(
            lambda: marker.exists() and marker.read_text(), 300, "the trainer held inside step 12's save", gave_up=dag.ended
        )
    )
    ballast = fill(small_disk)
    Path(f"{marker}.go").touch()
    wait_for(lambda: not alive(trainer), 300, "the trainer's end", gave_up=dag.ended)
    # Nothing half-written is left, and the last checkpoint is whole (before the retry, seconds away).
    assert not list(layout.relay_dir(run_dir, "staging").glob(f"global_step_{STEPS}.*"))
    assert layout.read_tracker(run_dir) == LAST_SAVED and not layout.step_dir(run_dir, STEPS).exists()
    assert validate_checkpoint(run_dir, LAST_SAVED, upto="integrity").ok
    os.unlink(ballast)  # the operator frees space
    rc, out = dag.wait()
    (job,) = [j for j in jobs_of_run(ray_address, "diskfull", t0) if str(j.status) == "FAILED"]
    log = RayJobs(ray_address).logs(job.submission_id)
    assert "the checkpoint disk is full: saving step 12" in log and "What to do: free space" in log, log[-3000:]
    assert "the tracker still names step 9, which is intact" in log
    assert rc == 0, out[-5000:]
    assert "the checkpoint disk is full" in out, "the task log says why the try failed"
    starts = [(e["chunk"], e["resumed_from"]) for e in read_events(run_dir) if e["event"] == "chunk_start"]
    assert starts == [(1, 0), (2, 6), (2, LAST_SAVED)], starts
    assert_finished_as(run_dir, uninterrupted, STEPS, out)
    fault_row(
        case="disk-full",
        layer="full stack (Airflow, Ray, S3)",
        fault=f"the checkpoint disk (a 48 MiB tmpfs) fills up in the middle of step {STEPS}'s save",
        action='the trainer removed the partial checkpoint and failed the chunk with "the checkpoint disk is '
        f'full: saving step {STEPS} ... the tracker still names step {LAST_SAVED}, which is intact" and '
        "what to do; once space was freed, Airflow's retry resumed from step "
        f"{LAST_SAVED}",
        steps_lost=STEPS - LAST_SAVED,
        run_dir=run_dir,
    )
