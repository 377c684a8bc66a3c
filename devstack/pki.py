"""The certificates of a deployment on one machine (`prfaas up`, unless `--insecure`): a CA of
its own, a certificate for the control plane (`prfaas://control-plane/NAME`) and one per
region instance (`prfaas://ROLE/REGION/INSTANCE`), under `$PRFAAS_HOME/up/pki` (keys 0600),
made anew at every `up`. What `prfaas certs init` does for an operator, for every node at once."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from prfaas.transport.identity import Identity, Kind
from prfaas.transport.tls import init_certs

SANS = ["127.0.0.1", "localhost"]  # callers check server names (identity.server_name), not addresses


class DeploymentPki:
    def __init__(self, folder: Path, control_plane: str, instances: Sequence[tuple[Kind, str, str]]) -> None:
        """`instances`: (role, region, instance id) of every region instance."""
        self.folder = folder
        identities = {"control-plane": Identity("control-plane", control_plane)}
        identities |= {self._node(region, instance): Identity(role, region, instance)
                       for role, region, instance in instances}  # fmt: skip
        init_certs(folder, list(identities), SANS, identities=identities, force=True)

    @staticmethod
    def _node(region: str, instance: str) -> str:
        return f"{region}-{instance}"

    def files(self, node: str) -> dict[str, str]:
        """`ca`, `cert`, `key` paths of `node` (a region config's `tls` section)."""
        return {"ca": str(self.folder / "ca.pem"), "cert": str(self.folder / f"{node}.pem"),
                "key": str(self.folder / f"{node}-key.pem")}  # fmt: skip

    def instance(self, region: str, instance: str) -> dict[str, str]:
        return self.files(self._node(region, instance))

    def control_plane_env(self) -> dict[str, str]:
        """The control plane's `PRFAAS_TLS_*` variables."""
        return {f"PRFAAS_TLS_{which.upper()}": path for which, path in self.files("control-plane").items()}
