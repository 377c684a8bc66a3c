"""Who may call what, on a gRPC server that runs mutual TLS: the caller's identity comes from
its certificate (transport/identity.py); a policy allows or refuses each call by method
before the servicer sees it. Both servers between components use it: a region's (control
calls from the control plane only; health watches also from peer regions) and the control
plane's registry (calls from regions only, each about itself: fleet/server.py checks the
request against `peer_identity`).

A refused call ends UNAUTHENTICATED (no identity) or PERMISSION_DENIED (the wrong one) with a
stable message, before any work is done. Without TLS (loopback, or `insecure: true`) there is
no identity and no interceptor: every caller is trusted, as the config said.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from prfaas.transport.identity import Identity, identity_of

log = logging.getLogger(__name__)
# (full method name "/package.Service/Method", the caller's identity) -> None to allow, or why not
Policy = Callable[[str, Identity], str | None]
HEALTH = "/grpc.health.v1.Health/"


def peer_identity(context: grpc.ServicerContext) -> Identity | None:
    """The identity the caller's certificate names; None without TLS or without one."""
    raw = context.auth_context().get("x509_pem_cert")
    certs = [raw] if isinstance(raw, bytes) else list(raw or [])
    if not certs:
        return None
    try:
        return identity_of(certs[0])
    except ValueError:
        return None


def region_policy(method: str, caller: Identity) -> str | None:
    """A region's services: the control plane drives them; peer regions may only watch health
    (a decode region watches the prefill region that owes it KV)."""
    if caller.is_control_plane:
        return None
    if method.startswith(HEALTH) and caller.is_region:
        return None
    return f"{caller.uri} may not call {method}: only the control plane may"


def registry_policy(method: str, caller: Identity) -> str | None:
    """The control plane's registry: regions only (each call is then checked against the
    region it names)."""
    return None if caller.is_region else f"{caller.uri} is not a region"


class Authorizer(grpc.ServerInterceptor):
    """Runs `policy` on every call's caller before the call's handler."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        method: str = details.method
        check = self._check

        if handler.unary_unary is not None:
            behavior = handler.unary_unary

            def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
                check(method, context)
                return behavior(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream is not None:
            stream = handler.unary_stream

            def unary_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                check(method, context)
                yield from stream(request, context)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, handler.request_deserializer, handler.response_serializer
            )
        return handler  # no client-streaming calls between components; left as they are

    def _check(self, method: str, context: grpc.ServicerContext) -> None:
        caller = peer_identity(context)
        if caller is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "a client certificate naming a prfaas identity is required")
            raise AssertionError("unreachable")  # abort raises
        reason = self.policy(method, caller)
        if reason is not None:
            log.warning("refused %s: %s", method, reason)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, reason)
