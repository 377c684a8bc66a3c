"""`HFDecode`: the decode backend of a region with `engine: hf` (the embedded engine).

The region's KV receiver (TCP plus same-host shared memory, or WebRTC) takes each shipment
against its ticket; `Assembly` copies its layers into engine tensors as they arrive
(`assembly.py`), so the KV is ready when its last layer lands. Decode adopts that cache;
Generate runs the prompt in this engine.

Prefix cache (the engine's, when it has one): a reservation that names the prompt pins the
leading blocks the region holds (`Assembly.cached_tokens`), so the prefill region ships only
the KV after them; a local run reuses cached blocks the same way. What a decode leaves (the
prompt's and the generated tokens' blocks) is kept for the next request of the conversation,
unless the KV came through a lossy codec.
"""

from __future__ import annotations

import itertools
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence

from prfaas.decode_region import metrics
from prfaas.decode_region.assembly import LayoutCheck, assemble
from prfaas.decode_region.backend import DecodeCall, Expected, Generated, KVHold, ShipmentEvents
from prfaas.engine.base import ModelFacts
from prfaas.engine.blocks import block_hashes
from prfaas.engine.hf import HFEngine
from prfaas.engine.kv import KVCache, LayerKV
from prfaas.engine.prefix_cache import Hit
from prfaas.engine.sampling import Chosen, SamplingParams
from prfaas.engine.upload import LayerUploader, device_uploader
from prfaas.region.errors import Canceled, DeadlineExceeded, PreconditionFailed
from prfaas.transport.codecs import get_codec
from prfaas.transport.inbound import Inbound, Receiver


class Assembly:
    """One reservation's shipment, assembled on a thread of its own once started."""

    def __init__(self, expected: Expected, inbound: Inbound, layout: LayoutCheck, events: ShipmentEvents,
                 prefix: Hit | None = None, uploader: LayerUploader | None = None) -> None:  # fmt: skip
        self.expected = expected
        self.uploader = uploader  # a GPU engine's: each layer goes to device memory as it lands
        self.inbound = inbound
        self.layout = layout
        self.events = events
        self.prefix = prefix  # pinned: the hold keeps the blocks' tensors until it ends
        self.cached_tokens = 0 if prefix is None else prefix.num_tokens
        self._cond = threading.Condition()
        self._layers: list[LayerKV] | None = None
        self._ended = False

    def start(self) -> None:
        threading.Thread(target=self._run, name=f"prfaas-assemble-{self.expected.job_id[:8]}", daemon=True).start()

    def _run(self) -> None:
        exp = self.expected
        try:
            held = self.prefix.layers if self.prefix is not None else ()
            upload = None
            if self.uploader is not None:
                upload = self.uploader.begin(timeout_s=max(1.0, exp.deadline - time.monotonic()))
            layers = assemble(self.inbound, self.layout, exp.kv_bytes, exp.tenant, exp.deadline, held,
                              len(exp.token_ids), upload)  # fmt: skip
        except BaseException as exc:
            _drop_locals(exc)  # the layers assembled so far (device memory on a GPU) go now, not when `exc` does
            self.events.failed(exc)
            return
        self.events.arrived(self.inbound.info.traceparent if self.inbound.info is not None else "")
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

    @property
    def lossless(self) -> bool:
        """The shipment's codec restores the prefill's KV bit for bit (the KV may enter the prefix cache)."""
        info = self.inbound.info
        return info is not None and get_codec(info.codec).lossless

    def take(self) -> list[LayerKV]:
        """The assembled layers, handed over (the hold keeps no reference)."""
        with self._cond:
            layers, self._layers = self._layers, None
        if layers is None:
            raise Canceled("reservation ended")
        return layers

    def end(self, reason: str) -> None:
        with self._cond:
            self._ended = True
            self._layers = None
            self.prefix = None
            self._cond.notify_all()
        self.inbound.cancel(reason)  # no-op once the shipment completed; else it stops and frees it


def _drop_locals(error: BaseException) -> None:
    """Clear the locals of the frames `error` (and each error it chains to) passed through, keeping
    what a log of it prints: code and line numbers."""
    seen: set[int] = set()
    chained: BaseException | None = error
    while chained is not None and id(chained) not in seen:
        seen.add(id(chained))
        traceback.clear_frames(chained.__traceback__)
        chained = chained.__cause__ or chained.__context__


class HFDecode:
    """`receiver` takes the KV (TCP + shared memory, or WebRTC); `kv_endpoint` is where
    senders reach it. `test_token_delay_s` (TEST ONLY, RegionConfig.test_token_delay_s) paces
    the tokens so fault tests can act mid-stream. `staging_bytes`: the pinned host memory a GPU
    engine's shipments pass through into device memory (engine/upload.py). `on_close`: what
    `close` runs (the WebRTC receiver's offer listener's stop)."""

    def __init__(self, engine: HFEngine, receiver: Receiver, kv_endpoint: str, test_token_delay_s: float = 0.0,
                 staging_bytes: int = 2 << 30, on_close: Callable[[], None] | None = None) -> None:  # fmt: skip
        self.test_token_delay_s = test_token_delay_s
        self._on_close = on_close
        self.engine = engine
        self.uploader = device_uploader(engine.device, staging_bytes)  # None on the CPU
        self.facts: ModelFacts = engine.facts
        self.receiver = receiver
        self.kv_endpoint = kv_endpoint
        self.layout = LayoutCheck(self.facts.dtype, self.facts.num_layers, self.facts.num_kv_heads, self.facts.head_dim)

    def expect(self, expected: Expected, ttl_s: float, events: ShipmentEvents) -> KVHold:
        inbound = self.receiver.expect(
            expected.job_id, expected.attempt, ttl_s, tenant=expected.tenant, max_bytes=expected.kv_bytes
        )
        return Assembly(expected, inbound, self.layout, events, self._pin(expected), self.uploader)

    def _pin(self, expected: Expected) -> Hit | None:
        """The prompt's leading blocks held here, for the reservation's shipment to continue (at
        least the prompt's last token is shipped: the prefill region computes it anyway)."""
        store = self.engine.prefix_cache
        tokens = expected.token_ids
        if store is None or expected.cache_salt is None or len(tokens) <= store.block_tokens:
            return None
        reusable = (len(tokens) - 1) // store.block_tokens
        return store.lookup(block_hashes(tokens, store.block_tokens, expected.cache_salt, limit=reusable))

    def check_decode(self, call: DecodeCall, params: SamplingParams) -> None:
        """The prompt, when the request sends one (it may decode from the KV alone): it must be the KV's and in the
        vocabulary. The KV itself is checked as it arrives (assembly.LayoutCheck) and when adopted."""
        if call.token_ids:
            call.check_prompt_matches()
            self.engine.check_prompt(call.token_ids, params)

    def decode(self, hold: KVHold, call: DecodeCall, params: SamplingParams, deadline: float,
               canceled: threading.Event) -> list[Iterator[Chosen]]:  # fmt: skip
        assert isinstance(hold, Assembly)  # this backend's own
        layers = hold.take()
        if layers[0].k.shape[1] != call.num_tokens:
            raise PreconditionFailed(f"KV covers {layers[0].k.shape[1]} tokens, the request says {call.num_tokens}")
        facts = self.engine.facts
        kv = KVCache(facts.fingerprint, facts.dtype, tuple(layers), call.num_tokens, call.token_ids_hash)
        firsts = call.firsts or [Chosen(call.first_token)]
        # lossy KV never enters the prefix cache, nor KV whose prompt no hash vouches for
        salt = call.cache_salt if hold.lossless and call.token_ids_hash else None
        return [
            self._paced(
                self.engine.decode_chosen(kv, first.token, params.for_choice(c), call.token_ids, salt), canceled
            )
            for c, first in enumerate(firsts)
        ]

    def check_prompt(self, token_ids: Sequence[int], params: SamplingParams) -> None:
        self.engine.check_prompt(token_ids, params)

    def generate(self, token_ids: list[int], params: SamplingParams, deadline: float,
                 canceled: threading.Event, cache_salt: str | None = None) -> Generated:  # fmt: skip
        def between_layers(_index: int, _k: object, _v: object) -> None:  # a Cancel, the deadline
            if canceled.is_set():
                raise Canceled("canceled during its prefill")
            if time.monotonic() >= deadline:
                raise DeadlineExceeded("the job's deadline passed during its prefill")

        result = self.engine.prefill(token_ids, params, cache_salt=cache_salt, on_layer=between_layers)
        return Generated([
            self._paced(itertools.chain((first,), self.engine.decode_chosen(
                result.kv, first.token, params.for_choice(c), token_ids, cache_salt)), canceled)
            for c, first in enumerate(result.choices)
        ], result.cached_tokens)  # fmt: skip

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
        if self._on_close is not None:
            self._on_close()  # the receiver itself is its creator's to close (a region process ends with it)
