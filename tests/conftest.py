"""Shared fixtures. Models come from the local catalog (prepared by `make`; prepared here
too if missing, since `prepare_model` is idempotent)."""

from __future__ import annotations

import inspect
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import argparse

import pytest

from prfaas.engine.hf import HFEngine
from prfaas.engine.models import prepare_model


@pytest.fixture(scope="session")
def tiny_engine() -> HFEngine:
    prepare_model("tiny-llama")
    return HFEngine("tiny-llama")


@pytest.fixture(scope="session")
def long_text() -> str:
    """Tens of thousands of tokens of real English and code, identical on every machine
    with the same Python (the source of the standard library's argparse)."""
    return inspect.getsource(argparse)
