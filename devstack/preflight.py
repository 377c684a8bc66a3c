"""What `prfaas up` checks before it starts anything: the topology's policy validates, and its model
resolves here (an HF folder, or a catalog model this `$PRFAAS_HOME` has prepared). Each failure is
one `UpError` line."""

from __future__ import annotations

from prfaas.control_plane.scheduling.errors import PolicyConfigError
from prfaas.control_plane.scheduling.policy import DEFAULT_POLICY_YAML, parse_policy
from prfaas.devstack.state import UpError
from prfaas.devstack.topology import Topology
from prfaas.engine.errors import EngineError
from prfaas.engine.models import unprepared


def policy_yaml(topology: Topology) -> str:
    """The policy the control plane runs (the topology's file, or the default with its threshold),
    validated: `UpError` names what is wrong."""
    if topology.policy.path is not None:
        try:
            text = topology.policy.path.read_text()
        except OSError as exc:
            raise UpError(f"policy.path: cannot read {topology.policy.path}: {exc.strerror}") from None
    else:
        text = DEFAULT_POLICY_YAML
        if topology.policy.min_uncached_tokens is not None:
            text = text.replace("min_uncached_tokens: 19400",
                                f"min_uncached_tokens: {topology.policy.min_uncached_tokens}")  # fmt: skip
    try:
        parse_policy(text)
    except PolicyConfigError as exc:
        raise UpError(f"policy {topology.policy.path or '(default)'}: {exc}") from None
    return text


def check_policy(topology: Topology) -> None:
    """`UpError` (one line) unless the topology's policy validates."""
    policy_yaml(topology)


def preflight(topology: Topology) -> None:
    """`UpError` (one line) unless the topology's policy is valid and its model resolves here (an
    HF folder or a prepared catalog model; `prfaas up` prepares a missing catalog model first)."""
    policy_yaml(topology)
    try:
        missing = unprepared(topology.model)
    except EngineError as exc:
        raise UpError(f"topology {topology.name!r}: model: {exc}") from None
    if missing is not None:
        raise UpError(f"topology {topology.name!r}: model {missing!r} is not prepared; run `prfaas model prepare "
                      f"{missing}`")  # fmt: skip
