"""Observability shared by every process: OpenTelemetry tracing (tracing.py) and its local span files
(spans.py). Imports nothing of ours, so the control plane, the regions and the CLI can all use it."""
