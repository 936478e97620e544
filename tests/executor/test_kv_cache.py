"""The KV capacity the start-up report prints (`KVCache.capacity_tokens`, stats()'s `kv_capacity_tokens`, the
"= N tokens" of `describe()`) for a DeepSeek-V4-Flash-width model against a DeepSeek-V3-width MLA model of the same
layer count in the same KV memory (issue 49: at least 4 times the tokens).

Both models are built on the meta device from their config.json fields, through the engine's own config parser
and build_kv_cache, so nothing is allocated and all 43 layers take part. The budget is what the engine gives the
KV cache on a GPU (kv_budget_bytes: total x gpu_memory_utilization - what is in use) on one rank of 8 once
V4-Flash's own published weights (block-FP8 projections, MXFP4 routed experts split by width) are loaded, counted
from the same meta build. The V4 figure counts the tokens its compressed-entry pools hold; its window pool, which
every running request needs and which holds rows wide enough for the compressors' open windows, comes out of the
same budget first (group_blocks_for_budget), which is what keeps the figure below the bytes-per-token ratio."""

import pytest
import torch

from mlaserve.config.engine_config import CacheOptions
from mlaserve.config.model_config import hf_config_from_dict
from mlaserve.config.quantization import quant_config
from mlaserve.executor.kv_cache import KVCache, build_kv_cache
from mlaserve.models.base import ModelInit
from mlaserve.models.registry import get_model_class
from mlaserve.parallel import SINGLE, ParallelContext

LAYERS = 43
# DeepSeek-V4-Flash's config.json as published: two window-only layers, then 4:1 compressed-sparse and 128:1
# heavily compressed layers in turn; the last ratio is the MTP layer's, which the engine does not cache here. Its
# yarn rope_scaling also checks that the rotary tables of a model sized on the meta device are computed on the CPU.
FLASH = dict(
    model_type="deepseek_v4",
    architectures=["DeepseekV4ForCausalLM"],
    num_hidden_layers=LAYERS,
    hidden_size=4096,
    num_attention_heads=64,
    num_key_value_heads=1,
    head_dim=512,
    qk_rope_head_dim=64,
    q_lora_rank=1024,
    o_groups=8,
    o_lora_rank=1024,
    index_n_heads=64,
    index_head_dim=128,
    index_topk=512,
    sliding_window=128,
    compress_ratios=[0, 0] + [4 if i % 2 == 0 else 128 for i in range(2, LAYERS)] + [0],
    compress_rope_theta=160000,
    rope_scaling=dict(
        type="yarn", factor=16, original_max_position_embeddings=65536, beta_fast=32, beta_slow=1
    ),
    rope_theta=10000,
    num_hash_layers=3,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=6,
    moe_intermediate_size=2048,
    vocab_size=129280,
    max_position_embeddings=1048576,
    hc_mult=4,
    expert_dtype="fp4",
    quantization_config=dict(
        quant_method="fp8",
        fmt="e4m3",
        scale_fmt="ue8m0",
        activation_scheme="dynamic",
        weight_block_size=[128, 128],
    ),
)
# DeepSeek-V3's attention widths (a latent row of 512 + 64 per token per layer) at V4-Flash's layer count
V3 = dict(
    model_type="deepseek_v3",
    architectures=["DeepseekV3ForCausalLM"],
    num_hidden_layers=LAYERS,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    n_group=1,
    topk_group=1,
)
RANKS = 8  # the deployment whose per-rank KV budget the test takes
UTILIZATION = CacheOptions().gpu_memory_utilization
CARDS = {"h100-80GB": 80 * 10**9, "h200-141GB": 141 * 10**9}
MAX_MODEL_LEN = 65536


def meta_model(config_dict: dict, ctx: ParallelContext = SINGLE) -> torch.nn.Module:
    cfg = hf_config_from_dict(config_dict)
    cls = get_model_class(config_dict["architectures"][0])
    with torch.device("meta"):
        return cls(ModelInit(cfg, None, ctx, quant=quant_config(config_dict)))


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, torch.nn.Module, int]:
    """(V4-Flash, V3-width model, V4-Flash's weight bytes on one rank of RANKS)."""
    v4 = meta_model(FLASH, ParallelContext(0, RANKS))
    weights = sum(p.numel() * p.element_size() for p in v4.parameters())
    return v4, meta_model(V3), weights


def capacity(model: torch.nn.Module, budget: int, kv_cache_dtype: str) -> KVCache:
    options = CacheOptions(kv_cache_memory_bytes=budget, kv_cache_dtype=kv_cache_dtype)
    return build_kv_cache(options, model, torch.bfloat16, MAX_MODEL_LEN, 8192, torch.device("meta"), SINGLE)


def test_the_flash_config_has_the_published_layer_mix(models):
    v4, _, weights = models
    kinds = [layer.attn.compressor.rate if layer.attn.compressor else 0 for layer in v4.model.layers]
    assert kinds.count(0) == 2 and kinds.count(4) == 21 and kinds.count(128) == 20
    assert sum(layer.attn.indexer is not None for layer in v4.model.layers) == 21
    # the engine's own V4 weights on a rank (MXFP4 experts at half a byte per value): what the GPU budget leaves
    assert 15 * 2**30 < weights < 25 * 2**30


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("card", list(CARDS))
def test_v4_flash_holds_four_times_the_tokens_of_v3_widths(models, card: str, kv_cache_dtype: str):
    v4_model, v3_model, weights = models
    budget = int(CARDS[card] * UTILIZATION) - weights
    v4, v3 = capacity(v4_model, budget, kv_cache_dtype), capacity(v3_model, budget, kv_cache_dtype)
    for cache in (v4, v3):
        assert f"= {cache.capacity_tokens} tokens" in cache.describe(torch.bfloat16)
    ratio = v4.capacity_tokens / v3.capacity_tokens
    assert ratio >= 4, (card, kv_cache_dtype, ratio, v4.describe(torch.bfloat16), v3.describe(torch.bfloat16))
    # the V4 figure is the budget less the window pool, at the entries' bytes per token, to within the page of
    # its coarsest entry group (block_size x 128 tokens)
    window_pool = v4.manager.pools[0].num_blocks - 1
    window_bytes = window_pool * v4.block_size * v4.spec.group_slot_bytes(v4.dtype)[0]
    expected = (budget - window_bytes) / v4.spec.context_bytes_per_token(v4.dtype)
    assert expected - v4.block_size * 128 <= v4.capacity_tokens <= expected
