"""The demo's transcript in docs/quickstart.md: what `relay demo` says of its run once the DAG run ended, recorded by
the DAG test that runs the demo's spec and drill (tests/airflow/test_run_dag.py). The test compares what the demo
says of its run with the recorded block, numbers aside (times differ between runs); RELAY_RECORD_DEMO=1 writes the
block anew from the run instead."""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "docs" / "quickstart.md"
BEGIN = "<!-- demo transcript: recorded by tests/airflow/test_run_dag.py; RELAY_RECORD_DEMO=1 records it anew -->"
END = "<!-- end of the demo transcript -->"
RUN_NAME = re.compile(r"demo-\d{8}-\d{6}")
ATTEMPT = re.compile(r"(relay-demo-demo-<date>-<time>-)[0-9a-f]{8}(-c\d\d-t\d+)")


def recorded(lines: list[str], *, checkpoint_dir: Path, s3_uri: str, s3_endpoint: str) -> list[str]:
    """The demo's lines as the docs show them: the machine's folders, the S3 server, the run's time and the DAG run's
    hash as placeholders; the demo spec's own S3 prefix for the test's."""
    text = "\n".join(f"[demo] {line}" for line in lines)
    text = text.replace(str(checkpoint_dir), "<checkpoint_dir>").replace(s3_endpoint, "<s3 endpoint>")
    text = RUN_NAME.sub("demo-<date>-<time>", text.replace(s3_uri, "s3://relay/runs"))
    return ATTEMPT.sub(r"\1<id>\2", text).splitlines()


# Lines whose words follow the run's timings (the largest parts of the wall time, the advised save interval): only
# their label is compared.
TIMED = ("[demo] goodput", "[demo] save interval")


def shape(lines: list[str]) -> list[str]:
    """What must not change between two runs of the demo: every line, its numbers and fingerprints as N and H, and of
    a line about the run's timings its label only."""
    out = []
    for line in lines:
        if line.startswith(TIMED):
            line = line.partition(":")[0]
        out.append(re.sub(r"\d+(\.\d+)?", "N", re.sub(r"\b[0-9a-f]{16}\b", "H", line)))
    return out


def in_docs() -> list[str]:
    """The transcript block of docs/quickstart.md."""
    text = QUICKSTART.read_text()
    assert BEGIN in text and END in text, f"{QUICKSTART} lost its transcript markers"
    block = text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip()
    assert block.startswith("```text\n") and block.endswith("\n```"), "the transcript is one ```text block"
    return block[len("```text\n") : -len("\n```")].splitlines()


def check_or_record(lines: list[str]) -> None:
    """Fail when the demo says of its run other lines than the docs show (numbers aside); with RELAY_RECORD_DEMO=1
    write them into the docs instead."""
    if os.environ.get("RELAY_RECORD_DEMO") == "1":
        text = QUICKSTART.read_text()
        head, tail = text[: text.index(BEGIN) + len(BEGIN)], text[text.index(END) :]
        QUICKSTART.write_text(head + "\n```text\n" + "\n".join(lines) + "\n```\n" + tail)
        return
    docs = in_docs()
    diff = "\n".join(difflib.unified_diff(shape(docs), shape(lines), "docs/quickstart.md", "the demo's run", lineterm=""))
    assert shape(docs) == shape(lines), (
        f"the demo's transcript in docs/quickstart.md is stale; record it anew with RELAY_RECORD_DEMO=1:\n{diff}"
    )
