"""attnlab's folder on this machine's own disk: ``$ATTNLAB_CACHE_DIR``, else ``$XDG_CACHE_HOME/attnlab``, else
``~/.cache/attnlab``. What lives there: the demo corpus and its prepared folders, the per-node shard cache, the
work folder of a prepare into a bucket, local Optuna storage and log files of runs whose folder is remote.
Nothing a study's result depends on is kept only here."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    if os.environ.get("ATTNLAB_CACHE_DIR"):
        return Path(os.environ["ATTNLAB_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnlab"
