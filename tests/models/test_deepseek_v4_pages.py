"""DeepSeek-V4's cache at its own size: each cache group has a pool of its own, and an entry group's pages hold only
its own layers' entries, so `kv_bytes_per_token` is what the layers store (each compressing layer's entry bytes over
its rate; the window's rows are a fixed number per request) and a long generation holds no more. Checked on tiny
configs unlike the one test_deepseek_v4.py uses: other mixes of sliding, compressed-sparse and heavily compressed
layers, other rates, widths and windows."""

import pytest

from mlaserve import LLM, SamplingParams
from mlaserve.testing.tiny_models import build_tiny
from tests.engine.test_sliding_window import check_against_reference, prompts

OPTIONS = dict(dtype="float32", device="cpu")
SLIDING, HEAVY, SPARSE = "sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention"


def v4_config(kinds: list[str], sparse: int, heavy: int, head_dim: int, index_dim: int, window: int) -> dict:
    return dict(
        num_hidden_layers=len(kinds),
        layer_types=kinds,
        mlp_layer_types=["hash_moe"] + ["moe"] * (len(kinds) - 1),
        compress_rates={SPARSE: sparse, HEAVY: heavy},
        head_dim=head_dim,
        index_head_dim=index_dim,
        sliding_window=window,
        max_position_embeddings=8192,
    )


CONFIGS = {
    # the mix: a window layer, two 4:1 compressed-sparse layers and a 16:1 heavily compressed one
    "issue": v4_config([SLIDING, SPARSE, SPARSE, HEAVY], 4, 16, 32, 16, 16),
    # heavily compressed first and twice, at 32:1, beside 2:1 compressed-sparse entries; a short window
    "heavy_first": v4_config([HEAVY, SLIDING, SPARSE, HEAVY, SLIDING], 2, 32, 16, 8, 8),
    # no window-only layer at all, wide heads, 8:1 compressed-sparse entries and 64:1 heavy ones
    "no_sliding": v4_config([SPARSE, HEAVY, SPARSE], 8, 64, 64, 32, 24),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request, tmp_path_factory):
    cfg = CONFIGS[request.param]
    return build_tiny("deepseek_v4", tmp_path_factory.mktemp(request.param), **cfg), cfg


def layers_need(cfg: dict) -> float:
    """Bytes per token the layers store in float32: each compressing layer's entry (kv, and its indexer key in a
    compressed-sparse layer) once per its rate's tokens."""
    need = 0.0
    for kind in cfg["layer_types"]:
        if kind != SLIDING:
            width = cfg["head_dim"] + (cfg["index_head_dim"] if kind == SPARSE else 0)
            need += width * 4 / cfg["compress_rates"][kind]
    return need


def test_kv_bytes_per_token_is_what_the_layers_store(model):
    path, cfg = model
    stats = LLM(str(path), **OPTIONS, num_kv_blocks=64, max_model_len=256).stats()
    assert stats["kv_bytes_per_token"] <= 1.25 * layers_need(cfg), stats["kv_cache_groups"]
    assert stats["kv_bytes_per_token"] == pytest.approx(layers_need(cfg), abs=0.01)


def test_tokens_and_logprobs_equal_transformers(model):
    path, _ = model
    llm = LLM(str(path), **OPTIONS, block_size=4, max_num_batched_tokens=24, enable_chunked_prefill=True)
    batch = prompts(3, seed=4, low=20, high=70)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    check_against_reference(path, batch, outs)
    assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.slow  # 4,096 decode steps of the torch reference attention: minutes a config on CPU
def test_a_4096_token_generation_holds_what_kv_bytes_per_token_says(model):
    path, cfg = model
    block_size, step = 16, 64
    llm = LLM(str(path), **OPTIONS, block_size=block_size, max_num_batched_tokens=step, max_model_len=4200)
    engine = llm.engine
    prompt = prompts(1, seed=6, low=60, high=61)[0]
    engine.add_request(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True)
    )
    cache = engine.executor.kv_cache
    rules, sizes = cache.group_rules, cache.spec.group_slot_bytes(cache.dtype)
    most = [0] * len(rules)
    while engine.has_unfinished_requests():
        engine.step(stream=False)
        most = [max(m, b) for m, b in zip(most, engine.stats()["kv_blocks_by_group"], strict=True)]
    tokens = len(prompt) + 4096
    entry_bytes = sum(most[g] * block_size * sizes[g] for g, rule in enumerate(rules) if rule.ratio)
    # Entry blocks: what kv_bytes_per_token says for the sequence, plus each group's last, partly filled block.
    slack = sum(block_size * sizes[g] for g, rule in enumerate(rules) if rule.ratio)
    assert entry_bytes <= llm.stats()["kv_bytes_per_token"] * tokens + slack, most
    window = rules[0].window
    assert most[0] <= -(-(window - 1 + step) // block_size) + 1, most  # the window's rows stay bounded
    assert llm.stats()["kv_blocks_used"] == 0
