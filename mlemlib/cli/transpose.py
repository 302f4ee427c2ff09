"""``mlem transpose``: placeholder until its stage lands (replace this module)."""

from __future__ import annotations


def register(sub) -> None:
    """Register nothing yet."""
