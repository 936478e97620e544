"""Speculative drafts under tensor parallelism (gloo, two CPU processes): every rank computes the draft rows' logits
and rank 0 verifies them, and every rank runs the MTP layer's pass, so greedy tokens and logprobs equal one
process's without drafts."""

from __future__ import annotations

import pytest

from mlaserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

OPTIONS = dict(dtype="float32", device="cpu", max_model_len=128, max_num_batched_tokens=48, block_size=4)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def prompts() -> list[dict]:
    """Repeating prompts (drafts found and accepted), one past the step's budget (chunked), one random."""
    base = [(7 * i) % 250 + 3 for i in range(70)]
    return [{"prompt_token_ids": p} for p in ([11, 40, 97] * 5, base[:6] * 4, base[:60], base[10:33])]


PARAMS = [
    SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, frequency_penalty=-0.3, logprobs=1),
    SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
]


def run(model, **options: object) -> tuple[list, dict]:
    llm = LLM(str(model), **OPTIONS, **options)
    try:
        outs = llm.generate(prompts(), PARAMS, use_tqdm=False)
        return outs, llm.stats()
    finally:
        llm.engine.close()


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_tp2_drafts_give_one_process_tokens(tiny, name: str) -> None:
    model = tiny(name)
    want, _ = run(model)
    got, stats = run(model, tensor_parallel_size=2, speculative_config=NGRAM)
    assert stats["speculative_decoding"] and stats["tensor_parallel_size"] == 2
    assert stats["num_accepted_tokens"] > 0 and stats["kv_blocks_used"] == 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for a, b in zip(want, got, strict=True):
        if a.outputs[0].logprobs is None:
            continue
        for token, x, y in zip(
            a.outputs[0].token_ids, a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True
        ):
            assert list(x) == list(y) and abs(x[token].logprob - y[token].logprob) < 1e-4


@pytest.mark.parametrize("echo", [False, True], ids=["random_layer", "echo_layer"])
@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v32"])
def test_tp2_mtp_drafts_give_one_process_tokens(tmp_path, tiny, name: str, echo: bool) -> None:
    """Every rank runs the MTP layer's pass over the spans rank 0 sends (the layer is sharded like the model, and
    V3.2's has an indexer of its own, whole on every rank): the drafts, and so the counts of drafts made and
    accepted, are one process's. With the echo layer (mtp_checkpoint.py) most drafts hold, which they would not if
    a rank's share of the layer's cache were wrong."""
    from mlaserve.testing.mtp_checkpoint import add_mtp_layer

    path = add_mtp_layer(tiny(name), tmp_path / "mtp", echo=echo)
    mtp = {"method": "mtp", "num_speculative_tokens": 2}
    want, _ = run(path)
    _, alone = run(path, speculative_config=mtp)
    got, stats = run(path, tensor_parallel_size=2, speculative_config=mtp)
    assert stats["speculative_decoding"] and stats["num_draft_tokens"] > 0 and stats["kv_blocks_used"] == 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    counts = ("num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")
    assert [stats[c] for c in counts] == [alone[c] for c in counts]
    if echo:
        assert stats["num_accepted_tokens"] > 0.8 * stats["num_draft_tokens"]


@pytest.mark.parametrize("echo", [False, True], ids=["random_layer", "echo_layer"])
def test_tp2_v4_mtp_drafts_give_one_process_tokens(tmp_path, tiny, echo: bool) -> None:
    """DeepSeek-V4's MTP layer (models/deepseek_v4_mtp.py): its block's heads and experts split like the model's,
    e_proj, h_proj and its stream collapse every rank's; drafts and their counts are one process's."""
    from mlaserve.testing.v4_mtp_checkpoint import add_v4_mtp_layer

    path = add_v4_mtp_layer(tiny("deepseek_v4"), tmp_path / "mtp", echo=echo)
    mtp = {"method": "mtp", "num_speculative_tokens": 2}
    want, _ = run(path)
    _, alone = run(path, speculative_config=mtp)
    got, stats = run(path, tensor_parallel_size=2, speculative_config=mtp)
    assert stats["speculative_decoding"] and stats["num_draft_tokens"] > 0 and stats["kv_blocks_used"] == 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    counts = ("num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")
    assert [stats[c] for c in counts] == [alone[c] for c in counts]
    if echo:  # all but where the frequency penalty moves the target off the echo (PARAMS[2])
        assert stats["num_accepted_tokens"] > 0.8 * stats["num_draft_tokens"]
