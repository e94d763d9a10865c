"""What travels: a request's sampling parameters (params.py), the live request record and its lifecycle
(record.py), the step plans the scheduler makes of requests' rows (step.py) and the value-typed step batches the
runner takes (batch.py)."""

from jaxserve.request.params import (
    LOGIT_BIAS_RANGE,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    FinishReason,
    InvalidRequest,
    SamplingParams,
    TokenLogprob,
    listed,
)
from jaxserve.request.record import LEGAL_TRANSITIONS, IllegalTransition, Request, RequestStatus

__all__ = [
    "LEGAL_TRANSITIONS",
    "LOGIT_BIAS_RANGE",
    "MAX_LOGIT_BIAS",
    "MAX_LOGPROBS",
    "FinishReason",
    "IllegalTransition",
    "InvalidRequest",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "TokenLogprob",
    "listed",
]
