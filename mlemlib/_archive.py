"""The commit a ``git archive`` of the repository was made from (``export-subst`` in ``.gitattributes`` fills it in).

In a git checkout it stays the unexpanded placeholder, and the checkout itself says which commit it is
(:func:`mlemlib.bench.runner.git_commit`).
"""

COMMIT = "$Format:%h$"
