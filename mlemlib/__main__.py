"""``python -m mlemlib`` runs the ``mlem`` command line."""

from mlemlib.cli import main

raise SystemExit(main())
