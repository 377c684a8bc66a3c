"""The Cancel RPC both region services carry (common.proto's CancelRequest -> CancelReply): the job id
checked, the error the job ends with, the reply. What a cancel stops is each service's own `cancel`."""

from __future__ import annotations

from abc import ABC, abstractmethod

import grpc

from prfaas.protos.prfaas.v1 import common_pb2
from prfaas.region.errors import Canceled, unary
from prfaas.region.requests import cancel_of


class CancelService(ABC):
    """Mixed into a region's servicer ahead of its generated base, whose Cancel it answers."""

    @unary
    def Cancel(self, request: common_pb2.CancelRequest, context: grpc.ServicerContext) -> common_pb2.CancelReply:
        job_id, canceled = cancel_of(request)
        return common_pb2.CancelReply(found=self.cancel(job_id, canceled, request.attempt))

    @abstractmethod
    def cancel(self, job_id: str, canceled: Canceled, attempt: int = 0) -> bool:
        """Stop the job's work here at once, ending it with `canceled`: `attempt`'s and older attempts' (0:
        every attempt's; `region.requests.stops`); whether the region held anything it stopped (False:
        already ended, or a newer attempt's). Idempotent."""
