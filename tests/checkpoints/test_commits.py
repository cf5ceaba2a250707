"""A step's commit record (relay.checkpoints.commits): what a resume and the gate make of the certificate a step
folder holds now, against what its commit recorded."""

from pathlib import Path

from relay.checkpoints import certificate, commits
from relay.runs import layout


def _step(run_dir: Path, step: int, cert: bytes | None = b'{"step": 1}') -> Path:
    folder = layout.step_dir(run_dir, step)
    folder.mkdir(parents=True)
    if cert is not None:
        (folder / certificate.NAME).write_bytes(cert)
    return folder


def test_a_certificate_removed_or_replaced_since_its_commit_is_refused(tmp_path):
    folder = _step(tmp_path, 3)
    record = commits.write(tmp_path, 3, folder, by="job-1")
    assert commits.summary(record) == record["certificate"] and len(record["certificate"]) == 64
    assert commits.standing(tmp_path, 3).kind == "certified"

    (folder / certificate.NAME).write_bytes(b'{"step": 2}')
    replaced = commits.standing(tmp_path, 3)
    assert replaced.kind == "refused" and "replaced since its commit" in replaced.detail
    (folder / certificate.NAME).unlink()
    removed = commits.standing(tmp_path, 3)
    assert removed.kind == "refused" and "its certificate was removed" in removed.detail


def test_a_step_without_a_record_is_refused_once_the_run_keeps_records(tmp_path):
    commits.write(tmp_path, 3, _step(tmp_path, 3))
    commits.path(tmp_path, 6).unlink(missing_ok=True)
    _step(tmp_path, 6)  # committed later, its record gone (or never committed by Relay)
    missing = commits.standing(tmp_path, 6)
    assert missing.kind == "refused" and "has no commit record" in missing.detail and "since step 3" in missing.detail
    _step(tmp_path, 1, cert=None)  # committed before the run kept records
    older = commits.standing(tmp_path, 1)
    assert older.kind == "unrecorded" and older.uncertified


def test_a_run_from_before_commit_records_and_a_skipped_certificate_may_resume_uncertified(tmp_path):
    _step(tmp_path, 3, cert=None)
    assert commits.standing(tmp_path, 3).kind == "unrecorded"
    record = commits.write(tmp_path, 3, layout.step_dir(tmp_path, 3), skipped="RuntimeError: a worker died")
    assert commits.summary(record) == "skipped: RuntimeError: a worker died"
    skipped = commits.standing(tmp_path, 3)
    assert skipped.kind == "skipped" and skipped.uncertified and "a worker died" in skipped.detail


def test_a_restored_step_is_held_to_the_certificate_its_publication_names(tmp_path):
    folder = _step(tmp_path, 3)
    published = commits.certificate_digest(folder)
    commits.restored(tmp_path, 3, folder, published, by="restore")
    assert commits.standing(tmp_path, 3).kind == "certified"
    commits.restored(tmp_path, 3, folder, "0" * 64, by="restore")  # not the certificate the publication names
    assert commits.standing(tmp_path, 3).kind == "refused"
    commits.restored(tmp_path, 3, folder, "skipped: no probe", by="restore")
    assert commits.read(tmp_path, 3)["certificate"] == published, "a certificate the files hold is recorded"
    bare = _step(tmp_path, 6, cert=None)
    commits.restored(tmp_path, 6, bare, None, by="restore")  # published before commit records
    assert commits.standing(tmp_path, 6).kind == "skipped"
