"""Files written safely: a checksum, the usual permissions, and a folder moved into
place whole (a cache shared by several processes never sees a half-written model)."""
from __future__ import annotations

import hashlib
import os
import secrets
import shutil
from pathlib import Path


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Return the hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def apply_umask_permissions(folder: Path) -> None:
    """Give the files in ``folder`` the usual umask-derived mode.

    Some writers (e.g. safetensors) create their file 0600; a cache shared by
    several users of one machine should be readable like any other download.
    """
    umask = os.umask(0)
    os.umask(umask)
    for f in folder.iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~umask)


def move_into_place(tmp: Path, dst: Path, overwrite: bool) -> None:
    """Rename the finished ``tmp`` folder to ``dst``, replacing an old ``dst`` if allowed."""
    if not dst.exists():
        os.replace(tmp, dst)
        return
    if not overwrite:
        raise FileExistsError(f"output folder {str(dst)!r} appeared during conversion")
    # Rename the old folder aside first so ``dst`` is never a half-deleted mix.
    trash = dst.parent / f".{dst.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
    os.replace(dst, trash)
    os.replace(tmp, dst)
    shutil.rmtree(trash, ignore_errors=True)
