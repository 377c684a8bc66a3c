"""Copy a shipment's layers into engine tensors as they arrive (layer-wise), so the KV is
assembled when its last layer lands, not after.

The transport reuses its receive buffers after `Inbound.release()`, so every layer is
copied out first (one copy, straight into a tensor of the engine's dtype). With a prefix the
region already holds (a pinned prefix cache hit), a shipment may carry only the tokens after
it: each layer is then the held prefix followed by the shipped tokens, in one tensor.

On a GPU (`upload`, engine/upload.py) each layer goes into device memory as it lands: copied
into a pinned buffer, then to the device on a side stream while the next layers arrive; the
layers are handed over once the last copy landed (a held prefix, in device memory, is joined
to them then).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from prfaas.engine.kv import DTYPES, LayerKV
from prfaas.engine.staging import PoolExhausted
from prfaas.engine.upload import Upload
from prfaas.region.errors import DeadlineExceeded, Exhausted, PermissionDenied, PreconditionFailed
from prfaas.transport.errors import TransferTimeout
from prfaas.transport.inbound import Inbound

Shape = tuple[int, int, int]


def _tensor(buf: bytes | bytearray | memoryview, shape: Shape, dtype: torch.dtype,
            prefix: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """`buf` ([kv_heads, tokens, head_dim]) as a tensor, after `prefix`'s tokens when given."""
    if prefix is None:
        out = torch.empty(shape, dtype=dtype)  # [kv_heads, tokens, head_dim]
        target = out.view(-1).view(torch.uint8).numpy()
        target[:] = np.frombuffer(buf, dtype=np.uint8)
        return out
    heads, tokens, head_dim = shape
    held = prefix.shape[1]
    out = torch.empty((heads, held + tokens, head_dim), dtype=dtype)
    out[:, :held] = prefix
    source = np.frombuffer(buf, dtype=np.uint8)
    step = tokens * head_dim * out.element_size()
    for head in range(heads):  # each head's tokens are contiguous after the held ones
        out[head, held:].view(-1).view(torch.uint8).numpy()[:] = source[head * step : (head + 1) * step]
    return out


@dataclass(frozen=True)
class LayoutCheck:
    """What this decode engine accepts: its dtype and per-layer head layout."""

    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def check(self, inbound: Inbound, max_bytes: int, tenant: str) -> tuple[Shape, ...]:
        info, ticket = inbound.info, inbound.ticket
        assert info is not None and ticket is not None  # a layer arrived, so the shipment is open
        if ticket.tenant != tenant:
            raise PermissionDenied(f"shipment ticket is for tenant {ticket.tenant!r}, the reservation for {tenant!r}")
        if info.dtype != self.dtype:
            raise PreconditionFailed(f"shipment dtype {info.dtype} does not match the engine's {self.dtype}")
        shapes = info.layer_shapes
        ok = all(s[0] == self.num_kv_heads and s[2] == self.head_dim and s[1] == shapes[0][1] for s in shapes)
        if len(shapes) != self.num_layers or not ok:
            raise PreconditionFailed(
                f"shipment has {len(shapes)} layers of {list(shapes[0])}, the engine needs {self.num_layers} "
                f"of [{self.num_kv_heads}, tokens, {self.head_dim}]"
            )
        if info.raw_bytes > max_bytes:
            raise PermissionDenied(f"shipment of {info.raw_bytes} bytes exceeds the reservation of {max_bytes}")
        return shapes


def assemble(
    inbound: Inbound, layout: LayoutCheck, max_bytes: int, tenant: str, deadline: float,
    prefix: Sequence[tuple[torch.Tensor, torch.Tensor]] = (), num_tokens: int = 0, upload: Upload | None = None,
) -> list[LayerKV]:  # fmt: skip
    """Every layer of `inbound` as engine tensors, copied as each arrives; releases the
    transport's buffers. `prefix` (per layer (k, v)) is KV this region holds for the prompt's
    first tokens: a shipment of the other `num_tokens - held` tokens is put after it; one of all
    `num_tokens` is taken as it is. `upload`: the layers go to device memory through it (else
    they stay in host memory). Raises the shipment's error (TransportError), or a RegionError
    when the shipment does not fit this engine, the reservation or the held prefix."""
    layers: list[LayerKV] = []
    torch_dtype = DTYPES[layout.dtype]
    shapes: tuple[Shape, ...] = ()
    held: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()
    try:
        for index in range(layout.num_layers):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceeded(f"KV shipment incomplete at the reservation deadline ({index} layers in)")
            try:
                k, v = inbound.layer(index, timeout_s=remaining)
            except TransferTimeout as exc:
                raise DeadlineExceeded(f"KV shipment incomplete at the reservation deadline: {exc}") from None
            if index == 0:
                shapes = layout.check(inbound, max_bytes, tenant)
                held = _held(prefix, shapes[0][1], num_tokens)
            if upload is not None:
                with _upload_errors():
                    layers.append(LayerKV(k=upload.put(k, shapes[index], torch_dtype),
                                          v=upload.put(v, shapes[index], torch_dtype)))  # fmt: skip
                continue
            pk, pv = held[index] if held else (None, None)
            layers.append(LayerKV(k=_tensor(k, shapes[index], torch_dtype, pk),
                                  v=_tensor(v, shapes[index], torch_dtype, pv)))  # fmt: skip
        if upload is not None:
            with _upload_errors():  # the join allocates on the device too
                upload.finish()
                layers = [_joined(layer, pair) for layer, pair in zip(layers, held, strict=True)] if held else layers
    except BaseException as exc:  # the sender is told why (its Prefill call ends with the reason)
        inbound.cancel(f"the decode region gave up on this shipment: {exc}"[:400])
        raise
    finally:
        if upload is not None:
            upload.close()
        inbound.release()
    return layers


@contextlib.contextmanager
def _upload_errors() -> Iterator[None]:
    """The upload's failures as the region's errors: no pinned buffer came free in time, or no device
    memory (Exhausted: retry elsewhere or later), a copy to the device did not land (DeadlineExceeded), a
    layer larger than the whole pool (PreconditionFailed: `staging_bytes` is too small for this shipment)."""
    try:
        yield
    except ValueError as exc:
        raise PreconditionFailed(f"KV upload to the device: {exc}") from None
    except (PoolExhausted, torch.OutOfMemoryError) as exc:  # no pinned buffer, or no device memory, now
        raise Exhausted(f"KV upload to the device: {exc}") from None
    except TimeoutError as exc:
        raise DeadlineExceeded(f"KV upload to the device: {exc}") from None


def _joined(layer: LayerKV, prefix: tuple[torch.Tensor, torch.Tensor]) -> LayerKV:
    """The held prefix's KV followed by the shipped tokens', on the shipped layer's device."""
    (pk, pv), device = prefix, layer.k.device
    return LayerKV(k=torch.cat((pk.to(device), layer.k), dim=1), v=torch.cat((pv.to(device), layer.v), dim=1))


def _held(
    prefix: Sequence[tuple[torch.Tensor, torch.Tensor]], shipped_tokens: int, num_tokens: int
) -> Sequence[tuple[torch.Tensor, torch.Tensor]]:
    """The prefix to put before a shipment of `shipped_tokens`: the held one when the shipment
    carries the rest of the prompt, none when it carries all of it."""
    if not prefix or shipped_tokens == num_tokens:
        return ()
    held = prefix[0][0].shape[1]
    if held + shipped_tokens != num_tokens:
        raise PreconditionFailed(
            f"shipment of {shipped_tokens} tokens fits neither the prompt ({num_tokens} tokens) nor what "
            f"this region holds of it ({held} tokens)"
        )
    return prefix
