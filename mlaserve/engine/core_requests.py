"""The engine core's requests in and out: a scheduler Request from a prepared one (its length limit, EOS and stop
token ids), and the last CoreOutput of a finished one (how it finished, its timings)."""

from __future__ import annotations

import time

from mlaserve.config.model_config import ModelConfig
from mlaserve.core.request import Request, RequestStatus
from mlaserve.engine.core_output import CoreOutput
from mlaserve.engine.intake import PreparedRequest
from mlaserve.outputs import LogprobEntry


def new_request(
    prepared: PreparedRequest,
    request_id: str,
    arrival_index: int,
    model_config: ModelConfig,
    tokenizer: object | None,
) -> Request:
    params = prepared.params
    room = model_config.max_model_len - len(prepared.prompt_token_ids)
    max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
    # The tokenizer's EOS is the one that ends text; the model's other EOS ids (generation_config.json) stop it too,
    # as stop tokens, so that ignore_eos turns them all off.
    eos_ids = model_config.eos_token_ids
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    eos = tok_eos if tok_eos is not None else (eos_ids[0] if eos_ids else None)
    stop_ids = list(params.stop_token_ids or [])
    if not params.ignore_eos:
        stop_ids += [e for e in eos_ids if e != eos]
    return Request(
        request_id,
        prepared.prompt_token_ids,
        max_tokens,
        arrival_index=arrival_index,
        eos_token_id=eos,
        stop_token_ids=tuple(stop_ids),
        ignore_eos=params.ignore_eos,
        sampling_params=params,
        read_prefix_cache=params.prompt_logprobs is None,
        arrival_time=time.monotonic(),
    )


def final_output(
    request: Request,
    new: list[int],
    logprobs: list[LogprobEntry] | None = None,
    prompt_logprobs: list | None = None,
) -> CoreOutput:
    """The last output of a finished request."""
    out_ids = request.output_token_ids
    stop_reason = None
    if request.status == RequestStatus.FINISHED_STOPPED and out_ids and out_ids[-1] != request.eos_token_id:
        stop_reason = out_ids[-1]  # a stop token id (a stop string is the reader's to name)
    metrics = {  # vLLM's RequestOutput.metrics, as time.monotonic() stamps
        "arrival_time": request.arrival_time,
        "first_scheduled_time": request.first_scheduled_time,
        "first_token_time": request.first_token_time,
        "finished_time": time.monotonic(),
    }
    return CoreOutput(
        request.request_id,
        new,
        logprobs,
        request.status.finish_reason,
        stop_reason,
        prompt_logprobs,
        max(request.num_cached_tokens, 0),
        metrics,
    )
