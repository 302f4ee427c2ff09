"""``mlem kernels``: the kernel registry as a table (host side; no GPU needed).

Every name ``fp:`` and ``bp:`` accept, per backend and operation, with the
formats it reads, whether it is deterministic, where it runs on several GPUs,
whether a CUDA graph captures it and where its code is, then what ``auto``
means (:mod:`mlemlib.registry`).
"""

from __future__ import annotations

from mlemlib import registry
from mlemlib.cli._common import add_parser
from mlemlib.errors import EXIT_OK


def register(sub) -> None:
    """Add the ``kernels`` subcommand."""
    p = add_parser(
        sub,
        "kernels",
        "List every SpMV kernel (fp:/bp: names) with its operation, format, backend and determinism.",
        epilog="example: mlem kernels --json | jq '.kernels[] | select(.deterministic)'",
    )
    p.add_argument("-j", "--json", action="store_true", help="print JSON instead of a Markdown table")
    p.set_defaults(func=run)


def run(args) -> int:
    """Print the registry."""
    print(registry.table(as_json=args.json))
    return EXIT_OK
