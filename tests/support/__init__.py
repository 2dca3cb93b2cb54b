"""Helpers the tests share: real stores, daemons, Redis fixtures, transformers models.

``TESTS`` is the tests folder (on ``sys.path``, which is how ``support`` imports,
in subprocesses too) and ``REPO`` the checkout, so a test finds files by name,
wherever in the tree it sits. ``PUBLIC_TRACES`` is where the few tests that need
whole public trace sets (Mooncake's, kv-cache-tester's, TraceLab's) find them:
``$KVSTORE_TEST_TRACES``, else a ``shared/data/traces`` folder beside the checkout;
without them those tests skip with that reason. Every other test reads the small
traces that ship in ``tests/fixtures/``.
"""

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
PUBLIC_TRACES = Path(
    os.environ.get("KVSTORE_TEST_TRACES") or REPO.parent / "shared" / "data" / "traces"
)
