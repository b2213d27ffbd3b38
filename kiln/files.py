"""Files Kiln writes: the cache folder, and writes that never leave a half-written file behind."""
from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def cache_dir() -> Path:
    """`$KILN_CACHE_DIR`, default `~/.cache/kiln`: compiled objects, machine facts, profiles."""
    return Path(os.environ.get("KILN_CACHE_DIR") or Path.home() / ".cache" / "kiln")


@contextmanager
def temporary_beside(path: Path) -> Iterator[Path]:
    """A fresh temporary path in `path`'s folder (so a rename onto `path` is atomic), removed on
    exit unless it was renamed away."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(name)
    finally:
        Path(name).unlink(missing_ok=True)


def write_atomic(path: str | Path, data: bytes | str, durable: bool = False) -> None:
    """Write `data` to `path` through a temporary file beside it and a rename: readers see the old
    file or the new one, never part of one. `durable` also syncs the data to disk first."""
    path = Path(path)
    with temporary_beside(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
