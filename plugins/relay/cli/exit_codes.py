"""One exit-code rule for every command, `relay --help` and docs/reference/cli.md say it from here.

The codes are the error classes' own (relay.common.errors): a command that raises one exits with its code, so
the rule and what a command does cannot drift apart (tests/cli/test_exit_codes.py runs every command on a path
that does not exist, an empty folder and an unreadable file)."""

from __future__ import annotations

from relay.common.errors import LeaseLost, RelayError, StoppedEarly, UsageError

OK = 0
FINDING = RelayError.exit_code
USAGE = UsageError.exit_code
LEASE_LOST = LeaseLost.exit_code
STOPPED = StoppedEarly.exit_code

# (code, what it means, examples)
RULE: tuple[tuple[int, str, str], ...] = (
    (OK, "success", "the checkpoint is valid; the run trained to its step; the audit is consistent"),
    (
        FINDING,
        "a finding: what the command examines exists but is invalid, or the command was refused",
        "a checkpoint, tracker, parquet file or run history that is corrupt, truncated, empty or unsafe; an audit "
        "that diverged; a resume that doctor finds unsafe; a refusal (a live writer); a command that failed",
    ),
    (
        USAGE,
        "usage: the command cannot take what it was given",
        "bad arguments; a path that does not exist, or is not what the command takes (a file for a folder, a "
        "folder holding no checkpoint or no run); a spec that cannot be read",
    ),
    (
        LEASE_LOST,
        "lease lost: a newer writer owns the run (a newer attempt, a fresh start), and this command wrote nothing more",
        "a trainer fenced out; a publication overtaken by a fresh start",
    ),
    (
        STOPPED,
        "stopped early: the command stopped as asked, and what it committed is kept",
        "a graceful stop (SIGTERM, a stop file); a warm handoff refused or not admitted in time",
    ),
)


def epilog() -> str:
    """The rule in one paragraph (`relay --help`)."""
    return "exit codes: " + "; ".join(f"{code} {what}" for code, what, _ in RULE)


def table() -> list[str]:
    """The rule as a Markdown table (docs/reference/cli.md)."""
    return [
        "| exit code | what it means | for example |",
        "|---|---|---|",
        *(f"| {code} | {what} | {examples} |" for code, what, examples in RULE),
    ]
