"""``python -m kvstore``: the ``kvstore`` command (see ``kvstore.cli``)."""

import sys

from kvstore.cli import main

sys.exit(main())
