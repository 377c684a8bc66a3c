"""`sched explain`: why was this request placed there?

    python -m prfaas.control_plane.scheduling.explain --snapshot snap.json --request req.json [--config policy.yaml]
    python -m prfaas.control_plane.scheduling.explain --schema snapshot|request|policy
    python -m prfaas.control_plane.scheduling.explain --default-policy

Prints the `Decision` as JSON (exit 0), or `{"rejected": {...}}` with the reason and the trace
(exit 3); bad input prints one line naming the field to stderr (exit 2). `explain_json` is the
pure core (documents in, mapping out); `main` does the file reading. The `prfaas` CLI's
`sched explain` command calls `main`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from prfaas.control_plane.scheduling.decision import decision_dict, explanation_dict
from prfaas.control_plane.scheduling.errors import InvalidSchedulerInput, PlacementRejected, SchedulerError
from prfaas.control_plane.scheduling.plugin_registry import validation_message
from prfaas.control_plane.scheduling.policy import DEFAULT_POLICY_YAML, PolicyConfig, build_scheduler, parse_policy
from prfaas.control_plane.scheduling.request import Request
from prfaas.control_plane.scheduling.snapshot import ClusterSnapshot

EXIT_REJECTED = 3
EXIT_BAD_INPUT = 2

M = TypeVar("M", bound=BaseModel)

SCHEMAS: dict[str, type[BaseModel]] = {"snapshot": ClusterSnapshot, "request": Request, "policy": PolicyConfig}


def parse_document(model: type[M], text: str, what: str) -> M:
    """Validate a JSON document; errors name the field as `what.path[index].field`."""
    try:
        return model.model_validate_json(text)
    except ValidationError as exc:
        path, message = validation_message(exc)
        raise InvalidSchedulerInput(f"{what}.{path}" if path else what, message) from None


def explain_json(snapshot_text: str, request_text: str, policy_text: str | None = None) -> dict[str, Any]:
    """The decision (or the rejection) for these documents, as a JSON-ready mapping."""
    snapshot = parse_document(ClusterSnapshot, snapshot_text, "snapshot")
    request = parse_document(Request, request_text, "request")
    scheduler = build_scheduler(parse_policy(policy_text) if policy_text is not None else None)
    try:
        return decision_dict(scheduler.decide(snapshot, request))
    except PlacementRejected as exc:
        return {
            "rejected": {
                "reason": str(exc.reason),
                "error": type(exc).__name__,
                "message": exc.message,
                "explanation": explanation_dict(exc.explanation),
            }
        }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prfaas sched explain", description=__doc__.split("\n\n")[0])
    parser.add_argument("--snapshot", type=Path, help="ClusterSnapshot JSON")
    parser.add_argument("--request", type=Path, help="Request JSON")
    parser.add_argument("--config", type=Path, help="policy YAML (default: the built-in policy)")
    parser.add_argument("--schema", choices=sorted(SCHEMAS), help="print a document's JSON schema and exit")
    parser.add_argument("--default-policy", action="store_true", help="print the built-in policy YAML and exit")
    args = parser.parse_args(argv)
    if args.schema:
        print(json.dumps(SCHEMAS[args.schema].model_json_schema(), indent=2))
        return 0
    if args.default_policy:
        print(DEFAULT_POLICY_YAML, end="")
        return 0
    if args.snapshot is None or args.request is None:
        parser.error("--snapshot and --request are required")
    try:
        texts = [p.read_text(encoding="utf-8") if p else None for p in (args.snapshot, args.request, args.config)]
        result = explain_json(texts[0] or "", texts[1] or "", texts[2])
    except OSError as exc:
        print(f"error: cannot read {exc.filename}: {exc.strerror}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except SchedulerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(result, indent=2))
    return EXIT_REJECTED if "rejected" in result else 0


if __name__ == "__main__":
    sys.exit(main())
