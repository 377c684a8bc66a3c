"""The declarative base of every table of the control plane's database (the ledger's, billing/models.py; the
tenants', tenants/models.py) and the column types they share.

Every column is NOT NULL unless its annotation says `| None`; the `Mapped[...]` annotation gives its type
(`float` -> FLOAT, `int` -> INTEGER, `BigInt` -> BIGINT, `StrN` -> VARCHAR(N))."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any, ClassVar

from sqlalchemy import BigInteger, DateTime, Float, String
from sqlalchemy.orm import DeclarativeBase, mapped_column

BigInt = Annotated[int, mapped_column(BigInteger)]
Str16 = Annotated[str, mapped_column(String(16))]
Str64 = Annotated[str, mapped_column(String(64))]
Str128 = Annotated[str, mapped_column(String(128))]
Str256 = Annotated[str, mapped_column(String(256))]
Str512 = Annotated[str, mapped_column(String(512))]


class Base(DeclarativeBase):
    type_annotation_map: ClassVar[dict[Any, Any]] = {float: Float(), dt.datetime: DateTime()}  # as migrated
