"""Random workloads with a draft model's drafts (ModelDrafts), synchronous and with steps queued behind verify steps
before their accepted drafts are known (placed as if every draft held, settled once the step before is read, as
runner/queued_verify.py does). The fake model of test_scheduler_fuzz checks that every row reads exactly its own
prefix through its block table: a rejected draft's slot read before a later step overwrote it, a block given back
while a queued step still wrote it, or a row settled to the wrong place would show. Outputs equal the plain
reference, and every block comes back."""

import random

import pytest

from mlaserve.core.request import Request, RequestStatus
from mlaserve.spec_decode.model_drafts import ModelDrafts

from .conftest import make_scheduler
from .test_scheduler_fuzz import (
    MAX_MODEL_LEN,
    VOCAB,
    check_cached_blocks_written,
    check_invariants,
    fake_model,
    prefix_keys,
    reference_output,
)


def fake_drafts(tokens: list[int], k: int, rng: random.Random) -> list[int]:
    """k drafts after `tokens`: the model's own continuation for a random count, then noise."""
    held, out, seq = rng.randint(0, k), [], list(tokens)
    for j in range(k):
        token = fake_model(seq) if j < held else rng.randrange(VOCAB)
        out.append(token)
        seq.append(token)
    return out


def run_step(kv_store: dict, out, block_size: int, in_flight: dict[str, list[int]]) -> dict[str, tuple]:
    """Writes the step's KV, checks every row's reads, and verifies its drafts greedily: request id -> (token,
    drafts accepted). in_flight: the tokens the step before adds (accepted drafts, then its token), not applied."""

    def known(s) -> list[int]:
        return s.request.all_token_ids + (in_flight[s.request.request_id] if s.lookahead else [])

    for s in out.scheduled:
        assert s.settled
        keys, table = prefix_keys(known(s) + s.spec_token_ids), s.block_ids[0]
        for pos in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
            kv_store[table[pos // block_size] * block_size + pos % block_size] = (pos, keys[pos])
    results = {}
    for s in out.scheduled:
        tokens = known(s) + s.spec_token_ids
        keys, table = prefix_keys(tokens), s.block_ids[0]
        for pos in range(s.num_computed_tokens + s.num_new_tokens):
            slot = table[pos // block_size] * block_size + pos % block_size
            assert kv_store.get(slot) == (pos, keys[pos]), f"{s.request.request_id} reads wrong KV at {pos}"
        base, accepted = len(known(s)), 0
        while accepted < len(s.spec_token_ids) and s.spec_token_ids[accepted] == fake_model(
            tokens[: base + accepted]
        ):
            accepted += 1
        results[s.request.request_id] = (fake_model(tokens[: base + accepted]), accepted)
    return results


@pytest.mark.parametrize("queued", [False, True], ids=["sync", "queued"])
@pytest.mark.parametrize("seed", range(10))
def test_random_workload_with_model_drafts(seed: int, queued: bool, make_request) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    blocks_per_seq = -(-MAX_MODEL_LEN // block_size)
    tight = seed % 2 == 0
    k = rng.randint(1, 3)
    sched = make_scheduler(
        num_blocks=1 + blocks_per_seq + rng.randint(0, blocks_per_seq // 2 if tight else 2 * blocks_per_seq),
        block_size=block_size,
        max_num_seqs=rng.randint(2, 8),
        max_num_batched_tokens=rng.randint(6, 64),
        max_model_len=MAX_MODEL_LEN,
        enable_caching=tight or rng.random() < 0.8,
        prefill_first=rng.random() < 0.4,
    )
    sched.proposer = ModelDrafts(k)
    sched.num_accepted_per_pos = [0] * k
    bases = [[rng.randrange(VOCAB) for _ in range(32)] for _ in range(3)]

    def new_request() -> Request:
        prompt = rng.choice(bases)[: rng.randint(0, 24)] + [
            rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))
        ]
        with_eos = rng.random() < 0.3
        return make_request(
            prompt, max_tokens=rng.randint(1, MAX_MODEL_LEN - len(prompt)), allow_drafts=True,
            eos_token_id=rng.randrange(VOCAB) if with_eos else None, ignore_eos=not with_eos,
        )  # fmt: skip

    pending = [new_request() for _ in range(30)]
    all_requests = list(pending)
    kv_store: dict = {}
    aborted: set[str] = set()
    ahead = None  # a step run behind the one being applied, and its results
    num_queued_behind = 0
    for _ in range(5000):
        for _ in range(rng.randint(0, 3)):
            if pending:
                sched.add_request(pending.pop(0))
        if not sched.has_unfinished_requests():
            if not pending:
                break
            continue
        if ahead is None:
            out = sched.schedule()
            assert not out.is_empty
            check_invariants(sched, out)
            results = run_step(kv_store, out, block_size, {})
        else:
            out, results = ahead
        ahead = None
        # What the draft model's pass after `out` proposes for each request it samples, from its tokens then.
        adds = {
            rid: [*s.spec_token_ids[:accepted], token]
            for s in out.scheduled
            for rid, (token, accepted) in [(s.request.request_id, results[s.request.request_id])]
            if s.needs_sample and not s.request.is_finished
        }
        made = {
            rid: fake_drafts(sched.requests[rid].all_token_ids + add, k, rng) for rid, add in adds.items()
        }
        if queued:
            next_out = sched.schedule_lookahead(out)
            if next_out is not None:
                check_invariants(sched, next_out)
                for s in next_out.scheduled:  # out is read: the rows behind it move to where it leaves them
                    rid = s.request.request_id
                    s.settle(results[rid][1] if rid in results else 0, made.get(rid, []))
                num_queued_behind += any(s.pending_drafts for s in next_out.scheduled)
                ahead = next_out, run_step(kv_store, next_out, block_size, adds)
        sampled = {rid: token for rid, (token, _) in results.items()}
        accepted = {rid: a for rid, (_, a) in results.items()}
        sched.update_from_output(out, sampled, accepted)
        for rid, drafts in made.items():
            request = sched.requests.get(rid)
            if request is not None:
                request.drafts_at, request.draft_token_ids = request.num_tokens, drafts
        check_cached_blocks_written(sched, kv_store, all_requests, block_size)
        if rng.random() < 0.5:
            sched.release_finished()
        if rng.random() < 0.02 and sched.requests:
            victim = rng.choice(sorted(sched.requests))
            assert sched.finish_request(victim, RequestStatus.FINISHED_ABORTED) is not None
            aborted.add(victim)
        if ahead is not None and all(s.request.is_finished for s in ahead[0].scheduled):
            ahead = None
    else:
        pytest.fail("workload did not finish")

    sched.release_finished()
    kv = sched.kv_cache_manager
    assert kv.num_used_blocks == 0 and all(not m.req_to_blocks for m in kv.managers)
    assert sched.num_draft_tokens > 0 and (num_queued_behind > 0) == queued
    for r in all_requests:
        assert r.is_finished
        if r.request_id not in aborted:
            assert r.output_token_ids == reference_output(r)
