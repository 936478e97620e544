"""The MTP layer's first-pass rows after a step: each computed and kept position with the token after it."""

from __future__ import annotations

from mlaserve.core.request import Request
from mlaserve.core.scheduler import ScheduledRequest, SchedulerOutput
from mlaserve.runner.batch import plan_batch
from mlaserve.runner.mtp_draft import draft_spans


def request(rid: str, prompt: list[int], outputs: list[int] = (), drafts: bool = True) -> Request:
    r = Request(rid, list(prompt), 16, int(rid[1:]), allow_drafts=drafts)
    for token in outputs:
        r.append_output_token(token)
    return r


def test_chunks_final_chunks_and_verified_decodes() -> None:
    chunk = request("r0", list(range(10, 20)), drafts=False)  # positions 0..3 of a 10-token prompt
    final = request("r1", [1, 2, 3, 4, 5])  # positions 2..4, then its first token
    decode = request("r2", [7, 8, 9], [40])  # its last token at 3, drafts 41 42 43 (one accepted)
    blocks = [[1, 2, 3]]
    scheduled = [
        ScheduledRequest(chunk, 4, 0, blocks),
        ScheduledRequest(final, 3, 2, blocks),
        ScheduledRequest(decode, 4, 3, blocks, spec_token_ids=[41, 42, 43]),
    ]
    host = plan_batch(SchedulerOutput(scheduled, 11, []), 4)
    spans = {s.request_id: s for s in draft_spans(host, {"r1": 60, "r2": 50}, {"r2": 1})}
    assert (spans["r0"].start, spans["r0"].next_ids, spans["r0"].drafts) == (0, [11, 12, 13, 14], False)
    assert (spans["r1"].start, spans["r1"].next_ids, spans["r1"].drafts) == (2, [4, 5, 60], True)
    # the last known token and the accepted draft are kept; the token after them is the model's own
    assert (spans["r2"].start, spans["r2"].next_ids, spans["r2"].end) == (3, [41, 50], 5)
    rows = {s.request_id: s.row for s in spans.values()}
    order = [s.request.request_id for s in host.order]
    assert rows == {rid: sum(x.num_new_tokens for x in host.order[: order.index(rid)]) for rid in rows}
    # an aborted request's row has no token: it is left out
    assert "r1" not in {s.request_id for s in draft_spans(host, {"r2": 50}, {"r2": 1})}
