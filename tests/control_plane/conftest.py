"""Fixtures shared by several control-plane test modules (defined once here, so a session-scoped one is
started once per run): `metered`, the metered stack of metering_kit.py."""

from metering_kit import metered_fixture

__all__ = ["metered_fixture"]
