"""A token for a job whose record is gone (Redis came back empty under it) is not logged: JobNotFound, which the
follower ends as the job lost (FAILED "came back without the job's record; retry") at that token, its decode call
closed. Before, the decode ran on to the last token for nobody, its client streamed the whole answer and was then
told it failed. Real Redis."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from cp_kit import cleanup, ensure_redis, make_settings

from prfaas.control_plane.jobs.errors import JobNotFound
from prfaas.control_plane.jobs.tokenlog import Token, TokenLog
from prfaas.control_plane.services import Services
from prfaas.control_plane.tenants import Quota


@pytest.fixture
def services() -> Iterator[Services]:
    ensure_redis()
    settings = make_settings()
    services = Services.create(settings)
    yield services
    services.close()
    cleanup(settings)


def test_a_token_of_a_job_whose_record_is_gone_is_not_logged(services: Services) -> None:
    quota = Quota(rps=100, concurrency=100, budget_usd=100)
    job_id = services.jobs.create("t-" + uuid.uuid4().hex[:8], {"token_ids": [1, 2], "max_new_tokens": 3}, quota).job_id
    log = TokenLog(services.jobs)
    log.log_token(job_id, Token(0, 11, False, ""))
    services.redis.delete(services.settings.key("job", job_id))  # what FLUSHALL did to the record
    with pytest.raises(JobNotFound):
        log.log_token(job_id, Token(1, 12, False, ""))
    assert [t.token for t in log.logged_tokens(job_id, 0)] == [11]
