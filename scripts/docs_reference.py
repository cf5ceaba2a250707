"""Write the generated reference pages of the documentation: docs/reference/spec.md (every key of a run spec,
from the spec's pydantic models and each trainer kind's settings model), docs/reference/cli.md (every command,
from the CLI's own parser) and docs/reference/verl-contract.md (every touch point of verl Relay relies on, from
relay.trainers.verl_ppo.verl_contract). `python scripts/docs_reference.py` (re)writes both; `--check` exits 1 when either is
stale. tests/project/test_docs.py fails when one is, so the pages never drift from the code."""

from __future__ import annotations

import argparse
import sys
import types
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugins"))

from pydantic import BaseModel  # noqa: E402
from pydantic_core import PydanticUndefined  # noqa: E402

SPEC_PAGE = ROOT / "docs" / "reference" / "spec.md"
CLI_PAGE = ROOT / "docs" / "reference" / "cli.md"
NO_DESCRIPTION = "—"


def _type(annotation) -> str:
    """A field's type as a reader writes it in YAML."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        parts = [_type(a) for a in args if a is not type(None)]
        return " \\| ".join(parts) + (" \\| null" if type(None) in args else "")
    if origin in (list, tuple):
        return f"list of {_type(args[0])}" if args else "list"
    if origin is dict:
        return f"map of {_type(args[0])} to {_type(args[1])}" if args else "map"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    name = getattr(annotation, "__name__", str(annotation))
    return {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "date": "date", "Any": "any"}.get(
        name, name
    )


def _default(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, BaseModel):
            return "(section)"
    elif field.default is PydanticUndefined:
        return "**required**"
    else:
        value = field.default
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    return f"`{value}`" if value not in ("", [], {}) else f"`{value!r}`" if value == "" else f"`{value}`"


def _model_of(annotation) -> type[BaseModel] | None:
    for a in (annotation, *typing.get_args(annotation)):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def spec_rows(model: type[BaseModel], prefix: str = "", inherited: bool = False) -> list[tuple]:
    """(key, type, default, resume-critical, description) of every key of `model`, sub-sections flattened."""
    from relay.spec.model import is_critical

    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        critical = inherited or is_critical(model, name)
        sub = _model_of(field.annotation)
        desc = (field.description or NO_DESCRIPTION).replace("|", "\\|").replace("\n", " ")
        if sub is not None:
            rows.append((key, "section", _default(field), critical, desc))
            rows += spec_rows(sub, key + ".", critical)
        elif key == "trainer.settings":  # each kind's settings have a table of their own, below
            rows.append((key, "section", "(the kind's)", critical, desc))
        else:
            rows.append((key, _type(field.annotation), _default(field), critical, desc))
    return rows


def spec_page() -> str:
    from relay.spec.kinds import KINDS
    from relay.spec.run_spec import RunSpec

    def table(rows) -> list[str]:
        out = ["| key | type | default | resume-critical | what it is |", "|---|---|---|---|---|"]
        out += [f"| `{k}` | {t} | {d} | {'yes' if c else ''} | {desc} |" for k, t, d, c, desc in rows]
        return out

    lines = [
        "# Run spec reference",
        "",
        "Generated from the spec's models by `python scripts/docs_reference.py`; do not edit by hand.",
        "",
        "A run spec is a YAML file in `include/runs/`; one DAG per spec (`relay_<name>`). Unknown keys are "
        "errors. A **resume-critical** key must not change between the chunks of one training run: changing it "
        "turns the run into another experiment, so the DAG's `preflight.settings` refuses the change unless "
        "the DAG run's `allow_drift` Param names the key or a person approves it in the UI. How to write one: "
        "[Write a run spec](../guides/run-spec.md).",
        "",
        "## Top level and sections",
        "",
    ]
    lines += table(spec_rows(RunSpec))
    for kind in KINDS.values():
        model = kind.settings_model()
        lines += ["", f"## `trainer.settings` of kind `{kind.name}`", "", f"{kind.description}.", ""]
        lines += table(spec_rows(model, "trainer.settings.", True))
    return "\n".join(lines) + "\n"


def _commands(parser: argparse.ArgumentParser, path: list[str]):
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    if sub is None:
        yield path, parser
        return
    helps = {a.dest: a.help for a in sub._choices_actions}
    for name, child in sub.choices.items():
        child._relay_help = helps.get(name)  # type: ignore[attr-defined]
        yield from _commands(child, [*path, name])


def cli_page() -> str:
    import os

    from relay.cli import build_parser
    from relay.cli.exit_codes import table

    os.environ["COLUMNS"] = "100"  # argparse wraps usage lines at the terminal's width: the page is the same everywhere

    parser = build_parser(prog="relay")
    lines = [
        "# CLI reference",
        "",
        "Generated from the CLI's parser by `python scripts/docs_reference.py`; do not edit by hand.",
        "",
        "`.venv/bin/relay ...` (or `.venv/bin/python -m relay ...`). Standard AWS variables configure S3 "
        "(`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, ...).",
        "",
        "Every command exits by one rule (`relay.cli.exit_codes`):",
        "",
        *table(),
        "",
    ]
    for path, cmd in _commands(parser, []):
        name = "relay " + " ".join(path)
        lines += [
            f"## `{name}`",
            "",
            (getattr(cmd, "_relay_help", None) or cmd.description or "").strip(),
            "",
            "```text",
            cmd.format_usage().replace("usage: ", "").strip(),
            "```",
            "",
        ]
        rows = []
        for a in cmd._actions:
            if isinstance(a, argparse._HelpAction) or a.help == argparse.SUPPRESS:
                continue
            what = " ".join(f"`{o}`" for o in a.option_strings) or f"`{a.dest}`"
            extra = f" (one of: {', '.join(map(str, a.choices))})" if a.choices else ""
            help_text = (a.help or "").replace("|", "\\|").replace("%%", "%")
            rows.append(f"| {what} | {help_text}{extra} |")
        if rows:
            lines += ["| argument | what it is |", "|---|---|", *rows, ""]
    return "\n".join(lines).rstrip() + "\n"


def contract_page() -> str:
    """Every touch point of verl's (and torch's) that Relay relies on without a public promise, from the contract's
    own list (relay.trainers.verl_ppo.verl_contract.TOUCH_POINTS)."""
    from relay.trainers.verl_ppo import verl_contract as contract

    lines = [
        "# verl's contract",
        "",
        "<!-- generated by scripts/docs_reference.py from relay.trainers.verl_ppo.verl_contract; do not edit -->",
        "",
        "What Relay relies on in verl (and torch) that is not documented as public, why, and the version it was read in.",
        "A job's driver checks every entry before it trains and refuses a verl where one is gone or changed shape, naming",
        "it; `relay doctor SPEC` runs the same checks on the cluster. The loop-bound facts (`PPOTrainer._init_dataloader`,",
        "`fit`, `_setup`) have a fallback instead: chunks then end through `total_training_steps`, and a horizon-dependent",
        "LR schedule is refused in chunks. Entries marked *CPU* matter only on the CPU platform",
        f"(`relay.trainers.verl_ppo.cpu`). Relay was built against verl {contract.PINNED}.",
        "",
        "| symbol | since | what it has to have | why Relay needs it | CPU |",
        "|---|---|---|---|---|",
    ]
    for p in contract.TOUCH_POINTS:
        shape = []
        if p.params:
            shape.append("parameters " + ", ".join(f"`{x}`" for x in p.params))
        if p.keys:
            shape.append("keys " + ", ".join(f"`{x!r}`" for x in p.keys))
        if p.source:
            shape.append("source with " + "; ".join(f"`{x}`" for x in p.source).replace("|", "\\|"))
        if p.shape is not None:
            shape.append((p.shape.__doc__ or "").strip().split("\n")[0] or "a shape check of its own")
        cells = [f"`{p.symbol}`", f"{p.package} {p.since}", "; ".join(shape) or "exists", p.why.replace("|", "\\|")]
        lines.append("| " + " | ".join([*cells, "*CPU*" if p.cpu_only else ""]) + " |")
    return "\n".join(lines) + "\n"


CONTRACT_PAGE = ROOT / "docs" / "reference" / "verl-contract.md"
PAGES = {SPEC_PAGE: spec_page, CLI_PAGE: cli_page, CONTRACT_PAGE: contract_page}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="exit 1 if a page is stale; write nothing")
    stale = []
    args = ap.parse_args()
    for path, build in PAGES.items():
        text = build()
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path.relative_to(ROOT))
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(("stale: " if args.check else "wrote: ") + ", ".join(map(str, stale)))
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
