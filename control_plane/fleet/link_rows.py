"""The operator-set links in the control plane's database (made by the migration `0006_links`): the truth,
which Redis (`p:links`, what the scheduler reads) is filled from again when it comes back empty. `LinkBook`
writes both, the database first."""

from __future__ import annotations

import logging
import time
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Mapped, Session, mapped_column

from prfaas.control_plane.db.base import Base, Str64, Str512
from prfaas.control_plane.scheduling.snapshot import Link

log = logging.getLogger(__name__)
REFILL_EVERY_S = 5.0  # an empty Redis hash asks the database at most this often (a fleet with no links at all)


class LinkRow(Base):
    __tablename__ = "links"

    src: Mapped[Str64] = mapped_column(primary_key=True)
    dst: Mapped[Str64] = mapped_column(primary_key=True)
    spec: Mapped[Str512]  # the Link's JSON
    updated_at: Mapped[float]


class LinkBook:
    """The links in the database (`engine`; None: Redis alone) and in Redis's hash `key`."""

    def __init__(self, client: Any, key: str, engine: Engine | None) -> None:
        self.redis, self.key, self.engine = client, key, engine
        self._asked_at = float("-inf")

    def set(self, link: Link) -> None:
        spec = link.model_dump_json()
        if self.engine is not None:
            with Session(self.engine) as session, session.begin():
                session.merge(LinkRow(src=link.src, dst=link.dst, spec=spec, updated_at=time.time()))
        self.redis.hset(self.key, f"{link.src}>{link.dst}", spec)

    def delete(self, src: str, dst: str) -> bool:
        deleted = 0
        if self.engine is not None:
            with Session(self.engine) as session, session.begin():
                result: Any = session.execute(delete(LinkRow).where(LinkRow.src == src, LinkRow.dst == dst))
                deleted = int(result.rowcount or 0)
        return bool(self.redis.hdel(self.key, f"{src}>{dst}")) or bool(deleted)

    def stored(self) -> dict[bytes | str, bytes | str]:
        """Field -> Link JSON, from Redis; from the database (written back to Redis) when Redis holds none and
        the database has not been asked for `REFILL_EVERY_S`."""
        raw: dict[bytes | str, bytes | str] = self.redis.hgetall(self.key)
        if raw or self.engine is None or time.monotonic() - self._asked_at < REFILL_EVERY_S:
            return raw
        self._asked_at = time.monotonic()
        with Session(self.engine) as session:
            rows = session.execute(select(LinkRow.src, LinkRow.dst, LinkRow.spec)).all()
        if not rows:
            return raw
        refilled: dict[bytes | str, bytes | str] = {f"{src}>{dst}": spec for src, dst, spec in rows}
        self.redis.hset(self.key, mapping=refilled)
        log.warning("links restored from the database into an empty Redis: %d", len(refilled))
        return refilled
