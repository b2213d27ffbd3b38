from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict


class ModelInput(BaseModel):
    name: str
    dtype: str
    shape: list[int | str]  # a str is a symbolic dimension a job must give in `shapes`


class ModelOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    sha256: str
    size_bytes: int
    filename: str
    opset: int
    inputs: list[ModelInput]
    created_at: datetime
