"""Where the project's own folders are, and how spec paths are resolved against them."""

from __future__ import annotations

import os
import re
from pathlib import Path

# plugins/relay/common/project.py: the package is one folder up, the repo root two folders above it.
_PACKAGE_DIR = Path(__file__).resolve().parent.parent


def root() -> Path:
    """The project root (holding dags/, include/, plugins/). RELAY_PROJECT_ROOT overrides it."""
    env = os.environ.get("RELAY_PROJECT_ROOT")
    return Path(env).resolve() if env else _PACKAGE_DIR.parent.parent


def package_dir() -> Path:
    """The `relay` package folder: what a Ray job's runtime_env ships to the cluster."""
    return _PACKAGE_DIR


def runs_dir() -> Path:
    """Folder of run specs the DAG factory reads. RELAY_RUNS_DIR overrides include/runs."""
    env = os.environ.get("RELAY_RUNS_DIR")
    return Path(env).resolve() if env else root() / "include" / "runs"


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand(value: str) -> str:
    """Expand ${VAR} and ${VAR:-default}. An unset variable without a default is an error."""

    def sub(m: re.Match[str]) -> str:
        name, default = m.group(1), m.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is not None:
            return default
        raise KeyError(name)

    return _VAR.sub(sub, value)


def variables(value: str) -> list[str]:
    """Names of the environment variables that `value` expands (${VAR} or ${VAR:-default})."""
    return [m.group(1) for m in _VAR.finditer(value)]


def resolve_path(value: str) -> Path:
    """Expand variables and make a spec path absolute; relative paths start at the project root."""
    p = Path(os.path.expanduser(expand(value)))
    return p if p.is_absolute() else root() / p
