"""pyproject.toml declares the ranges of what Relay's code imports; requirements.txt pins the tested versions inside
them."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib

from packaging.requirements import Requirement

from support.helpers import ROOT

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


DECLARED = {canonical(Requirement(r).name): Requirement(r) for r in PROJECT["dependencies"]}
OPTIONAL = {canonical(Requirement(r).name) for rs in PROJECT["optional-dependencies"].values() for r in rs}


def pins() -> dict[str, str]:
    out = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        if m := re.match(r"^([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==([^\s#;]+)", line):
            out[canonical(m[1])] = m[2]
    return out


def test_every_tested_version_of_a_declared_dependency_is_inside_its_range():
    """The pin where requirements.txt has one; else (a package another one brings) the version installed here."""
    pinned = pins()
    tested = {name: pinned.get(name) or importlib.metadata.version(name) for name in DECLARED}
    outside = [
        f"{name} {version} is outside {DECLARED[name]}"
        for name, version in tested.items()
        if not DECLARED[name].specifier.contains(version.split("+")[0], prereleases=True)
    ]
    assert not outside, outside


def test_every_package_relays_code_imports_is_declared():
    distributions = importlib.metadata.packages_distributions()
    missing = set()
    for path in (ROOT / "plugins" / "relay").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                else []
            )
            for top in {n.split(".")[0] for n in names} - set(sys.stdlib_module_names) - {"relay"}:
                if top == "airflow":  # apache-airflow and its providers share the name
                    providers = {n.split(".")[2] for n in names if n.startswith("airflow.providers.")}
                    want = {f"apache-airflow-providers-{p}" for p in providers} or {"apache-airflow"}
                else:
                    want = {canonical(d) for d in distributions.get(top, [top])}
                if not want & (set(DECLARED) | OPTIONAL):
                    missing.add(f"{top} ({path.relative_to(ROOT)})")
    assert not missing, f"imported by plugins/relay, not declared in pyproject.toml: {sorted(missing)}"
