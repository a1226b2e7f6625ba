"""Where zerorun keeps what it can rebuild (tokenized data, traced model layouts, composed configs): $ZERORUN_CACHE,
else ~/.cache/zerorun. A leaf module, importing nothing of zerorun, so that arch/ (which imports nothing else of
zerorun) and config/ read the same place."""
from __future__ import annotations

import os
from typing import Mapping, Optional

CACHE_ENV = "ZERORUN_CACHE"
"""The environment variable naming zerorun's cache (data.cache_dir, where set, wins for tokenized data)."""


def cache_root(environ: Optional[Mapping[str, str]] = None) -> str:
    """$ZERORUN_CACHE, else ~/.cache/zerorun (not created here)."""
    env = os.environ if environ is None else environ
    return env.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "zerorun")
