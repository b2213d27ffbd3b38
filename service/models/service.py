"""Receiving, validating and recording uploaded models.

An upload is streamed to a private temporary folder (hashing as it goes, refusing it past the size
limit), validated there by kiln's frontend (so external data can only be looked for beside it),
and only then copied to its content address and recorded. Whatever fails, the folder is removed.
"""
from __future__ import annotations

import hashlib
import math
import re
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from service.db import Database
from service.models.tables import ModelRecord
from service.problems import APIError
from service.storage import Storage

_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass
class Upload:
    folder: Path  # private temporary folder; remove with discard()
    path: Path
    sha256: str
    size: int
    filename: str

    def discard(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def too_large(limit: int) -> APIError:
    return APIError(413, "Content Too Large", f"the upload exceeds the size limit of {limit} bytes "
                    "(KILN_MAX_UPLOAD_BYTES)")


def clean_filename(name: str | None) -> str:
    name = _SAFE_NAME.sub("_", Path(name or "model.onnx").name)[:200].strip("._")
    return name or "model.onnx"


async def receive(chunks: AsyncIterator[bytes], storage: Storage, limit: int,
                  filename: str | None) -> Upload:
    folder = storage.temp_dir("upload-")
    filename = clean_filename(filename)
    path = folder / filename  # so that the frontend's messages name the user's file
    digest, size = hashlib.sha256(), 0
    try:
        with path.open("wb") as out:
            async for chunk in chunks:
                size += len(chunk)
                if size > limit:
                    raise too_large(limit)
                digest.update(chunk)
                out.write(chunk)
        if size == 0:
            raise APIError(422, "Invalid Model", "the request body is empty: send the ONNX file "
                           "as the body (Content-Type: application/octet-stream)")
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return Upload(folder, path, digest.hexdigest(), size, filename)


def inspect(path: Path) -> tuple[int, list[dict[str, Any]]]:
    """Validate with kiln's frontend; return the opset and the graph inputs. Raises ModelError."""
    from onnx import helper

    from kiln import frontend

    model = frontend.read_model(path, external_data=False)
    opset = frontend.check_model(model)
    for tensor in model.graph.initializer:
        _check_size(f"initializer {tensor.name!r}", list(tensor.dims))
    initializers = {t.name for t in model.graph.initializer}
    inputs = []
    for info in model.graph.input:
        if info.name in initializers:
            continue
        ttype = info.type.tensor_type
        try:
            dtype = str(helper.tensor_dtype_to_np_dtype(ttype.elem_type))
        except (KeyError, ValueError):
            dtype = f"onnx:{ttype.elem_type}"
        dims: list[int | str] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?")
                                 for d in ttype.shape.dim]
        _check_declared_dims(info.name, dims)
        inputs.append({"name": info.name, "dtype": dtype, "shape": dims})
    return opset, inputs


def _check_declared_dims(name: str, dims: list[int | str]) -> None:
    """Refuse what the worker would: a fixed dimension must be positive, the size bounded."""
    from kiln.errors import ModelError

    for axis, dim in enumerate(dims):
        if isinstance(dim, int) and dim <= 0:
            raise ModelError(f"input {name!r} declares dimension {dim} at axis {axis}; a fixed "
                             "dimension must be positive (leave it symbolic to give it per job)")
    _check_size(f"input {name!r}", [d for d in dims if isinstance(d, int)])


def _check_size(what: str, dims: list[int]) -> None:
    from kiln.errors import ModelError
    from kiln.frontend import MAX_TENSOR_ELEMENTS

    if any(d < 0 for d in dims) or math.prod(dims) > MAX_TENSOR_ELEMENTS:
        raise ModelError(f"{what} declares shape {dims}: more than {MAX_TENSOR_ELEMENTS} "
                         "elements or a negative dimension, which the compiler refuses")


def find_by_hash(db: Database, tenant_id: str, sha256: str) -> ModelRecord | None:
    with db.read() as s:
        return s.scalars(select(ModelRecord).where(
            ModelRecord.tenant_id == tenant_id, ModelRecord.sha256 == sha256)).first()


def record(db: Database, storage: Storage, tenant_id: str, upload: Upload, opset: int,
           inputs: list[dict[str, Any]]) -> tuple[ModelRecord, bool]:
    """Store the file at its content address and add the tenant's row; (row, created)."""
    storage.install_model(upload.path, upload.sha256)
    try:
        with db.write() as s:
            row = ModelRecord(tenant_id=tenant_id, sha256=upload.sha256, size_bytes=upload.size,
                              filename=upload.filename, opset=opset, inputs=inputs)
            s.add(row)
        return row, True
    except IntegrityError:  # the same tenant uploaded the same bytes concurrently
        existing = find_by_hash(db, tenant_id, upload.sha256)
        if existing is None:
            raise
        return existing, False


def get(db: Database, tenant_id: str, model_id: str) -> ModelRecord:
    with db.read() as s:
        row = s.get(ModelRecord, model_id)
    if row is None or row.tenant_id != tenant_id:
        raise APIError(404, "Not Found", f"no model with id {model_id!r}")
    return row


def list_models(db: Database, tenant_id: str, limit: int, offset: int) -> list[ModelRecord]:
    with db.read() as s:
        return list(s.scalars(select(ModelRecord).where(ModelRecord.tenant_id == tenant_id)
                              .order_by(ModelRecord.created_at.desc(), ModelRecord.id)
                              .limit(limit).offset(offset)))
