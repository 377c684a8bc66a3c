"""The control plane's Cancel of a job (jobs/decode_calls.py `cancel_in_regions`) against a real decode
region's gRPC server: a local job's is sent to its decode region alone. Before, a local job's record (its
prefill endpoint that same decode region's) also sent PrefillRegion/Cancel there, which a decode-only
region does not serve: `cancel of JOB in HOST:PORT: UNIMPLEMENTED` in the API's log for every one."""

from __future__ import annotations

import logging
import uuid

import pytest
from region_kit import local_region

from prfaas.control_plane.jobs.decode_calls import cancel_in_regions, region_channels
from prfaas.engine.hf import HFEngine


@pytest.mark.parametrize(("placement", "warned"), [("local", []), ("split", ["UNIMPLEMENTED"])])
def test_a_local_jobs_cancel_goes_to_its_decode_region_alone(
    tiny_engine: HFEngine, caplog: pytest.LogCaptureFixture, placement: str, warned: list[str]
) -> None:
    region = local_region(tiny_engine, prefill=False)  # a decode-only region: no PrefillRegion service
    try:
        endpoint = region.server.grpc_address
        job = {"placement_chosen": placement, "decode_grpc": endpoint, "prefill_grpc": endpoint,
               "decode_region": "test", "prefill_region": "test"}  # fmt: skip
        caplog.set_level(logging.WARNING, logger="prfaas.control_plane.jobs.decode_calls")
        cancel_in_regions(region_channels(None), str(uuid.uuid4()), job, "canceled by the client", wait=True)
        assert [r.getMessage().rsplit(": ", 1)[1] for r in caplog.records] == warned  # split: the test can tell
    finally:
        region.close()
