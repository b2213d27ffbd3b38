"""Files under the storage root: models by content hash, artifacts by job id, uploads in tmp/.

    models/<sha256>/model.onnx   one folder per model, so external data cannot reach another file
    artifacts/<job id>.kiln      written elsewhere, then renamed into place
    tmp/                         uploads being received and artifacts being built
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file's content, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class Storage:
    def __init__(self, root: Path):
        self.root = Path(root)
        for sub in ("models", "artifacts", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    def model_path(self, sha256: str) -> Path:
        return self.root / "models" / sha256 / "model.onnx"

    def artifact_relpath(self, job_id: str) -> str:
        return f"artifacts/{job_id}.kiln"

    def resolve(self, relpath: str) -> Path:
        path = (self.root / relpath).resolve()
        if not path.is_relative_to(self.root.resolve()):
            raise ValueError(f"path {relpath!r} escapes the storage root")
        return path

    def temp_dir(self, prefix: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=prefix, dir=self.tmp))

    def install_model(self, source: Path, sha256: str) -> Path:
        """Move a validated upload to its content address (a no-op when it is there already)."""
        dest = self.model_path(sha256)
        if dest.is_file():
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        staged = dest.with_name(f".model.{os.getpid()}.{os.urandom(4).hex()}")
        shutil.copyfile(source, staged)
        _fsync(staged)
        os.replace(staged, dest)
        return dest

    def install_artifact(self, source: Path, job_id: str) -> Path:
        dest = self.resolve(self.artifact_relpath(job_id))
        _fsync(source)
        os.replace(source, dest)
        return dest


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
