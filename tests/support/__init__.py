"""Helpers the tests share: real stores, daemons, Redis fixtures, transformers models.

``TESTS`` is the tests folder (on ``sys.path``, which is how ``support`` imports,
in subprocesses too) and ``REPO`` the checkout, so a test finds files by name,
wherever in the tree it sits.
"""

from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
