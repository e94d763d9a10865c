"""What travels: the request record, its sampling parameters and its lifecycle (record.py), and the step plans the
scheduler makes of requests' rows for the runner (step.py)."""

from jaxserve.request.record import (
    LEGAL_TRANSITIONS,
    LOGIT_BIAS_RANGE,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    FinishReason,
    IllegalTransition,
    InvalidRequest,
    Request,
    RequestStatus,
    SamplingParams,
    TokenLogprob,
)

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
]
