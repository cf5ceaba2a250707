"""Every command exits by one rule (relay.cli.exit_codes): 0 success, 1 a finding (what it examines is invalid, or it
was refused), 2 usage (what it was given is not what it takes), 3 lease lost, 4 stopped early. Every command that
takes a path is run on a path that does not exist, an empty folder and an unreadable file."""

from __future__ import annotations

import argparse

import pytest

from relay.cli import build_parser
from relay.cli.exit_codes import FINDING, LEASE_LOST, RULE, STOPPED, USAGE
from relay.common.errors import LeaseLost, StoppedEarly, UsageError
from support.helpers import relay_cli

MISSING = "/no/such/path"

# Each command that takes a path: its argv with {} for the path, and what its unreadable input is: a `spec` (bytes
# that are no YAML: it cannot be read, usage), a run folder whose `tracker` is garbage, a `parquet` file that is
# not one, a run folder whose `metrics` are garbage (each examined by the command: a finding).
TAKES_A_PATH = {
    "plan": (["plan", "{}"], "spec", USAGE),
    "spec check": (["spec", "check", "{}"], "spec", USAGE),
    "train": (["train", "{}", "--to-step", "1"], "spec", USAGE),
    "doctor": (["doctor", "{}"], "spec", USAGE),
    "checkpoint validate": (["checkpoint", "validate", "{}"], "tracker", FINDING),
    "checkpoint publish": (["checkpoint", "publish", "{}", "s3://relay/x"], "tracker", FINDING),
    "checkpoint reshard": (["checkpoint", "reshard", "{}", "--world-size", "2"], "tracker", FINDING),
    "checkpoint inspect": (["checkpoint", "inspect", "{}"], "tracker", FINDING),
    "data check": (["data", "check", "{}"], "parquet", FINDING),
    "data freeze": (["data", "freeze", "{}", "s3://relay/x"], "parquet", FINDING),
    "data diff": (["data", "diff", "{}", "{}"], "parquet", FINDING),
    "report": (["report", "{}"], "metrics", FINDING),
    "audit": (["audit", "{}"], "metrics", FINDING),
}
# What takes no path to examine: a folder it writes into, an S3 URI, or nothing (tested below and elsewhere).
WRITES_OR_NO_PATH = {"model tiny", "checkpoint restore", "checkpoint ls", "stack", "demo"}


def commands(parser=None, path=()):
    for a in (parser or build_parser("relay"))._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield from commands(sub, (*path, name))
            return
    yield " ".join(path)


def test_every_command_is_in_the_exit_code_table():
    assert set(commands()) == set(TAKES_A_PATH) | WRITES_OR_NO_PATH


def test_the_rule_is_the_error_classes_own():
    assert [code for code, _, _ in RULE] == [0, 1, 2, 3, 4]
    assert (USAGE, LEASE_LOST, STOPPED) == (UsageError.exit_code, LeaseLost.exit_code, StoppedEarly.exit_code)
    r = relay_cli("--help")
    assert r.returncode == 0 and all(f"{code} {what.split(':')[0]}" in " ".join(r.stdout.split()) for code, what, _ in RULE)


def _unreadable(tmp_path, kind: str) -> str:
    if kind == "spec":
        (tmp_path / "spec.yaml").write_bytes(bytes(range(256)) * 2)
        return str(tmp_path / "spec.yaml")
    if kind == "parquet":
        (tmp_path / "data.parquet").write_bytes(b"PAR1" + bytes(range(256)))
        return str(tmp_path / "data.parquet")
    run = tmp_path / "run"
    run.mkdir()
    if kind == "tracker":
        (run / "latest_checkpointed_iteration.txt").write_bytes(b"\x00\xffnot a step")
    else:
        (run / "metrics.jsonl").write_text('{"step": 1, "loss"\nnot json\n')
    return str(run)


@pytest.mark.parametrize("command", sorted(TAKES_A_PATH))
def test_a_missing_path_an_empty_folder_and_an_unreadable_file(tmp_path, command):
    argv, kind, unreadable = TAKES_A_PATH[command]
    (tmp_path / "empty").mkdir()
    for case, path, code in [
        ("a path that does not exist", MISSING, USAGE),
        ("an empty folder", str(tmp_path / "empty"), USAGE),
        (f"an unreadable {kind}", _unreadable(tmp_path, kind), unreadable),
    ]:
        r = relay_cli(*[a.replace("{}", path) for a in argv])
        assert r.returncode == code, f"relay {command} on {case}: exit {r.returncode}, not {code}\n{r.stderr[-1500:]}"
        said = r.stdout + r.stderr  # a finding's report goes to stdout (validate's), an error to stderr
        assert path in said and "Traceback" not in said, f"relay {command} on {case}:\n{said[-1500:]}"


def test_what_a_command_does_not_take_is_a_usage_error(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "ckpt" / "global_step_1").mkdir(parents=True)
    for argv, said in [
        (("audit", str(tmp_path)), "metrics.jsonl"),
        (("model", "tiny", str(tmp_path / "file")), "not a folder"),
        (("checkpoint", "ls", "notauri"), "not an S3 URI"),
        (("checkpoint", "restore", "notauri", str(tmp_path / "r")), "not an S3 URI"),
        (("checkpoint", "reshard", str(tmp_path / "ckpt"), "--world-size", "0"), "at least 1"),
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
