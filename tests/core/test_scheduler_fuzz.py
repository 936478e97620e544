"""Random workloads through schedule/update with a fake model and a fake paged KV store.

The fake KV store records, per slot, which token prefix produced it; every step then checks that each
scheduled request reads exactly its own prefix through its block table. That is the property prefix
caching, preemption and block reuse must preserve, checked directly rather than through block ids.
"""

import copy
import random
from collections import Counter

import pytest

from mlaserve.core.request import Request, RequestStatus
from mlaserve.core.scheduler import Scheduler

from .conftest import make_scheduler

VOCAB = 40
MAX_MODEL_LEN = 48


def fake_model(token_ids: list[int]) -> int:
    """Deterministic in the history, so a preempted request must continue exactly as if it never was."""
    return (token_ids[-1] * 31 + len(token_ids) * 7 + sum(token_ids[-3:])) % VOCAB


def reference_output(request: Request) -> list[int]:
    tokens, out = list(request.prompt_token_ids), []
    while True:
        token = fake_model(tokens)
        tokens.append(token)
        out.append(token)
        if not request.ignore_eos and token == request.eos_token_id:
            return out
        if len(out) >= request.max_tokens or len(tokens) >= MAX_MODEL_LEN:
            return out


def prefix_keys(token_ids: list[int]) -> list[int]:
    keys, key = [], 0
    for token in token_ids:
        key = hash((key, token))
        keys.append(key)
    return keys


def run_fake_step(
    kv_store: dict[int, tuple[int, int]], out, block_size: int, in_flight: dict[str, int] | None = None
) -> dict[str, int]:
    """What the device does with a scheduled step: write its KV, read every row's prefix, sample. in_flight: the
    tokens the previous step sampled, not yet applied to the requests (a lookahead row's input)."""

    def known(s) -> list[int]:
        return s.request.all_token_ids + ([in_flight[s.request.request_id]] if s.lookahead else [])

    # Every write of the batch lands before any read, as each attention layer does.
    for s in out.scheduled:
        keys, table = prefix_keys(known(s)), s.block_ids[0]
        for pos in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
            kv_store[table[pos // block_size] * block_size + pos % block_size] = (pos, keys[pos])
    for s in out.scheduled:
        keys, table = prefix_keys(known(s)), s.block_ids[0]
        for pos in range(s.num_computed_tokens + s.num_new_tokens):
            slot = table[pos // block_size] * block_size + pos % block_size
            assert kv_store.get(slot) == (pos, keys[pos]), f"{s.request.request_id} reads wrong KV at {pos}"
    return {s.request.request_id: fake_model(known(s)) for s in out.scheduled}


def summary(out) -> list[tuple[str, int, int]] | None:
    return (
        None
        if out is None
        else [(s.request.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled]
    )


def check_cached_blocks_written(
    sched: Scheduler, kv_store: dict[int, tuple[int, int]], requests: list[Request], block_size: int
) -> None:
    """Every block in the prefix cache holds the KV its hash names: once a step is scheduled it runs, and a
    schedule that does not run (a lookahead that gave up) must have offered none of its blocks."""
    pool = sched.kv_cache_manager.block_pool
    for r in requests:
        keys = prefix_keys(r.all_token_ids)
        for i, block_hash in enumerate(r.block_hashes.get(0, [])):
            block = pool.get_cached_block(block_hash)
            if block is None:
                continue
            slots = range(block.block_id * block_size, (block.block_id + 1) * block_size)
            positions = range(i * block_size, (i + 1) * block_size)
            assert [kv_store.get(slot) for slot in slots] == [(p, keys[p]) for p in positions], r.request_id


def check_invariants(sched: Scheduler, out) -> None:
    config, kv = sched.config, sched.kv_cache_manager
    ids = [s.request.request_id for s in out.scheduled]
    assert len(ids) == len(set(ids))
    assert (
        out.num_batched_tokens
        == sum(s.num_new_tokens for s in out.scheduled)
        <= config.max_num_batched_tokens
    )
    assert len(sched.running) <= config.max_num_seqs
    assert [r.arrival_index for r in sched.running] == sorted(r.arrival_index for r in sched.running)
    pool = kv.block_pool
    holders = Counter(b.block_id for m in kv.managers for table in m.req_to_blocks.values() for b in table)
    assert 0 not in holders
    assert set(kv.managers[0].req_to_blocks) <= {r.request_id for r in sched.running}
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders[block.block_id]
    assert pool.num_free_blocks == sum(1 for b in pool.blocks[1:] if b.ref_cnt == 0)


@pytest.mark.parametrize("lookahead", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", range(12))
def test_random_workload(seed: int, lookahead: bool, make_request) -> None:
    """lookahead: the engine's asynchronous scheduling, where each step's successor is scheduled with
    schedule_lookahead and run before the step's own tokens are applied."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    blocks_per_seq = -(-MAX_MODEL_LEN // block_size)
    # Even seeds: memory for about one long sequence and prefix caching on, to force preemption with hits.
    tight = seed % 2 == 0
    chunked = rng.random() < 0.7
    sched = make_scheduler(
        num_blocks=1 + blocks_per_seq + rng.randint(0, blocks_per_seq // 2 if tight else 2 * blocks_per_seq),
        block_size=block_size,
        max_num_seqs=rng.randint(2 if tight else 1, 8),
        max_num_batched_tokens=rng.randint(4, 64) if chunked else rng.randint(MAX_MODEL_LEN, 96),
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=chunked,
        enable_caching=tight or rng.random() < 0.8,
        prefill_first=rng.random() < 0.4,
    )
    bases = [[rng.randrange(VOCAB) for _ in range(32)] for _ in range(3)]

    def new_request() -> Request:
        prompt = rng.choice(bases)[: rng.randint(0, 24)] + [
            rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))
        ]
        with_eos = rng.random() < 0.3
        return make_request(
            prompt,
            max_tokens=rng.randint(1, MAX_MODEL_LEN - len(prompt)),
            eos_token_id=rng.randrange(VOCAB) if with_eos else None,
            ignore_eos=not with_eos,
        )

    pending = [new_request() for _ in range(40)]
    all_requests = list(pending)
    kv_store: dict[int, tuple[int, int]] = {}
    aborted: set[str] = set()
    ahead = None  # a lookahead step run but not yet applied, with its sampled tokens
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
            assert not out.is_empty, "unfinished requests but nothing scheduled: the scheduler is stuck"
            check_invariants(sched, out)
            sampled = run_fake_step(kv_store, out, block_size)
        else:
            out, sampled = ahead
        ahead = None
        if lookahead:
            # What schedule() picks once `out` is applied, on a copy: the lookahead must pick the same.
            twin, twin_out = copy.deepcopy((sched, out))
            twin_finished = twin.update_from_output(twin_out, sampled)
            twin_next = twin.schedule()
            next_out = sched.schedule_lookahead(out)
            aborted_in_flight = any(s.request.is_finished for s in out.scheduled)
            if not (twin_finished or twin_next.preempted_request_ids or aborted_in_flight):
                assert summary(next_out) == (summary(twin_next) or None)  # None: nothing to schedule
            if next_out is not None:
                check_invariants(sched, next_out)
                # A row is queued ahead exactly when its request samples in `out`; the others' tokens are known.
                sampling = {s.request.request_id for s in out.scheduled if s.needs_sample}
                assert all(s.lookahead == (s.request.request_id in sampling) for s in next_out.scheduled)
                ahead = next_out, run_fake_step(kv_store, next_out, block_size, sampled)
        sched.update_from_output(out, sampled)  # tokens for partial prefills are ignored
        check_cached_blocks_written(sched, kv_store, all_requests, block_size)
        if rng.random() < 0.5:  # the engine releases after sending; else the next schedule does
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
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == kv.num_total_blocks
    assert all(not m.req_to_blocks for m in kv.managers)
    for r in all_requests:
        assert r.is_finished
        if r.request_id in aborted:
            continue
        expected = reference_output(r)
        assert r.output_token_ids == expected
        if r.ignore_eos:
            assert r.num_output_tokens == r.max_tokens and r.status is RequestStatus.FINISHED_LENGTH
