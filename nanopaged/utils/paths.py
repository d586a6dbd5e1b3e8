"""Where nanopaged keeps its files: the converted models and the kernel builds."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Return nanopaged's cache folder (not created here).

    ``$NANOPAGED_CACHE`` if set, else ``$XDG_CACHE_HOME/nanopaged``, else
    ``~/.cache/nanopaged``.
    """
    explicit = os.environ.get("NANOPAGED_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "nanopaged"
    return Path.home() / ".cache" / "nanopaged"
