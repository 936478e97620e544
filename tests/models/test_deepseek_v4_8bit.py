"""DeepSeek-V4 on 8-bit caches (kv_cache_dtype fp8_e4m3 / int8): the window's rows and the compressed entries (kv
and indexer keys) stored as 8-bit parts with a scale each (kvcache/segments.py). On the tiny V4 model (a window of
16, entries 8:1 and 4:1 with an indexer) greedy tokens follow the float32 cache's engine until a near-tie, with
logprobs within BOUND of it until then; the cache grows by the 8-bit entries' bytes per token; blocks go back to the
pools; and decode on the Triton kernels reads the same 8-bit rows as the torch path does.

The tiny random model is a harsh judge: its next-token distributions are flat (the top two often within a
hundredth) and its logits move a lot for a small change in attention, so its bound is loose; the kv parts carry
nearly all of the error (the compressor's and indexer's projections in 8 bits move the logprobs far less). A
near-tie is where the float engine's margin between its token and the 8-bit engine's is below twice the bound,
the most two logprobs each within the bound can swap by."""

import json

import pytest

from mlaserve import LLM, SamplingParams
from mlaserve.testing.tiny_models import build_tiny
from tests.engine.test_sliding_window import prompts
from tests.models.test_deepseek_v4 import OPTIONS

BOUND = {
    "fp8_e4m3": 0.5,
    "int8": 0.4,
}  # e4m3 keeps 3 bits of mantissa, int8 about 7 at a row's largest values


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    return build_tiny("deepseek_v4", tmp_path_factory.mktemp("v4"))


BATCH = prompts(4, seed=3, low=10, high=60)  # past the window and past top-k x rate


def generate(llm: LLM, tokens: int = 24, logprobs: int = 0):
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=logprobs)
    return llm.generate([{"prompt_token_ids": p} for p in BATCH], params, use_tqdm=False)


@pytest.fixture(scope="module")
def float_outputs(v4):
    return generate(LLM(str(v4), **OPTIONS, num_kv_blocks=256), logprobs=5)


def follows(got, want, bound: float) -> int:
    """Checks the 8-bit engine's greedy tokens against the float engine's (its top-5 logprobs): equal, logprobs within
    bound, until a near-tie. Returns how many tokens were equal."""
    got_ids, want_ids = got.outputs[0].token_ids, want.outputs[0].token_ids
    for j, (g, w) in enumerate(zip(got_ids, want_ids, strict=True)):
        ref = want.outputs[0].logprobs[j]
        if g != w:
            assert g in ref, f"token {j}: {g} is not among the float engine's top 5 ({ref})"
            gap = ref[w].logprob - ref[g].logprob
            assert gap < 2 * bound, f"token {j}: diverged where the float engine's margin was {gap:.3f}"
            return j
        assert abs(got.outputs[0].logprobs[j][g].logprob - ref[w].logprob) < bound, j
    return len(got_ids)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "int8"])
def test_8bit_caches_follow_the_float_cache(v4, float_outputs, kv):
    llm = LLM(str(v4), **OPTIONS, num_kv_blocks=256, kv_cache_dtype=kv)
    outs = generate(llm)
    for g, w in zip(outs, float_outputs, strict=True):
        follows(g, w, BOUND[kv])
    assert llm.stats()["kv_blocks_used"] == 0
    assert llm.stats()["kv_cache_dtype"] == {"fp8_e4m3": "float8_e4m3fn", "int8": "int8"}[kv]


def test_8bit_entries_are_what_the_cache_grows_by(v4):
    cfg = json.loads((v4 / "config.json").read_text())
    d, i = cfg["head_dim"], cfg["index_head_dim"]
    full = LLM(str(v4), **OPTIONS, num_kv_blocks=16, max_model_len=128).stats()
    small = LLM(str(v4), **OPTIONS, num_kv_blocks=16, max_model_len=128, kv_cache_dtype="fp8_e4m3").stats()
    # A byte a value and a 16-byte scale tail a part: the 4:1 entry's kv and indexer key, the 8:1 entry's kv.
    sparse, heavy = d + 16 + i + 16, d + 16
    assert small["kv_bytes_per_token"] == sparse / 4 + heavy / 8
    assert full["kv_bytes_per_token"] == (d + i) * 4 / 4 + d * 4 / 8
    assert small["kv_cache_groups"][1:] == [f"pooled 1:4 of group 0: {sparse} bytes/entry",
                                            f"pooled 1:8 of group 0: {heavy} bytes/entry"]  # fmt: skip


@pytest.mark.slow  # the interpreter: about a minute on CPU
def test_decode_on_the_kernels_reads_the_8bit_cache_as_torch_does(v4):
    pytest.importorskip("triton")
    options = dict(**OPTIONS, block_size=4, num_kv_blocks=256, max_model_len=128, kv_cache_dtype="fp8_e4m3")
    want = generate(LLM(str(v4), **options), tokens=12, logprobs=0)
    llm = LLM(str(v4), **options, attention_backend="triton_mla")
    got = generate(llm, tokens=12, logprobs=0)
    assert all(layer.attn.on_kernels for layer in llm.engine.executor.model.model.layers)
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for gl, wl in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True):
            assert {t: round(p.logprob, 3) for t, p in gl.items()} == {
                t: round(p.logprob, 3) for t, p in wl.items()
            }
    assert llm.stats()["kv_blocks_used"] == 0
