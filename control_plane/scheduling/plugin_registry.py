"""Plugin registry: type string -> factory. A factory takes the YAML `params` mapping,
validates it and returns the plugin. No global instance: `default_registry()` builds a fresh
one holding the built-ins, and a caller (the simulator, a test) may register more on its copy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from prfaas.control_plane.scheduling.errors import PolicyConfigError, UnknownPluginType
from prfaas.control_plane.scheduling.filters import (
    CapacityFilter,
    HealthFilter,
    LinkHeadroomFilter,
    ResidencyFilter,
    SloFilter,
)
from prfaas.control_plane.scheduling.plugins import Filter, Picker, Scorer
from prfaas.control_plane.scheduling.scorers import (
    DecodeHeadroomScorer,
    EgressCostScorer,
    LatencyScorer,
    LinkHeadroomScorer,
    MaxScorePicker,
    PrefixCacheScorer,
    PriceScorer,
    QueueDepthScorer,
)

FilterFactory = Callable[[Mapping[str, Any]], Filter]
ScorerFactory = Callable[[Mapping[str, Any]], Scorer]
PickerFactory = Callable[[Mapping[str, Any]], Picker]
F = TypeVar("F")
P = TypeVar("P")
M = TypeVar("M", bound=BaseModel)


def validation_message(exc: ValidationError) -> tuple[str, str]:
    """(dotted field path, message) of a pydantic error's first problem."""
    first = exc.errors()[0]
    path = ""
    for part in first["loc"]:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path, str(first["msg"])


class PluginRegistry:
    """Factories by kind and type string. Registering a type twice is an error."""

    def __init__(self) -> None:
        self._filters: dict[str, FilterFactory] = {}
        self._scorers: dict[str, ScorerFactory] = {}
        self._pickers: dict[str, PickerFactory] = {}

    def register_filter(self, type_name: str, factory: FilterFactory) -> None:
        _register(self._filters, "filter", type_name, factory)

    def register_scorer(self, type_name: str, factory: ScorerFactory) -> None:
        _register(self._scorers, "scorer", type_name, factory)

    def register_picker(self, type_name: str, factory: PickerFactory) -> None:
        _register(self._pickers, "picker", type_name, factory)

    def filter_types(self) -> list[str]:
        return sorted(self._filters)

    def scorer_types(self) -> list[str]:
        return sorted(self._scorers)

    def picker_types(self) -> list[str]:
        return sorted(self._pickers)

    def make_filter(self, type_name: str, params: Mapping[str, Any], field: str = "filter") -> Filter:
        return _make(self._filters, "filter", type_name, params, field)

    def make_scorer(self, type_name: str, params: Mapping[str, Any], field: str = "scorer") -> Scorer:
        return _make(self._scorers, "scorer", type_name, params, field)

    def make_picker(self, type_name: str, params: Mapping[str, Any], field: str = "picker") -> Picker:
        return _make(self._pickers, "picker", type_name, params, field)


def _register(table: dict[str, F], kind: str, type_name: str, factory: F) -> None:
    if type_name in table:
        raise ValueError(f"{kind} type {type_name!r} is already registered")
    table[type_name] = factory


def _make(
    table: Mapping[str, Callable[[Mapping[str, Any]], P]],
    kind: str,
    type_name: str,
    params: Mapping[str, Any],
    field: str,
) -> P:
    factory = table.get(type_name)
    if factory is None:
        known = ", ".join(sorted(table)) or "none"
        raise UnknownPluginType(f"{field}.type", f"unknown {kind} type {type_name!r} (known: {known})")
    try:
        return factory(params)
    except ValidationError as exc:
        path, message = validation_message(exc)
        raise PolicyConfigError(f"{field}.params.{path}" if path else f"{field}.params", message) from None


def _model_factory(cls: type[M]) -> Callable[[Mapping[str, Any]], M]:
    """A factory that validates `params` against the plugin class, which is its own model."""

    def factory(params: Mapping[str, Any]) -> M:
        return cls.model_validate(dict(params))

    return factory


# The built-in plugins by type string (docs/scheduler.md, "Plugins"); each class is its own params model.
BUILT_IN_FILTERS: dict[str, FilterFactory] = {
    "health": _model_factory(HealthFilter),
    "residency": _model_factory(ResidencyFilter),
    "capacity": _model_factory(CapacityFilter),
    "slo": _model_factory(SloFilter),
    "link-headroom": _model_factory(LinkHeadroomFilter),
}
BUILT_IN_SCORERS: dict[str, ScorerFactory] = {
    "price": _model_factory(PriceScorer),
    "egress-cost": _model_factory(EgressCostScorer),
    "queue-depth": _model_factory(QueueDepthScorer),
    "prefix-cache": _model_factory(PrefixCacheScorer),
    "link-headroom": _model_factory(LinkHeadroomScorer),
    "decode-headroom": _model_factory(DecodeHeadroomScorer),
    "latency": _model_factory(LatencyScorer),
}
BUILT_IN_PICKERS: dict[str, PickerFactory] = {"max-score": _model_factory(MaxScorePicker)}


def default_registry() -> PluginRegistry:
    """A new registry holding every built-in plugin."""
    registry = PluginRegistry()
    for name, filter_factory in BUILT_IN_FILTERS.items():
        registry.register_filter(name, filter_factory)
    for name, scorer_factory in BUILT_IN_SCORERS.items():
        registry.register_scorer(name, scorer_factory)
    for name, picker_factory in BUILT_IN_PICKERS.items():
        registry.register_picker(name, picker_factory)
    return registry
