"""`GET /v1/devices`: the device farm, filtered by the device selector grammar."""
from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query

from service.deps import DB, Tenant, rate_limited
from service.devices import farm
from service.devices import selector as sel
from service.problems import PROBLEM_RESPONSES, APIError

router = APIRouter(prefix="/v1/devices", tags=["devices"], responses=PROBLEM_RESPONSES,
                   dependencies=[Depends(rate_limited)])


def parse_selector(device: str | None, **params) -> sel.Selector:
    try:
        return sel.parse(device).and_also(sel.from_params(**params))
    except sel.SelectorError as exc:
        raise APIError(422, "Unprocessable Content", str(exc)) from None


@router.get("", response_model=list[farm.DeviceOut], summary="The device farm")
def list_devices(_tenant: Tenant, db: DB,
                 device: Annotated[str | None, Query(description=(
                     "a device selector, e.g. kind:phone,arch:aarch64,feature:neon,name:pixel; "
                     f"keys: {sel.grammar_help()}"))] = None,
                 kind: str | None = None, arch: str | None = None,
                 feature: Annotated[list[str] | None, Query()] = None, name: str | None = None,
                 model: str | None = None, status: str | None = None):
    """Every device with its facts, agent, status, last heartbeat and tasks; shared by all
    tenants. The query parameters are selector terms too (`?kind=phone&feature=neon`)."""
    selector = parse_selector(device, kind=kind, arch=arch, feature=feature or [], name=name,
                              model=model, status=status)
    return farm.list_devices(db, selector)


@router.get("/{device_id}", response_model=farm.DeviceOut, summary="One device, with its "
            "recent measurement tasks")
def get_device(device_id: str, _tenant: Tenant, db: DB):
    return farm.get_device(db, device_id)
