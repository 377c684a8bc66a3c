"""WebRTC signalling through Redis, for regions that cannot take inbound TCP (transport/webrtc_*): any
registry process can take an offer (`Registry.Signal`) and any can hand it to the region's `Offers` stream.

Keys (prefix `p`): `p:signal:{region}` list of pending offers (JSON id + sdp + expiry), `p:signal-to:{id}` the
region an offer is addressed to (only it may answer), `p:signal-answer:{id}` list holding the one answer. Waits
block in Redis for 1 s at a time (below the client's socket timeout) up to their deadline. An offer taken for a
region's Offers stream that ended before the offer went out is put back at the head of the region's list."""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from typing import Any, NamedTuple

import redis

from prfaas.control_plane.settings import Settings
from prfaas.transport.identity import REGION_NAME

MAX_SDP_BYTES = 64 << 10  # an offer or answer (a data channel's SDP is about 1 KB)
MAX_PENDING_OFFERS = 64  # offers waiting for one region; past it a Signal is refused
_OFFER_ID = re.compile(r"[0-9a-f]{32}")


class SignalQueueFull(Exception):
    """The region has MAX_PENDING_OFFERS offers waiting already."""


class Offer(NamedTuple):
    id: str
    sdp: str
    raw: str  # as queued (what `put_back` queues again)


class SignalRelay:
    """WebRTC signalling through Redis (the keys above), so any registry process can take an offer
    and any can hand it to the region's Offers stream."""

    MAX_WAIT_S = 30.0
    OFFER_TTL_S = 60

    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self.redis: Any = client
        self.settings = settings

    def signal(self, region: str, offer_sdp: str, timeout_s: float) -> str:
        """Post an offer to `region`, wait for its answer. TimeoutError: no answer in time;
        ValueError: the region refused the offer."""
        if not REGION_NAME.fullmatch(region) or not offer_sdp or len(offer_sdp) > MAX_SDP_BYTES:
            raise ValueError(f"a region name and an offer_sdp of 1 to {MAX_SDP_BYTES} characters are required")
        if not 0 < timeout_s < math.inf:  # NaN too
            raise ValueError("timeout_s must be a finite number > 0")
        offer_id = uuid.uuid4().hex
        queue = self.settings.key(f"signal:{region}")
        if self.redis.llen(queue) >= MAX_PENDING_OFFERS:
            raise SignalQueueFull(f"region {region} has {MAX_PENDING_OFFERS} offers waiting already")
        with self.redis.pipeline() as pipe:
            pipe.set(self.settings.key(f"signal-to:{offer_id}"), region, ex=self.OFFER_TTL_S)
            pipe.rpush(queue, json.dumps({"id": offer_id, "sdp": offer_sdp, "exp": time.time() + timeout_s}))
            pipe.expire(queue, self.OFFER_TTL_S)
            pipe.execute()
        deadline = time.monotonic() + min(max(timeout_s, 0.1), self.MAX_WAIT_S)
        answer_key = self.settings.key(f"signal-answer:{offer_id}")
        while (remaining := deadline - time.monotonic()) > 0:
            item = self.redis.blpop([answer_key], timeout=max(1, min(int(remaining), 1)))
            if item is not None:
                answer = json.loads(item[1])
                if answer.get("error"):
                    raise ValueError(f"region {region} refused the offer: {answer['error']}")
                return str(answer["sdp"])
        raise TimeoutError(f"region {region} did not answer the WebRTC offer within {timeout_s:.1f} s")

    def next_offer(self, region: str, timeout_s: float = 1.0) -> Offer | None:
        """The oldest unexpired offer for `region`, or None after `timeout_s` (at most 1 s: below the
        client's socket timeout). Taken off the list: `put_back` an offer that could not be sent."""
        wait_s = min(max(timeout_s, 0.01), 1.0)
        item = self.redis.blpop([self.settings.key(f"signal:{region}")], timeout=wait_s)
        if item is None:
            return None
        raw = item[1].decode() if isinstance(item[1], bytes) else str(item[1])
        offer = json.loads(raw)
        if offer.get("exp", 0) < time.time():
            return None  # its sender gave up
        return Offer(str(offer["id"]), str(offer["sdp"]), raw)

    def put_back(self, region: str, offer: Offer) -> None:
        """Queue `offer` again, first: the region's stream it was taken for ended before it went out."""
        queue = self.settings.key(f"signal:{region}")
        with self.redis.pipeline() as pipe:
            pipe.lpush(queue, offer.raw)
            pipe.expire(queue, self.OFFER_TTL_S)
            pipe.execute()

    def addressee(self, offer_id: str) -> str | None:
        """The region the pending offer `offer_id` is addressed to; None once answered or expired (or
        never made). ValueError for an id no offer has."""
        if not _OFFER_ID.fullmatch(offer_id):
            raise ValueError("an offer's id is 32 hex digits")
        region = self.redis.get(self.settings.key(f"signal-to:{offer_id}"))
        return region.decode() if isinstance(region, bytes) else region

    @staticmethod
    def check_answer(offer_id: str, answer_sdp: str, error: str = "") -> None:
        """ValueError for an id no offer has, or an answer or error over MAX_SDP_BYTES."""
        if not _OFFER_ID.fullmatch(offer_id) or len(answer_sdp) > MAX_SDP_BYTES or len(error) > 4096:
            raise ValueError(f"an offer's id (32 hex digits) and an answer of at most {MAX_SDP_BYTES} characters")

    def answer(self, offer_id: str, answer_sdp: str, error: str = "") -> None:
        """Hand the answer to the offer's sender (the registry checks first that the caller is the
        offer's addressee). ValueError as `check_answer`."""
        self.check_answer(offer_id, answer_sdp, error)
        key = self.settings.key(f"signal-answer:{offer_id}")
        with self.redis.pipeline() as pipe:
            pipe.rpush(key, json.dumps({"sdp": answer_sdp, "error": error}))
            pipe.expire(key, self.OFFER_TTL_S)
            pipe.delete(self.settings.key(f"signal-to:{offer_id}"))  # answered: no second answer
            pipe.execute()
