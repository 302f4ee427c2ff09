"""``python -m mlemlib`` runs the ``mlem`` command line."""

from mlemlib.cli import run

run()
