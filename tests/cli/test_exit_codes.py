"""Every command's exit code says what happened: 0 success, 1 a finding (a checkpoint, tracker or parquet that
exists but is corrupt, truncated, empty or unsafe; an audit that diverged; a doctor that finds a resume unsafe),
2 usage (bad arguments, or a path that does not exist or is not what the command takes)."""

from __future__ import annotations

import pytest

from support.helpers import relay_cli

MISSING = "/no/such/path"


@pytest.mark.parametrize(
    "argv",
    [
        ("checkpoint", "validate", MISSING),
        ("checkpoint", "validate", MISSING, "--quarantine"),
        ("checkpoint", "publish", MISSING, "s3://relay/x"),
        ("checkpoint", "reshard", MISSING, "--world-size", "2"),
        ("checkpoint", "inspect", MISSING),
        ("data", "check", MISSING + ".parquet"),
        ("data", "diff", MISSING + ".parquet", MISSING + "-b.parquet"),
        ("data", "freeze", MISSING + ".parquet", "s3://relay/x"),
        ("report", MISSING),
        ("audit", MISSING),
        ("plan", MISSING + ".yaml"),
    ],
    ids=lambda a: " ".join(a[:2]) + (" --quarantine" if "--quarantine" in a else ""),
)
def test_a_path_that_does_not_exist_is_a_usage_error(argv):
    r = relay_cli(*argv)
    assert r.returncode == 2, f"{argv}: exit {r.returncode}\n{r.stdout[-1000:]}{r.stderr[-1000:]}"
    assert MISSING in r.stderr and "Traceback" not in r.stderr, r.stderr[-1000:]


def test_what_a_command_does_not_take_is_a_usage_error(tmp_path):
    (tmp_path / "file").write_text("x")
    for argv, said in [
        (("audit", str(tmp_path)), "metrics.jsonl"),
        (("model", "tiny", str(tmp_path / "file")), "not a folder"),
        (("checkpoint", "ls", "notauri"), "not an S3 URI"),
        (("checkpoint", "restore", "notauri", str(tmp_path / "r")), "not an S3 URI"),
        (("checkpoint", "reshard", str(tmp_path), "--world-size", "0"), "at least 1"),
    ]:
        r = relay_cli(*argv)
        assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, (
            f"{argv}: exit {r.returncode}\n{r.stderr[-1500:]}"
        )


def test_a_corrupt_truncated_or_empty_input_is_a_finding(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "latest_checkpointed_iteration.txt").write_text("garbage")
    (tmp_path / "empty.parquet").write_bytes(b"")
    (tmp_path / "cut.parquet").write_bytes(b"PAR1\x00\x01")
    for argv in [
        ("checkpoint", "validate", str(run)),
        ("checkpoint", "inspect", str(run)),
        ("data", "check", str(tmp_path / "empty.parquet")),
        ("data", "diff", str(tmp_path / "cut.parquet"), str(tmp_path / "empty.parquet")),
    ]:
        r = relay_cli(*argv)
        assert r.returncode == 1 and "Traceback" not in r.stderr, f"{argv}: exit {r.returncode}\n{r.stderr[-1500:]}"


def test_the_help_says_what_the_exit_codes_mean():
    r = relay_cli("--help")
    assert r.returncode == 0
    assert "0 success" in r.stdout and "1 a finding" in r.stdout and "2 usage" in r.stdout, r.stdout
