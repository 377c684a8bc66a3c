"""`HFDecode`: the decode backend of a region with `engine: hf` (the embedded engine).

The region's KV receiver (TCP plus same-host shared memory, or WebRTC) takes each shipment
against its ticket; `Assembly` copies its layers into engine tensors as they arrive
(`assembly.py`), so the KV is ready when its last layer lands. Decode adopts that cache;
Generate runs the prompt whole in this engine.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from prfaas.decode_region import metrics
from prfaas.decode_region.assembly import LayoutCheck, assemble
from prfaas.decode_region.backend import DecodeCall, Expected, KVHold, ShipmentEvents
from prfaas.engine.base import ModelFacts
from prfaas.engine.hf import HFEngine
from prfaas.engine.kv import KVCache, LayerKV
from prfaas.engine.sampling import Chosen, SamplingParams
from prfaas.region.errors import Canceled, DeadlineExceeded, PreconditionFailed
from prfaas.transport.inbound import Inbound, Receiver


class Assembly:
    """One reservation's shipment, assembled on a thread of its own once started."""

    def __init__(self, expected: Expected, inbound: Inbound, layout: LayoutCheck, events: ShipmentEvents) -> None:
        self.expected = expected
        self.inbound = inbound
        self.layout = layout
        self.events = events
        self._cond = threading.Condition()
        self._layers: list[LayerKV] | None = None
        self._ended = False

    def start(self) -> None:
        threading.Thread(target=self._run, name=f"prfaas-assemble-{self.expected.job_id[:8]}", daemon=True).start()

    def _run(self) -> None:
        exp = self.expected
        try:
            layers = assemble(self.inbound, self.layout, exp.kv_bytes, exp.tenant, exp.deadline)
        except BaseException as exc:
            self.events.failed(exc)
            return
        self.events.arrived()
        metrics.KV_RECEIVED.inc(sum(2 * layer.k.numel() * layer.k.element_size() for layer in layers))
        metrics.SHIPMENT_SECONDS.inc(time.monotonic() - exp.created)
        with self._cond:
            if not self._ended:
                self._layers = layers
            self._cond.notify_all()

    def wait(self, deadline: float, is_active: Callable[[], bool]) -> bool:
        with self._cond:
            while self._layers is None and not self._ended:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DeadlineExceeded("the KV did not arrive before the decode deadline")
                if not is_active():
                    raise Canceled("the caller disconnected")
                self._cond.wait(min(remaining, 0.1))
            return self._layers is not None

    def take(self) -> list[LayerKV]:
        """The assembled layers, handed over (the hold keeps no reference)."""
        with self._cond:
            layers, self._layers = self._layers, None
        if layers is None:
            raise Canceled("reservation ended")
        return layers

    def end(self, reason: str, claimed: bool) -> None:
        with self._cond:
            self._ended = True
            self._layers = None
            self._cond.notify_all()
        self.inbound.cancel(reason)  # no-op once the shipment completed; else it stops and frees it


class HFDecode:
    """`receiver` takes the KV (TCP + shared memory, or WebRTC); `kv_endpoint` is where
    senders reach it. `test_token_delay_s` (TEST ONLY, RegionConfig.test_token_delay_s) paces
    the tokens so fault tests can act mid-stream."""

    def __init__(self, engine: HFEngine, receiver: Receiver, kv_endpoint: str, test_token_delay_s: float = 0.0) -> None:
        self.test_token_delay_s = test_token_delay_s
        self.engine = engine
        self.facts: ModelFacts = engine.facts
        self.receiver = receiver
        self.kv_endpoint = kv_endpoint
        self.layout = LayoutCheck(self.facts.dtype, self.facts.num_layers, self.facts.num_kv_heads, self.facts.head_dim)

    def expect(self, expected: Expected, ttl_s: float, events: ShipmentEvents) -> KVHold:
        inbound = self.receiver.expect(
            expected.job_id, expected.attempt, ttl_s, tenant=expected.tenant, max_bytes=expected.kv_bytes
        )
        return Assembly(expected, inbound, self.layout, events)

    def check_decode(self, call: DecodeCall, params: SamplingParams) -> None:
        pass  # the KV itself is checked as it arrives (assembly.LayoutCheck) and when adopted

    def decode(self, hold: KVHold, call: DecodeCall, params: SamplingParams, deadline: float,
               canceled: threading.Event) -> list[Iterator[Chosen]]:  # fmt: skip
        assert isinstance(hold, Assembly)  # this backend's own
        layers = hold.take()
        if layers[0].k.shape[1] != call.num_tokens:
            raise PreconditionFailed(f"KV covers {layers[0].k.shape[1]} tokens, the request says {call.num_tokens}")
        facts = self.engine.facts
        kv = KVCache(facts.fingerprint, facts.dtype, tuple(layers), call.num_tokens, call.token_ids_hash)
        firsts = call.firsts or [Chosen(call.first_token)]
        return [
            self._paced(self.engine.decode_chosen(kv, first.token, params.for_choice(c), call.token_ids), canceled)
            for c, first in enumerate(firsts)
        ]

    def check_prompt(self, token_ids: Sequence[int], params: SamplingParams) -> None:
        self.engine.check_prompt(token_ids, params)

    def generate(self, token_ids: list[int], params: SamplingParams, deadline: float,
                 canceled: threading.Event) -> list[Iterator[Chosen]]:  # fmt: skip
        result = self.engine.prefill(token_ids, params)
        return [
            self._paced(itertools.chain((first,), self.engine.decode_chosen(result.kv, first.token,
                                                                            params.for_choice(c), token_ids)), canceled)
            for c, first in enumerate(result.choices)
        ]  # fmt: skip

    def decode_text(self, token_ids: list[int]) -> str:
        return self.engine.decode_text(token_ids)

    def _paced(self, tokens: Iterator[Chosen], canceled: threading.Event) -> Iterator[Chosen]:
        if not self.test_token_delay_s:
            return tokens

        def paced() -> Iterator[Chosen]:
            for token in tokens:
                yield token
                canceled.wait(self.test_token_delay_s)

        return paced()

    def close(self) -> None:
        pass  # the receiver is its creator's to close (a region process ends with it)
