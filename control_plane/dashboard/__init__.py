"""The tenant and admin dashboards (stub)."""

from __future__ import annotations

from fastapi import FastAPI


def install(app: FastAPI) -> None:
    return None
