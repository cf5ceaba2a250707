"""The documentation stays true to the code: the generated references (every spec key, every command) are what
the code says now, every key of every shipped spec and every command is documented, and the repository speaks of
the product, never of how it was built."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from support.helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import docs_reference


def test_the_generated_references_are_not_stale():
    for path, build in docs_reference.PAGES.items():
        assert path.read_text() == build(), f"{path.relative_to(ROOT)} is stale: run `python scripts/docs_reference.py`"


def _keys(node, prefix=""):
    for key, value in (node or {}).items():
        yield f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _keys(value, f"{prefix}{key}.")


def test_every_key_of_every_shipped_spec_and_every_command_is_in_the_reference():
    spec_page = docs_reference.SPEC_PAGE.read_text()
    documented = set(re.findall(r"^\| `([^`]+)` \|", spec_page, re.M))
    free_form = ("ray.env_vars.", "audit.tolerance.", "airflow.retry_on.", "ray.entrypoint_resources.")
    for spec in sorted((ROOT / "include" / "runs").glob("*.yaml")):
        for key in _keys(yaml.safe_load(spec.read_text())):
            if key.startswith(free_form):
                continue  # a map whose keys are the user's (an environment variable, a metric, a cause)
            assert key in documented, f"{spec.name}: {key} is not in {docs_reference.SPEC_PAGE.name}"
    assert "| — |" not in spec_page, "every key says what it is"

    from relay.cli import build_parser

    cli_page = docs_reference.CLI_PAGE.read_text()
    for path, _ in docs_reference._commands(build_parser(prog="relay"), []):
        assert f"## `relay {' '.join(path)}`" in cli_page


def test_the_repository_speaks_of_the_product_not_of_how_it_was_built():
    history = re.compile(
        r"\bstops? [0-9]+|rehearsal|(an earlier|a later|the previous) session|\b(that|same|faster) day\b|an earlier run\b",
        re.I,
    )
    product = re.compile(r"a team's (own )?rehearsal of a crash", re.I)
    found = []
    for path in [
        ROOT / "README.md",
        ROOT / "CHANGELOG.md",
        *(ROOT / "docs").rglob("*.md"),
        *(ROOT / "plugins").rglob("*.py"),
        *(ROOT / "tests").rglob("*.py"),
    ]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if history.search(product.sub("", line)) and path != Path(__file__).resolve():
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not found, "\n".join(found)


def test_the_site_builds_strictly(tmp_path):
    """MkDocs in strict mode: every page in the navigation, every internal link and anchor resolves."""
    r = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "mkdocs"), "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_the_layer_order_is_written_as_the_architecture_test_checks_it():
    """docs/architecture.md and the package's docstring draw the layers; the architecture test's list is the one
    that is enforced, so both must say the same."""
    sys.path.insert(0, str(ROOT / "tests" / "project"))
    from test_architecture import LAYERS

    line = " < ".join(LAYERS)
    assert f"    {line}\n" in (ROOT / "docs" / "architecture.md").read_text(), f"docs/architecture.md must draw: {line}"
    doc = " ".join((ROOT / "plugins" / "relay" / "__init__.py").read_text().split('"""')[1].split())
    assert " ".join(line.split()) in doc, f"relay/__init__.py's docstring must draw: {line}"


def test_the_sites_home_page_is_the_readme():
    """One source: docs/index.md holds only the hook's marker, and the hook turns the README's links into the
    site's (the strict build above resolves every one of them)."""
    import mkdocs_readme

    assert (ROOT / "docs" / "index.md").read_text().strip() == mkdocs_readme.MARKER
    home = mkdocs_readme.site_home((ROOT / "README.md").read_text())
    assert "](docs/" not in home and "](CHANGELOG.md)" not in home
    assert home.splitlines()[0] == (ROOT / "README.md").read_text().splitlines()[0]


# What a team reads to implement a trainer kind (docs/reference/trainer-api.md), the spec it configures, and the
# operations both front-ends call: every public definition says what it is (ruff's D1 rules).
DOCUMENTED = [
    "plugins/relay/spec",
    "plugins/relay/trainers/contract.py",
    "plugins/relay/trainers/session.py",
    "plugins/relay/trainers/batches.py",
    "plugins/relay/ops",
]


def test_the_trainer_contract_the_spec_model_and_the_operations_have_docstrings():
    r = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "ruff"), "check", "--no-cache", "--select", "D1", "--output-format", "concise"]
        + [str(ROOT / p) for p in DOCUMENTED],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_demo_output_in_the_docs_is_the_recorded_transcript():
    """The demo's output is shown from one source: the transcript in docs/quickstart.md that the demo's DAG test
    records (tests/support/demo_transcript.py). The README's excerpt is lines of it (attempt ids shortened to
    `...-cNN-tN`), and no other page shows the demo's output."""
    from support import demo_transcript

    recorded = demo_transcript.shape(demo_transcript.in_docs())
    assert len(recorded) > 5 and recorded[0].startswith("[demo] chunk N's trainer will be killed"), recorded[:3]
    short = [re.sub(r"relay-demo-\S+?(-cN-tN:)", r"...\1", line) for line in recorded]
    readme = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("[demo] ")]
    assert readme, "the README shows an excerpt of the demo's output"
    stale = [line for line in demo_transcript.shape(readme) if line not in short]
    assert not stale, f"README lines that the recorded transcript does not say: {stale}"
    for page in sorted((ROOT / "docs").rglob("*.md")):
        if page != demo_transcript.QUICKSTART:
            assert "[demo] " not in page.read_text(), f"{page} shows demo output of its own: show the transcript's"
