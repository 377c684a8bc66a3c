"""What a request tells the prfaas vLLM connector, in its `kv_transfer_params`.

No vLLM import: the region agents and tests build these without vLLM installed.

- A prefill (producer) request carries `{"prfaas_ship": ShipParams}`: ship the prompt's
  KV, layer by layer as it is computed (or all of it after the forward: `layerwise`), to
  the decode region's KV port under `ticket` (over TLS when the engine has a certificate:
  `server_name` is the name the decode region's certificate must carry).
- A decode (consumer) request carries `{"prfaas_load": LoadParams}`: the prompt's KV comes
  as the shipment (`job_id`, `attempt`); vLLM waits for it instead of computing the
  prompt, and recomputes the prompt if the shipment fails or misses `timeout_s`.
  `num_tokens` is how many leading prompt tokens the shipment covers. The split the
  engines use sends the decode `prompt + [first_token]` with `num_tokens = len(prompt)`:
  vLLM then computes only the first token's position, exactly the step a colocated run
  takes next, so the tokens match it bit for bit. Without `num_tokens` the shipment
  covers the whole prompt and vLLM recomputes its last token to get logits (a kernel
  other than the prefill's, so a near-tie can flip a later greedy token).
"""

from __future__ import annotations

import ipaddress
import re
import uuid
from dataclasses import asdict, dataclass
from typing import Any, TypedDict

from prfaas.transport.codecs import get_codec
from prfaas.transport.endpoints import parse_hostport
from prfaas.transport.errors import CodecError

SHIP_KEY = "prfaas_ship"
LOAD_KEY = "prfaas_load"
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DNS_NAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*$")


def _job_id(value: Any) -> str:
    try:
        return str(uuid.UUID(str(value)))
    except ValueError:
        raise ValueError(f"job_id {value!r} is not a UUID") from None


def _attempt(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"attempt must be an integer >= 0, got {value!r}")
    return value


def _timeout(value: Any) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value <= 3600:
        raise ValueError(f"timeout_s must be in (0, 3600], got {value!r}")
    return float(value)


class GenerateOptions(TypedDict, total=False):
    """What a generation takes beside its prompt and length, passed unchanged by each layer that
    carries it to vLLM (`RemoteVLLM` -> `VLLMClient` -> the server -> `VLLMHost`)."""

    kv_params: dict[str, Any] | None  # vLLM's kv_transfer_params: a shipment to make or to load (None: neither)
    timeout_s: float  # how long the whole generation may take (each layer has its default)
    sampling: dict[str, Any] | None  # kwargs of vLLM's SamplingParams (sampling.py's `vllm_sampling`; None: greedy)


@dataclass(frozen=True)
class ShipParams:
    job_id: str
    attempt: int
    ticket: str
    kv_endpoint: str  # "host:port" of the decode region's KV receiver
    codec: str = "lossless"
    timeout_s: float = 30.0  # deadline of the whole transfer
    # True: each layer goes on the wire as soon as its attention has written it (hides the
    # link behind the forward). False: the whole prompt's KV is sent after the forward, off
    # the forward's path (a same-host link, where streaming saves nothing and its sends would
    # take CPU from the forward): see `layerwise_for`.
    layerwise: bool = True
    # With TLS on the KV link: the name the decode region's certificate must carry
    # (`transport.identity.server_name(region)`); None: the address dialled.
    server_name: str | None = None

    @property
    def address(self) -> tuple[str, int]:
        return parse_hostport(self.kv_endpoint)

    @staticmethod
    def parse(value: Any) -> ShipParams:
        if not isinstance(value, dict):
            raise ValueError(f"{SHIP_KEY} must be an object")
        ticket, endpoint = value.get("ticket"), value.get("kv_endpoint")
        if not isinstance(ticket, str) or not ticket:
            raise ValueError(f"{SHIP_KEY}.ticket is required")
        try:  # the one host:port parser ([v6]:port)
            _host, port = parse_hostport(str(endpoint or ""))
        except ValueError:
            port = 0
        if not port:
            raise ValueError(f"{SHIP_KEY}.kv_endpoint must be host:port, got {endpoint!r}")
        codec = value.get("codec", "lossless")
        try:
            get_codec(codec)
        except CodecError as exc:
            raise ValueError(f"{SHIP_KEY}.codec: {exc}") from None
        layerwise = value.get("layerwise", True)
        if not isinstance(layerwise, bool):
            raise ValueError(f"{SHIP_KEY}.layerwise must be true or false, got {layerwise!r}")
        server_name = value.get("server_name")
        if server_name is not None and (not isinstance(server_name, str) or not _DNS_NAME.match(server_name)):
            raise ValueError(f"{SHIP_KEY}.server_name must be a DNS name, got {server_name!r}")
        return ShipParams(
            _job_id(value.get("job_id")),
            _attempt(value.get("attempt", 0)),
            ticket,
            str(endpoint),
            str(codec),
            _timeout(value.get("timeout_s", 30.0)),
            layerwise,
            server_name,
        )

    def to_kv_params(self) -> dict[str, Any]:
        return {SHIP_KEY: asdict(self)}


def layerwise_for(host: str, ship: str = "auto") -> bool:
    """Whether a prefill ships layer by layer to a decode region at `host`.

    `ship` is the region's setting: `layerwise`, `after_forward`, or `auto`, which ships
    after the forward to a loopback address (the same machine: the link moves a whole
    prompt's KV in about the time of one layer's forward, so streaming hides nothing, while
    its sends share the engine's CPU) and layer by layer to any other."""
    if ship not in SHIP_MODES:
        raise ValueError(f"ship must be one of {', '.join(SHIP_MODES)}, got {ship!r}")
    if ship != "auto":
        return ship == "layerwise"
    try:
        return not ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host != "localhost"


SHIP_MODES = ("auto", "layerwise", "after_forward")


@dataclass(frozen=True)
class LoadParams:
    job_id: str
    attempt: int
    timeout_s: float = 30.0  # how long the decode waits for the whole shipment
    num_tokens: int | None = None  # leading prompt tokens the shipment covers; None: all

    @staticmethod
    def parse(value: Any) -> LoadParams:
        if not isinstance(value, dict):
            raise ValueError(f"{LOAD_KEY} must be an object")
        num_tokens = value.get("num_tokens")
        if num_tokens is not None and (
            not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 1
        ):
            raise ValueError(f"{LOAD_KEY}.num_tokens must be an integer >= 1, got {num_tokens!r}")
        return LoadParams(
            _job_id(value.get("job_id")),
            _attempt(value.get("attempt", 0)),
            _timeout(value.get("timeout_s", 30.0)),
            num_tokens,
        )

    def covered(self, num_prompt_tokens: int) -> int:
        """Prompt tokens this request takes from the shipment."""
        return num_prompt_tokens if self.num_tokens is None else min(self.num_tokens, num_prompt_tokens)

    def to_kv_params(self) -> dict[str, Any]:
        return {LOAD_KEY: asdict(self)}


def parse_kv_params(params: dict[str, Any] | None) -> ShipParams | LoadParams | None:
    """The prfaas part of a request's kv_transfer_params; None when it has none.
    Raises ValueError on a malformed one (callers check before handing it to vLLM)."""
    if not params:
        return None
    if SHIP_KEY in params and LOAD_KEY in params:
        raise ValueError(f"a request is either {SHIP_KEY} or {LOAD_KEY}, not both")
    if SHIP_KEY in params:
        return ShipParams.parse(params[SHIP_KEY])
    if LOAD_KEY in params:
        return LoadParams.parse(params[LOAD_KEY])
    return None
