"""GQA -> MLA at reduced rank (conversion/mla.py): full rank with every rotary pair is still exact; at reduced rank
the absorbed decode (reading the latent in place) and the expanded prefill (rebuilding per-head K/V) must agree,
whatever the batching or chunking; the cache shrinks as the ranks say; ranks that do not fit are errors before any
weight loads."""

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.conversion.mla import allocate_ranks, pair_scores, principal_basis
from tests.conversion.conftest import OPTIONS
from tests.engine.test_sliding_window import (
    check_against_reference,
    prompts,
)


def test_pair_scores_and_basis():
    q = torch.zeros(5, 4, 8)
    k = torch.zeros(5, 2, 8)
    q[..., 1], q[..., 5] = 3.0, 4.0  # pair 1 (features 1 and 5) carries everything for every head
    k[:, 0, 1], k[:, 1, 2] = 1.0, 1.0
    scores = pair_scores(q, k, half=4)
    assert scores.shape == (2, 4) and scores[0].argmax() == 1 and scores[1].max() == 0
    rows = torch.randn(50, 3) @ torch.tensor([[1.0, 0, 0], [0, 0, 0], [0, 0, 2.0]])
    basis = principal_basis(rows, 2)
    assert torch.allclose(basis.t() @ basis, torch.eye(2), atol=1e-5)
    assert torch.allclose(basis[1], torch.zeros(2), atol=1e-5)  # an empty direction is never kept


def test_full_rank_with_every_rotary_pair_is_exact(llama):
    # 2 KV heads x (16 values + 0 nope keys) = 32: the whole latent, through a (rotated) basis instead of the identity
    llm = LLM(str(llama), **OPTIONS, enable_mla=True, mla_latent_dim=32, qk_rope_head_dim=16)
    batch = prompts(2, seed=1, low=10, high=40)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    check_against_reference(llama, batch, outs)


def generate(path, **options) -> list:
    llm = LLM(str(path), **OPTIONS, enable_mla=True, mla_latent_dim=12, qk_rope_head_dim=8, **options)
    batch = prompts(3, seed=4, low=20, high=60)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return llm, batch, outs


def test_reduced_rank_decode_and_prefill_agree(llama):
    llm, batch, outs = generate(llama)
    # 3 layers x (rank 12 + 2 KV heads x 8 rotary features) x 4 bytes, from 2 x 2 x 16 x 4 per layer
    assert llm.stats()["kv_bytes_per_token"] == llm.engine.model_config.num_layers * (12 + 2 * 8) * 4
    # the generated tokens' logprobs came from absorbed decode; scoring prompt + output runs the expanded prefill
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    for ids, out in zip(batch, outs):
        tokens = out.outputs[0].token_ids
        scored = llm.generate([{"prompt_token_ids": ids + tokens}], params, use_tqdm=False)[0].prompt_logprobs
        for i, token in enumerate(tokens):
            assert abs(scored[len(ids) + i][token].logprob - out.outputs[0].logprobs[i][token].logprob) < 1e-4
    chunked = generate(llama, enable_chunked_prefill=True, max_num_batched_tokens=16)[2]
    assert [o.outputs[0].token_ids for o in chunked] == [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(enable_mla=True, mla_latent_dim=100), "at most the nope keys and values"),
        (dict(enable_mla=True, qk_rope_head_dim=7), "even number"),
        (dict(enable_mla=True, qk_rope_head_dim=32), "even number from 2 to the model's rotary width 16"),
        (dict(mla_latent_dim=8), "unset unless enable_mla is set"),
    ],
)
def test_ranks_that_do_not_fit_fail_before_weights_load(llama, monkeypatch, options, message):
    loaded = []
    monkeypatch.setattr("mlaserve.executor.model_build.build_model", lambda *a, **k: loaded.append(1))
    with pytest.raises(ValueError, match=message):
        LLM(str(llama), device="cpu", **options)
    assert not loaded


def test_skipped_layers_keep_per_head_kv_and_the_rest_stay_exact(llama):
    # exact latents with layer 1 kept as per-head K/V: still transformers' tokens and logprobs
    llm = LLM(str(llama), **OPTIONS, enable_mla=True, mla_skip_layers=[1])
    batch = prompts(2, seed=3, low=10, high=40)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    check_against_reference(llama, batch, outs)
    assert llm.stats()["kv_bytes_per_token"] == llm.stats()["mha_kv_bytes_per_token"]


def test_reduced_rank_with_a_skipped_layer_decodes_as_it_prefills(llama):
    llm, batch, outs = generate(llama, mla_skip_layers=[0])
    layers = llm.engine.model_config.num_layers
    # layer 0 keeps 2 x (16 + 16) per-head K/V; the others rank 12 + 2 KV heads x 8 rotary features
    assert llm.stats()["kv_bytes_per_token"] == (2 * 32 + (layers - 1) * (12 + 2 * 8)) * 4
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    for ids, out in zip(batch, outs):
        full = ids + out.outputs[0].token_ids
        scored = llm.generate([{"prompt_token_ids": full}], params, use_tqdm=False)[0].prompt_logprobs
        for position, (token, step) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
            assert abs(scored[len(ids) + position][token].logprob - step[token].logprob) < 1e-3


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(enable_mla=True, mla_skip_layers=[7]), "no layer \\[7\\]"),
        (dict(mla_skip_layers=[0]), "empty unless enable_mla is set"),
        (dict(enable_mla=True, mla_skip_layers=[0], kv_cache_dtype="int8"), "8-bit caches hold latent rows"),
    ],
)
def test_skipped_layers_that_cannot_be_are_errors(llama, options, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(llama), **OPTIONS, **options)


def test_allocate_ranks_keeps_the_largest_relative_shares():
    flat = torch.tensor([1.0, 1.0, 1.0, 1.0])  # energy spread evenly: every direction matters
    steep = torch.tensor([100.0, 1.0, 0.0, 0.0])  # nearly all in one direction
    assert allocate_ranks([flat, steep], 4) == [3, 1]
    assert allocate_ranks([steep, flat], 5) == [1, 4]
    assert sum(allocate_ranks([flat, steep, flat], 6)) == 6
    with pytest.raises(ValueError, match="cannot be split"):
        allocate_ranks([flat, steep], 9)


def test_per_layer_ranks_and_the_error_allocation_set_each_layers_latent(llama):
    options = dict(**OPTIONS, enable_mla=True, qk_rope_head_dim=8)
    given = LLM(str(llama), **options, mla_latent_dim=[20, 4])  # the tiny Llama has 2 layers
    widths = [layer.self_attn.attn.latent_dim for layer in given.engine.executor.model.model.layers]
    assert widths == [20, 4]
    assert given.stats()["kv_bytes_per_token"] == (24 + 2 * 2 * 8) * 4
    spread = LLM(str(llama), **options, mla_latent_dim=12, mla_rank_allocation="error")
    widths = [layer.self_attn.attn.latent_dim for layer in spread.engine.executor.model.model.layers]
    assert sum(widths) == 24 and min(widths) >= 1  # the same cache as 12 per layer, split by measured error
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert (
        len(
            spread.generate([{"prompt_token_ids": [20, 21, 22]}], params, use_tqdm=False)[0]
            .outputs[0]
            .token_ids
        )
        == 8
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(mla_latent_dim=[8]), "1 per-layer ranks for 2 converted layers"),
        (dict(mla_latent_dim=[8], mla_skip_layers=[0]), None),
        (dict(mla_latent_dim=[8, 0]), "a positive int, or one per converted layer"),
        (dict(mla_rank_allocation="error"), "'uniform' unless mla_latent_dim gives the budget"),
        (dict(mla_latent_dim=8, mla_rank_allocation="best"), "'uniform' or 'error'"),
        (dict(mla_skip_layers=[0, 1]), "lists every layer"),
    ],
)
def test_per_layer_options_that_cannot_be_are_errors(llama, options, message):
    if message is None:  # one rank for the one converted layer when layer 0 is skipped: fine
        LLM(str(llama), **OPTIONS, enable_mla=True, **options)
        return
    with pytest.raises(ValueError, match=message):
        LLM(str(llama), **OPTIONS, enable_mla=True, **options)
