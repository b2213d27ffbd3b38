from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from kiln.errors import ModelError
from service.deps import DB, Config, Limit, Offset, Store, Tenant, rate_limited
from service.limits.service import check_stored_bytes
from service.models import service
from service.models.schemas import ModelOut
from service.problems import PROBLEM_RESPONSES, APIError

router = APIRouter(prefix="/v1/models", tags=["models"], responses=PROBLEM_RESPONSES,
                   dependencies=[Depends(rate_limited)])

_UPLOAD_BODY = {"requestBody": {"required": True, "description": "the ONNX file, as the raw body",
                                "content": {"application/octet-stream": {
                                    "schema": {"type": "string", "format": "binary"}}}}}


@router.post("", status_code=201, response_model=ModelOut, openapi_extra=_UPLOAD_BODY,
             summary="Upload an ONNX model",
             responses={200: {"model": ModelOut, "description": "the same bytes were uploaded "
                                                                "before: that model"},
                        413: PROBLEM_RESPONSES[422] | {"description": "over the size limit"},
                        415: PROBLEM_RESPONSES[422] | {"description": "not a raw body"}})
async def upload_model(request: Request, response: Response, tenant: Tenant, db: DB,
                       storage: Store, settings: Config,
                       filename: Annotated[str | None, Query(max_length=255,
                                           description="the file's name, for display")] = None):
    """Stream the body to disk, validate it with kiln's frontend, store it once per content.

    Nothing is stored when the model is refused. Uploading the same bytes again returns the
    existing model with status 200.
    """
    content_type = request.headers.get("content-type", "")
    if content_type.startswith(("multipart/", "application/x-www-form-urlencoded")):
        raise APIError(415, "Unsupported Media Type", "send the ONNX file as the raw request body "
                       "(Content-Type: application/octet-stream), not as a form")
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > settings.max_upload_bytes:
        raise service.too_large(settings.max_upload_bytes)
    upload = await service.receive(request.stream(), storage, settings.max_upload_bytes, filename)
    try:
        existing = await run_in_threadpool(service.find_by_hash, db, tenant, upload.sha256)
        if existing is not None:
            response.status_code = 200
            return existing
        await run_in_threadpool(check_stored_bytes, db, tenant, upload.size,
                                settings.max_stored_bytes)
        try:
            opset, inputs = await run_in_threadpool(service.inspect, upload.path)
        except ModelError as exc:
            raise APIError(422, "Invalid Model", str(exc)) from None
        except Exception as exc:  # onnx raised something other than kiln's errors
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise APIError(422, "Invalid Model", f"{upload.filename} could not be read as an ONNX "
                           f"model: {first}") from None
        row, created = await run_in_threadpool(service.record, db, storage, tenant, upload,
                                               opset, inputs)
        response.status_code = 201 if created else 200
        return row
    finally:
        upload.discard()


@router.get("", response_model=list[ModelOut], summary="List your models")
def list_models(tenant: Tenant, db: DB, limit: Limit = 100, offset: Offset = 0):
    return service.list_models(db, tenant, limit, offset)


@router.get("/{model_id}", response_model=ModelOut, summary="One model")
def get_model(model_id: str, tenant: Tenant, db: DB):
    return service.get(db, tenant, model_id)
