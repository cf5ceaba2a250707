"""The run report of an interrupted run: the resume marker at the step it resumed from, a curve with no
jump there (the rows around it are the uninterrupted run's), the chunk table, and the report in S3."""

import base64
import re
import signal
import subprocess
import time

import pytest

from relay.common import files
from relay.insights import report
from relay.preflight import guard
from relay.runs import layout
from relay.runs.folder import RunFolder
from relay.runs.run import Run
from relay.spec.plan import ChunkPlan
from relay.spec.run_spec import load_spec
from support.helpers import PY, ROOT, read_metrics, relay_cli, write_spec

STEPS = 12  # the test spec: 12 steps in chunks of 6


def comparable(rows):
    """Metric values that a deterministic resume must reproduce exactly."""
    return [(r["step"], r["reward_mean"], r["loss"], r["kl"], r["lr"]) for r in rows]


@pytest.fixture(scope="module")
def resumed(interrupted):
    """Run "r" (chunk 1 done, steps 1..6), then an allowed settings change recorded, then chunk 2
    killed mid-chunk (SIGKILL) and trained again: its retry resumes from the latest checkpoint."""
    spec_path, run_dir = interrupted["spec_path"], interrupted["run_dir"]
    # A deliberate change recorded as the DAG's settings task records it (allow_drift); the report
    # marks it at the step the next attempt resumes from. (The trainer below still runs the old spec:
    # only the record matters here.)
    changed = load_spec(
        write_spec(interrupted["base"] / "changed", **{**interrupted["overrides"], "trainer.settings.kl_loss_coef": 0.002})
    )
    guard.check(Run.of(changed, "r"), allow_drift=["trainer.settings.kl_loss_coef"], by="test")
    proc = subprocess.Popen(
        [PY, "-m", "relay", "train", str(spec_path), "--to-step", str(STEPS), "--run", "r", "--offline"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    while time.time() < deadline and max((r["step"] for r in read_metrics(run_dir)), default=0) < 7:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resume_step = layout.read_tracker(run_dir)  # 6, or 9 if the killed attempt committed its save_freq checkpoint
    assert resume_step in (6, 9)
    retry = relay_cli("train", str(spec_path), "--to-step", str(STEPS), "--run", "r", "--offline")
    assert retry.returncode == 0, retry.stderr[-3000:]
    assert f"resumes from step {resume_step}" in retry.stdout
    return {**interrupted, "resume_step": resume_step}


@pytest.mark.services
def test_the_report_marks_the_resume_and_its_curve_has_no_jump(resumed, baseline, tmp_path):
    run_dir, k = resumed["run_dir"], resumed["resume_step"]
    rep = report.build(run_dir, plan=ChunkPlan.from_spec(resumed["spec"]))

    # Markers: chunk 2's first attempt resumed from step 6; its retry from the latest checkpoint.
    by_kind = {
        kind: [(m.step, m.chunk, m.attempt) for m in rep.markers if m.kind == kind]
        for kind in ("resume", "retry", "chunk", "drift")
    }
    assert by_kind["resume"] == [(6, 2, 1)]
    assert by_kind["retry"] == [(k, 2, 2)]
    assert by_kind["chunk"] == [(6, 1, None), (12, 2, None)]
    assert [m.step for m in rep.markers if m.kind == "drift"] == [6], "drift takes effect at the next resume"
    assert "chunk 2 retry (attempt 2) resumed from step" in rep.summary()

    # The curve: steps exactly 1..12 once each, and the killed attempt's rows past the resume point
    # are not in it (they were superseded); the rows around the resume are the uninterrupted run's.
    assert rep.steps == list(range(1, STEPS + 1))
    assert rep.superseded_rows >= 1
    _, straight = baseline
    assert comparable(rep.rows) == comparable(read_metrics(straight))
    assert comparable(rep.rows[k - 1 : k + 1]) == comparable(read_metrics(straight)[k - 1 : k + 1])

    # The chunk table.
    c1, c2 = rep.chunks
    assert (c1.chunk, c1.start_step, c1.end_step, c1.attempts) == (1, 1, 6, 1)
    assert (c2.chunk, c2.start_step, c2.end_step, c2.attempts, c2.resumed_from) == (2, 7, 12, 2, [6, k])
    assert c2.trainer_seconds and c2.wall_seconds and c2.checkpoint_bytes
    assert c2.validation == "not validated yet" and c2.s3_uri is None
    assert rep.settings_fingerprint == resumed["spec"].settings_fingerprint()
    assert rep.data_fingerprint and len(rep.data_files) == 1

    paths = report.write(rep, tmp_path / "out")
    png = paths["png"].read_bytes()
    page = paths["html"].read_text()
    assert png.startswith(b"\x89PNG")
    assert f'src="data:image/png;base64,{base64.b64encode(png).decode()}"' in page, "the PNG is embedded"
    assert len(re.findall(r'<tr class="chunk"', page)) == 2
    assert rep.settings_fingerprint in page and rep.data_fingerprint in page
    assert not re.search(r'<script\b[^>]*\bsrc=|<link\b|src="http', page), "self-contained: no external assets"


@pytest.mark.services
def test_report_cli_on_a_run_folder(resumed):
    r = relay_cli("report", str(resumed["run_dir"]))
    assert r.returncode == 0, r.stderr[-3000:]
    out = layout.relay_dir(resumed["run_dir"], report.REPORT_DIR)
    assert f"run r: step {STEPS} of {STEPS}, 2 chunks, 3 attempts (1 retry)" in r.stdout
    assert str(out / report.HTML) in r.stdout and (out / report.PNG).is_file()


@pytest.mark.services
def test_published_report_and_a_report_rebuilt_from_s3(resumed, tmp_path):
    from relay.checkpoints.gate import admit_dir
    from relay.s3.store import store_for_spec

    spec, run_dir = resumed["spec"], resumed["run_dir"]
    assert admit_dir(run_dir, STEPS).ok  # the gate writes the manifest; then S3 holds step 12
    store = store_for_spec(spec)
    store.publish(RunFolder("r", run_dir), STEPS)
    out = report.publish(Run.of(spec, "r"), store)
    base = f"{spec.s3.uri}/r"
    assert out["html_uri"] == f"{base}/report/report.html" and out["png_uri"] == f"{base}/report/report.png"
    assert store.head(store.run_key("r", "report", "report.html"))["ContentType"].startswith("text/html")
    published = store.client.get_object(Bucket=store.bucket, Key=store.run_key("r", "report", "report.html"))
    assert published["Body"].read() == (run_dir / ".relay" / "report" / "report.html").read_bytes()

    r = relay_cli("report", base, "--out", str(tmp_path / "from-s3"))
    assert r.returncode == 0, r.stderr[-3000:]
    page = (tmp_path / "from-s3" / report.HTML).read_text()
    assert store.step_uri("r", STEPS) in page and "valid" in page
    local = report.build(run_dir, store=store)
    remote = report.from_s3(base, tmp_path / "work")
    assert remote.rows == local.rows and remote.markers == local.markers
    assert [(c.end_step, c.validation, c.s3_uri) for c in remote.chunks][-1] == (STEPS, "valid", store.step_uri("r", STEPS))


@pytest.mark.services
def test_the_report_shows_the_incarnation_and_decisions_and_lists_only_incidents(resumed, tmp_path):
    """The page a person reads: the run's incarnation (begun by whom, the old one's place after a fresh start), the
    decisions people made, incidents without the routine handoffs between chunks, S3 locations as text to copy
    (a browser cannot open s3://), a long summary line wrapped, the Checkpoint link's row highlighted, and a link
    back to the DAG run it was opened from."""
    from relay.runs.record import read_record, update_record

    run_dir = resumed["run_dir"]
    before = read_record(run_dir)
    try:
        update_record(
            run_dir,
            started_by="manual__1 (fresh start approved by admin in the Airflow UI at t)",
            previous={"archived_to": "/ckpt/.archive/r-t", "archived_uri": "s3://relay/runs/.archive/r-t/"},
        )
        rep = report.build(run_dir, plan=ChunkPlan.from_spec(resumed["spec"]))
        page = rep.html(b"png", back="http://127.0.0.1:8080/dags/relay_t/runs/manual__1")
    finally:
        files.atomic_write_json(layout.relay_dir(run_dir, "run.json"), before)
    assert f"Incarnation <code>{before['incarnation']}</code>" in page
    assert "fresh start approved by admin in the Airflow UI" in page
    assert "<code>/ckpt/.archive/r-t</code>" in page and "<code>s3://relay/runs/.archive/r-t/</code>" in page
    incidents = page.split('<ul id="markers">')[1].split("</ul>")[0]
    assert "retry" in incidents and "drift" in incidents
    assert 'class="marker resume"' not in incidents, "a chunk's planned handoff is not an incident"
    decisions = page.split('<ul id="decisions">')[1].split("</ul>")[0]
    assert "settings change accepted by test: trainer.settings.kl_loss_coef" in decisions
    assert "started again from step 0" in decisions
    assert 'href="s3://' not in page and 'class="copy"' in page
    assert "white-space: pre-wrap" in page and "tr:target" in page
    assert '<a id="back" href="http://127.0.0.1:8080/dags/relay_t/runs/manual__1">' in page


@pytest.mark.services
def test_a_report_from_an_s3_run_without_metrics_says_what_to_do(tmp_path):
    r = relay_cli("report", "s3://relay/nothing-here/r", "--out", str(tmp_path))
    assert r.returncode == 2 and "no metrics.jsonl or events.jsonl under s3://relay/nothing-here/r/" in r.stderr


@pytest.mark.services
def test_the_run_report_link_is_declared_on_the_operator(resumed, monkeypatch):
    """Airflow serializes a declared link as {name: xcom_key}; the worker computes its URL at task end."""
    from airflow.sdk import DAG, BaseOperator
    from airflow.sdk.execution_time.xcom import XCom
    from airflow.serialization.serialized_objects import DagSerialization

    from relay.airflow.links import RunReportLink

    class Chunky(BaseOperator):
        operator_extra_links = (RunReportLink(),)

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.spec_path, self.run_from_task = str(resumed["spec_path"]), "preflight.run"

    with DAG("relay_t", schedule=None) as dag:
        op = Chunky(task_id="chunk_01.publish")
    restored = DagSerialization.from_dict(DagSerialization.to_dict(dag)).get_task("chunk_01.publish")
    assert restored.extra_links == ["Run report"]
    assert restored.operator_extra_link_dict["Run report"].xcom_key == RunReportLink().xcom_key

    monkeypatch.setattr(
        XCom, "get_one", classmethod(lambda cls, **kw: {"run_name": "r"} if kw["task_id"] == "preflight.run" else None)
    )
    key = type("Key", (), {"dag_id": "relay_t", "run_id": "manual", "task_id": op.task_id, "map_index": -1})()
    url = RunReportLink().get_link(op, ti_key=key)
    assert url.endswith("/relay/dags/relay_t/runs/r/report?dag_run=manual"), (
        "Relay's page in the API server (it never expires), with the DAG run to link back to"
    )
