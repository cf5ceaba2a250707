"""The package's shape: folders in layers, each importing only the layers below it, no import circles,
Airflow only in relay/airflow, and nothing that ships to Ray jobs importing what stays behind.

The layers (docs/architecture.md draws them), lowest first; the command line (cli/) sits above every layer but
airflow, beside it, and __main__.py above them all.
"""

import ast
import re
from collections import defaultdict
from pathlib import Path

from relay.jobs.ray_jobs import NOT_SHIPPED
from relay.spec.kinds import BUILT_IN

PACKAGE = Path(__file__).resolve().parents[2] / "plugins" / "relay"
LAYERS = [
    "common",
    "spec",
    "runs",
    "data",
    "checkpoints",
    "s3",
    "preflight",
    "insights",
    "trainers",
    "jobs",
    "alerts",
    "ops",
    "devstack",
    "airflow",
]
CLI = "cli"  # may import every layer but airflow; no layer imports it
TOP = {"__init__", "__main__"}


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        parts = p.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


MODULES = _modules()


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every relay import, those inside functions too."""
    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            names = [f"{n.module}.{a.name}" for a in n.names]
            out += [(n.lineno, m if m in MODULES else n.module) for m in names]
        elif isinstance(n, ast.Import):
            out += [(n.lineno, a.name) for a in n.names]
    return [(line, m) for line, m in out if m == "relay" or m.startswith("relay.")]


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in [*LAYERS, CLI]) else "top"


def _may_import(src: str, dst: str) -> bool:
    """Whether folder src may import folder dst: a layer those below it and itself, the CLI every layer but airflow."""
    if CLI in (src, dst):
        return src == CLI and dst != "airflow"
    return LAYERS.index(dst) <= LAYERS.index(src)


def test_every_folder_is_a_layer_with_a_docstring_saying_what_it_owns():
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == sorted([*LAYERS, CLI]), "a new folder needs its place in LAYERS and in docs/architecture.md"
    loose = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in TOP)
    assert not loose, f"modules outside the folders: {loose}"
    for name in [*LAYERS, CLI]:
        doc = ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text()))
        assert doc and "import" in doc, f"relay/{name}/__init__.py must say what it owns and what it may import"


def test_no_import_runs_upward():
    upward = []
    for module, path in MODULES.items():
        src = _folder(module)
        if src == "top":
            continue
        for line, target in _imports(path):
            dst = _folder(target)
            if dst == "top" and target != "relay":  # relay.__main__
                upward.append(f"{path.relative_to(PACKAGE)}:{line} imports {target}")
            elif dst != "top" and not _may_import(src, dst):
                upward.append(f"{path.relative_to(PACKAGE)}:{line} ({src}) imports {target} ({dst}), a folder not below it")
    assert not upward, "\n".join(upward)


def test_checkpoints_know_no_spec():
    """A checkpoint is checked against what the caller hands over (a smoke function, a fingerprint), never
    against a spec it reads itself: the spec, and the Run value that carries one, stay above."""
    offenders = [
        f"{path.relative_to(PACKAGE)}:{line} imports {target}"
        for module, path in MODULES.items()
        if _folder(module) == "checkpoints"
        for line, target in _imports(path)
        if _folder(target) == "spec" or target == "relay.runs.run"
    ]
    assert not offenders, offenders


def test_no_import_circles():
    """Imports inside functions count: a circle that closes only when a function runs still ties the modules
    together (a change to one breaks the other, and the order in which they first load decides what works)."""
    graph = defaultdict(set)
    for module, path in MODULES.items():
        for _, target in _imports(path):
            # importing relay.a.b runs relay.a's __init__ too; the edge that matters is to the module itself
            if target != module and target in MODULES:
                graph[module].add(target)
    seen, stack, cycles = set(), [], []

    def visit(m: str) -> None:
        if m in stack:
            cycles.append(" -> ".join([*stack[stack.index(m) :], m]))
            return
        if m in seen:
            return
        seen.add(m)
        stack.append(m)
        for t in sorted(graph[m]):
            visit(t)
        stack.pop()

    for m in sorted(MODULES):
        visit(m)
    assert not cycles, "\n".join(cycles)


def test_only_the_airflow_folder_imports_airflow():
    offenders = []
    for module, path in MODULES.items():
        if _folder(module) == "airflow":
            continue
        for n in ast.walk(ast.parse(path.read_text())):
            names = (
                [n.module or ""]
                if isinstance(n, ast.ImportFrom) and n.level == 0
                else [a.name for a in n.names]
                if isinstance(n, ast.Import)
                else []
            )
            offenders += [f"{module}:{n.lineno}" for name in names if name.split(".")[0] == "airflow"]
    assert not offenders, offenders


def test_what_ships_to_ray_jobs_never_imports_what_stays_behind():
    behind = {f.strip("/") for f in NOT_SHIPPED}
    assert behind == {"devstack", "airflow"}
    offenders = [
        f"{module} imports {target}"
        for module, path in MODULES.items()
        if _folder(module) not in {*behind, CLI} and module != "relay.__main__"
        for _, target in _imports(path)
        if _folder(target) in behind
    ]
    assert not offenders, offenders


def test_a_runs_folder_is_worked_out_in_one_place():
    """The run is a value (relay.runs.run.Run): its folder comes from `spec.run_dir(name)` in Run.of only,
    so the folder of a run, from the trigger form's name to the trainer's default_local_dir and the S3
    key, never goes back and forth between a spec and a bare name."""
    calls = []
    for _module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "run_dir":
                calls.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert calls and all(c.startswith("runs/run.py:") for c in calls), calls


def test_the_production_path_reads_without_the_cpu_stand_ins():
    """verl's CPU platform (relay.trainers.verl_ppo.cpu) is imported only by verl itself (VERL_USE_EXTERNAL_MODULES),
    by itself, and inside the functions that ask for a CPU stand-in by name (`tiny_model: true`, `relay model tiny`):
    no module imports it at its top."""
    cpu = "relay.trainers.verl_ppo.cpu"
    found = []
    for module, path in MODULES.items():
        if module == cpu or module.startswith(cpu + "."):
            continue
        top = [n for n in ast.parse(path.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = [n.module or "" for n in top if isinstance(n, ast.ImportFrom)] + [
            a.name for n in top if isinstance(n, ast.Import) for a in n.names
        ]
        found += [f"{module} imports {name}" for name in names if name == cpu or name.startswith(cpu + ".")]
    assert not found, found


def _kind_package(module: str) -> str | None:
    """The trainer kind whose package holds `module` (relay.trainers.<kind>...), or None."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "trainers" and parts[2] in BUILT_IN else None


def test_the_core_asks_a_trainer_kind_what_it_can_do_never_which_kind_it_is():
    """A kind's name (as a string the code compares or looks up) and an import of its package appear only in that
    kind's package and in the registry (relay.spec.kinds): the rest of Relay reads a kind's capabilities and
    parts, so that a team's own kind (the entry point group relay.trainers) needs no change to Relay."""
    registry = "relay.spec.kinds"
    found = []
    for module, path in MODULES.items():
        if module == registry:
            continue
        own = _kind_package(module)
        tree = ast.parse(path.read_text())
        docstrings = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body
            and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)
        }
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings:
                named = [k for k in BUILT_IN if k != own and re.search(rf"\b{k}\b", n.value) and "." not in n.value]
                found += [f"{path.relative_to(PACKAGE)}:{n.lineno} names the kind {k!r}" for k in named]
        for line, target in _imports(path):
            kind = _kind_package(target)
            if kind is not None and kind != own:
                found.append(f"{path.relative_to(PACKAGE)}:{line} imports {target}")
    assert not found, "\n".join(found)


FRONT_ENDS = ("cli", "airflow")
CORE = LAYERS[: LAYERS.index("ops")]  # what runs a run; devstack (the local stack a person starts) sits above ops


def test_the_front_ends_reach_the_core_through_the_operations_layer():
    """cli/ and airflow/ import the core only through relay.ops (and common): what a person or a DAG does to a run is
    composed once there, and the front-ends add only their own concerns (arguments and printing; Airflow's context,
    XCom, links, deferral)."""
    found = [
        f"{path.relative_to(PACKAGE)}:{line} imports {target}"
        for module, path in MODULES.items()
        if _folder(module) in FRONT_ENDS
        for line, target in _imports(path)
        if _folder(target) in CORE and _folder(target) != "common"
    ]
    assert not found, "import the core through relay.ops instead:\n" + "\n".join(found)
