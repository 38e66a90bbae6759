"""``python -m attnlab ...``: the ``attnlab`` command, without depending on a PATH (a Ray job's entrypoint uses it)."""

import sys

from attnlab.cli import main

sys.exit(main())
