"""`python -m relay ...`: the core, from a terminal.

Standard AWS environment variables configure S3 (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...).

The command line sits above every layer but airflow; it imports the core through relay.ops (and relay.common), the
local stack from relay.devstack, never relay.airflow; no layer imports it. One module per group of commands, each
adding its parsers (`add_commands`); what they share is in `shared`.
"""

from __future__ import annotations

import argparse
import sys

from relay.cli import checkpoints, data, doctor, insights, runs, stack
from relay.cli.exit_codes import epilog
from relay.cli.shared import _Parser
from relay.cli.shared import _store as _store  # relay.cli._store: an upload command's store
from relay.common.errors import RelayError
from relay.common.quiet import quiet_known_noise

# `relay --help` opens with the docstring's first two paragraphs, what relay is; the third is about the code.
DESCRIPTION = "\n\n".join((__doc__ or "").split("\n\n")[:2])


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    # `relay ...` (the console script) or `python -m relay ...`: usage lines name what was typed
    prog = prog or ("python -m relay" if sys.argv[0].endswith("__main__.py") else "relay")
    p = _Parser(prog=prog, description=DESCRIPTION, epilog=epilog())
    sub = p.add_subparsers(dest="command", required=True)
    for group in (runs, checkpoints, doctor, data, insights, stack):  # `relay --help` lists the commands in this order
        group.add_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    quiet_known_noise()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except RelayError as e:
        print(f"relay: {e}", file=sys.stderr)
        return e.exit_code
