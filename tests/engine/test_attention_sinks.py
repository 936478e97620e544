"""The training-free sliding window with attention sinks (engine options sliding_window, num_sink_tokens) on a model
trained for full attention: transformers' own Llama, given the same mask as a 4-D attention mask, is the reference.
Greedy tokens must equal its argmax along our output and our logprobs its log-softmax within 1e-4; the window's
blocks go back to the pool while the sink blocks stay."""

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.testing.tiny_models import build_tiny, load_reference
from tests.engine.test_sliding_window import prompts

OPTIONS = dict(dtype="float32", device="cpu", block_size=4, max_model_len=256)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_tiny("llama", tmp_path_factory.mktemp("sinks_llama"), max_position_embeddings=1024)


def masked_reference(path, ids: list[int], window: int, sinks: int) -> torch.Tensor:
    """Log-softmax of transformers' logits along ids, each token seeing the last `window` and the first `sinks`."""
    pos = torch.arange(len(ids))
    q, k = pos[:, None], pos[None, :]
    mask = (k <= q) & ((k > q - window) | (k < sinks))
    with torch.no_grad():
        logits = load_reference(path)(torch.tensor([ids]), attention_mask=mask[None, None]).logits[0]
    return logits.float().log_softmax(-1)


def check_against_reference(path, batch, outs, window: int, sinks: int) -> None:
    for ids, out in zip(batch, outs):
        tokens = out.outputs[0].token_ids
        ref = masked_reference(path, ids + tokens, window, sinks)[len(ids) - 1 : -1]
        assert tokens == ref.argmax(-1).tolist()
        got = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)])
        torch.testing.assert_close(got, ref.gather(1, torch.tensor(tokens)[:, None])[:, 0], atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "window, sinks, options",
    [
        (16, 5, {}),
        (16, 5, dict(max_num_batched_tokens=8)),  # chunks that split the sink and the window blocks
        (9, 0, dict(max_num_batched_tokens=8)),
        (12, 3, dict(num_kv_blocks=14, max_num_batched_tokens=8)),  # tight: preemption
    ],
    ids=["sinks", "sinks-chunked", "window-only", "preempted"],
)
def test_window_and_sinks_equal_transformers_with_the_same_mask(llama, window, sinks, options):
    llm = LLM(
        str(llama),
        **{**OPTIONS, "num_kv_blocks": 200, **options},
        sliding_window=window,
        num_sink_tokens=sinks,
    )
    rule = f"window {window}" + (f" + {sinks} sink tokens" if sinks else "")
    assert llm.stats()["kv_cache_groups"] == [f"{rule}: 2 layers, 512 bytes/token"]
    batch = prompts(4, seed=7, low=20, high=50)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    check_against_reference(llama, batch, outs, window, sinks)
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0
    if "num_kv_blocks" in options:
        assert stats["num_preemptions"] > 0


def test_prefix_hits_keep_the_sinks(llama):
    llm = LLM(str(llama), **OPTIONS, num_kv_blocks=200, sliding_window=12, num_sink_tokens=6)
    batch = prompts(3, seed=8, low=40, high=60)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0)
    first = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert llm.stats()["prefix_cache_hits"] > 0
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    check_against_reference(llama, batch, again, 12, 6)


def test_a_long_generation_holds_the_sink_and_window_blocks_only(llama):
    llm = LLM(
        str(llama),
        **OPTIONS,
        num_kv_blocks=64,
        max_num_batched_tokens=16,
        sliding_window=16,
        num_sink_tokens=4,
    )
    engine = llm.engine
    engine.add_request({"prompt_token_ids": prompts(1, seed=9, low=30, high=31)[0]},
                       SamplingParams(temperature=0, max_tokens=600, ignore_eos=True))  # fmt: skip
    most = 0
    while engine.has_unfinished_requests():
        engine.step(stream=False)
        most = max(most, engine.stats()["kv_blocks_by_group"][0])
    assert most <= 1 + -(-16 // 4) + 1  # one sink block, the window's, the block being filled
    assert engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(num_sink_tokens=4), "num_sink_tokens=4: must be 0 unless sliding_window is set"),
        (dict(sliding_window=8, num_sink_tokens=-1), "num_sink_tokens=-1: must be an int >= 0"),
        (dict(sliding_window=0), "sliding_window=0: must be a positive int"),
    ],
)
def test_bad_window_options_are_errors(llama, options, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(llama), **OPTIONS, num_kv_blocks=16, **options)


def test_latent_cache_models_refuse_the_window_before_weights_load(tmp_path, monkeypatch):
    path = build_tiny("deepseek_v2", tmp_path)
    loaded = []
    monkeypatch.setattr("mlaserve.executor.model_build.build_model", lambda *a, **k: loaded.append(1))
    with pytest.raises(ValueError, match="sliding_window applies to models with per-head K/V caches"):
        LLM(str(path), device="cpu", num_kv_blocks=16, sliding_window=64)
    assert not loaded
