"""Audit the installed packages of a Python environment against a local OSV advisory database, for
machines where pip-audit's vulnerability services (PyPI's JSON API per version, OSV) cannot be
reached. DB is a checkout of github.com/pypa/advisory-database (vulns/<package>/*.yaml, OSV schema)
or any folder of OSV .json/.yaml files.

    .venv/bin/python scripts/audit_offline.py DB [--json]      exit 0: no finding, 1: findings

Run it with the interpreter of the environment to audit: it reads that environment's installed
distributions (the exact pins requirements.txt resolved to, dependencies included).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from importlib.metadata import distributions
from pathlib import Path

import yaml
from packaging.version import InvalidVersion, Version


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, str]:
    return {canonical(d.metadata["Name"]): d.version for d in distributions() if d.metadata["Name"]}


def advisories(db: Path):
    for path in sorted(db.rglob("*")):
        if path.suffix not in (".yaml", ".yml", ".json") or not path.is_file():
            continue
        try:
            doc = yaml.safe_load(path.read_text()) if path.suffix != ".json" else json.loads(path.read_text())
        except Exception:  # noqa: BLE001 - one unreadable advisory must not stop the audit
            continue
        if isinstance(doc, dict) and doc.get("affected") and not doc.get("withdrawn"):
            yield path, doc


def _v(text: str) -> Version | None:
    try:
        return Version(str(text))
    except InvalidVersion:
        return None


def affects(entry: dict, version: str) -> bool:
    """OSV `affected` entry: the explicit versions list, or ECOSYSTEM ranges (introduced/fixed/last_affected)."""
    if version in [str(v) for v in entry.get("versions") or []]:
        return True
    v = _v(version)
    if v is None:
        return False
    for rng in entry.get("ranges") or []:
        if rng.get("type") != "ECOSYSTEM":
            continue
        inside = False
        for ev in rng.get("events") or []:
            if "introduced" in ev:
                intro = _v(ev["introduced"]) if str(ev["introduced"]) != "0" else Version("0")
                inside = intro is not None and v >= intro
            elif "fixed" in ev and inside and (f := _v(ev["fixed"])) is not None and v >= f:
                inside = False
            elif "last_affected" in ev and inside and (la := _v(ev["last_affected"])) is not None and v > la:
                inside = False
        if inside:
            return True
    return False


def fixed_in(entry: dict) -> list[str]:
    return [str(ev["fixed"]) for rng in entry.get("ranges") or [] for ev in rng.get("events") or [] if "fixed" in ev]


def audit(db: Path) -> list[dict]:
    have = installed()
    out = []
    for path, doc in advisories(db):
        for entry in doc["affected"]:
            pkg = entry.get("package") or {}
            if pkg.get("ecosystem") != "PyPI":
                continue
            name = canonical(pkg.get("name", ""))
            if name in have and affects(entry, have[name]):
                out.append(
                    {
                        "package": name,
                        "version": have[name],
                        "id": doc.get("id"),
                        "aliases": doc.get("aliases") or [],
                        "fixed_in": fixed_in(entry),
                        "summary": (doc.get("summary") or doc.get("details") or "").strip().splitlines()[0][:160]
                        if (doc.get("summary") or doc.get("details"))
                        else "",
                        "file": str(path.relative_to(db)),
                    }
                )
    return sorted(out, key=lambda f: (f["package"], f["id"] or ""))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("db", type=Path)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not args.db.is_dir():
        print(f"audit: {args.db} is not a folder of OSV advisories", file=sys.stderr)
        return 2
    findings = audit(args.db)
    if args.json:
        print(json.dumps(findings, indent=2))
    else:
        print(f"{len(installed())} installed distributions audited against {args.db}: {len(findings)} findings")
        for f in findings:
            print(
                f"  {f['package']} {f['version']}: {f['id']} {' '.join(f['aliases'])} fixed in "
                f"{', '.join(f['fixed_in']) or '?'}: {f['summary']}"
            )
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
