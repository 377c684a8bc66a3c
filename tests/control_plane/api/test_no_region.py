"""A fleet with no region alive that could serve a job: the attempt waits `dispatch.no_region_wait_s` for one to
come back, then the job fails with the reason. Before, a client waited for the job's whole deadline (300 s by
default), a stream without a byte, for `no placement: no region in the snapshot can decode`."""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest
from cp_kit import openai_client

from prfaas.devstack.stack import Stack
from prfaas.engine.models import prepare_model

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The API and a Celery worker, no region; jobs would wait 60 s for one, a region none 2 s."""
    prepare_model("tiny-llama")
    s = Stack(tmp_path_factory.mktemp("no-region"), PRFAAS_JOB_TIMEOUT_S="60", PRFAAS_DISPATCH_NO_REGION_WAIT_S="2")
    try:
        s.start_api()
        s.start_worker("w1")
        yield s
    finally:
        s.stop()
        s.cleanup()


def _complete(client: openai.OpenAI, stream: bool) -> None:
    reply = client.completions.create(model="tiny-llama", prompt="hello", max_tokens=2, stream=stream)
    if stream:
        list(reply)  # type: ignore[arg-type]  # the error event ends it


@pytest.mark.parametrize("stream", [False, True])
def test_a_job_no_region_can_serve_fails_in_the_wait_not_at_its_deadline(stack: Stack, stream: bool) -> None:
    client = openai_client(stack, stack.tenant(f"t-{stream}")[1], 30)
    started = time.monotonic()
    with pytest.raises(openai.APIError) as info:
        _complete(client, stream)
    elapsed = time.monotonic() - started
    assert "no region in the snapshot can decode" in str(info.value.message), info.value
    assert elapsed < 15, elapsed  # the 2 s wait (less the last retry's second), far from the 60 s deadline
