"""Stop conditions checked after each appended output token (stop strings are the
output processor's job: they need detokenized text)."""

from __future__ import annotations

from raylm.scheduler.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set the request's finished status and return True if its last token ends it.

    Length first (as vLLM): a request at max_tokens or max_model_len is capped even when
    its last token is also a stop token. ``min_tokens`` gates EOS and ``stop_token_ids``.
    """
    if request.num_tokens >= max_model_len or request.num_output_tokens >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    params = request.sampling_params
    if request.num_output_tokens < params.min_tokens:
        return False
    last_token_id = request.output_token_ids[-1]
    if not params.ignore_eos and last_token_id in request.eos_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last_token_id in request.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last_token_id
        return True
    return False
