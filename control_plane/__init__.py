"""prfaas.control_plane: the FastAPI control plane, its global scheduler and its metering.

The map (each sub-package's `__init__` states its contract):

    scheduling/  the global scheduler: pure filter -> score -> pick policies over a frozen
                 ClusterSnapshot (`from prfaas.control_plane.scheduling import build_scheduler`)

Shared at the top: `settings` (the one `Settings`, env prefix PRFAAS_).
"""
