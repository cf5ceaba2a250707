"""The offline auditor (scripts/audit_offline.py, for a local OSV advisory database) on advisories it must
and must not match. pip-audit itself (./scripts/audit.sh) needs PyPI's per-version JSON API or OSV,
which these machines cannot reach: it is run by hand where they answer (docs/SECURITY.md), not here."""

from __future__ import annotations

import sys
from importlib.metadata import version

import yaml

from support.helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import audit_offline


def _advisory(db, name: str, id_: str, events: list[dict], **extra) -> None:
    folder = db / "vulns" / name
    folder.mkdir(parents=True, exist_ok=True)
    doc = {
        "id": id_,
        "summary": f"{id_} in {name}",
        "affected": [
            {"package": {"name": name, "ecosystem": "PyPI"}, "ranges": [{"type": "ECOSYSTEM", "events": events}], **extra}
        ],
    }
    (folder / f"{id_}.yaml").write_text(yaml.safe_dump(doc))


def test_the_offline_auditor_matches_osv_ranges(tmp_path):
    have = version("PyYAML")
    major = int(have.split(".")[0])
    _advisory(tmp_path, "PyYAML", "PYSEC-HIT", [{"introduced": "0"}, {"fixed": f"{major + 1}.0"}])
    _advisory(tmp_path, "pyyaml", "PYSEC-FIXED", [{"introduced": "0"}, {"fixed": "3.0"}])
    _advisory(tmp_path, "pyyaml", "PYSEC-LAST", [{"introduced": "1.0"}, {"last_affected": have}])
    _advisory(tmp_path, "pyyaml", "PYSEC-LIST", [], versions=[have])
    _advisory(tmp_path, "not-installed-package", "PYSEC-OTHER", [{"introduced": "0"}])
    (tmp_path / "vulns" / "pyyaml" / "GONE.yaml").write_text(
        yaml.safe_dump(
            {
                "id": "GONE",
                "withdrawn": "2024-01-01",
                "affected": [{"package": {"name": "pyyaml", "ecosystem": "PyPI"}, "versions": [have]}],
            }
        )
    )
    found = {f["id"] for f in audit_offline.audit(tmp_path)}
    assert found == {"PYSEC-HIT", "PYSEC-LAST", "PYSEC-LIST"}
