"""On a GPU (skipped in CI): DeepSeek-V3.2's Triton selection (index scores + top-k) and sparse attention against
the torch reference on fresh random inputs, and the engine on tiny V3.2 and sliding-window models: the triton_mla
backend (V3.2 decode from CUDA graphs) must give the torch backend's tokens in float32.

The GPU image's transformers has no DeepseekV32 classes, so the V3.2 model is a config.json with seeded dummy
weights (load_format="dummy"), the torch backend its reference; the CPU suite checks that backend against
transformers (tests/models/test_deepseek_v32_indexer.py).
"""

import json

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.attention.metadata import build_metadata
from mlaserve.attention.sparse import select_topk, sparse_latent_attention
from mlaserve.attention.triton_mla import TritonMLABackend
from mlaserve.kvcache.quant import quantize_rows
from mlaserve.testing.tiny_models import build_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

V32 = dict(
    architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", vocab_size=256, hidden_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48,
    qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24, intermediate_size=96, moe_intermediate_size=32,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=4,
    topk_group=2, routed_scaling_factor=2.5, index_topk=16, index_n_heads=16, index_head_dim=32,
    max_position_embeddings=1024, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    bos_token_id=2, eos_token_id=1,
)  # fmt: skip


def paged(batch: int, lengths: list[int], width: int, page: int, gen: torch.Generator):
    blocks = [-(-n // page) for n in lengths]
    cache = torch.randn(sum(blocks) + 1, page, 1, width, generator=gen, device="cuda")
    order = (torch.randperm(sum(blocks), generator=gen, device="cuda") + 1).to(torch.int32)
    table = torch.zeros(batch, max(blocks), dtype=torch.int32, device="cuda")
    used = 0
    for i, k in enumerate(blocks):
        table[i, :k] = order[used : used + k]
        used += k
    return cache, table


@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("heads, dim, topk, page", [(64, 128, 256, 64), (16, 64, 100, 16), (8, 32, 7, 1)])
def test_selection_kernel_matches_reference(heads, dim, topk, page, cache_dtype):
    gen = torch.Generator(device="cuda").manual_seed(heads + topk)
    query_lens, seq_lens = [1, 1, 1, 37, 5], [900, 17, 300, 37, 610]
    cache, table = paged(len(seq_lens), seq_lens, dim, page, gen)
    if cache_dtype is not None:
        cache = quantize_rows(cache, cache_dtype)
    slots = torch.zeros(sum(query_lens), dtype=torch.long, device="cuda")
    meta = build_metadata(page, table, query_lens, seq_lens, 3, slots)
    q = torch.randn(sum(query_lens), heads, dim, generator=gen, device="cuda")
    weights = torch.randn(sum(query_lens), heads, generator=gen, device="cuda")
    positions = torch.tensor(
        [p for q_, n in zip(query_lens, seq_lens) for p in range(n - q_, n)], device="cuda"
    )
    want = select_topk(q, weights, cache, meta, topk, dim**-0.5)
    got = TritonMLABackend().select_topk(q, weights, cache, meta, positions, topk, dim**-0.5)
    assert got.shape == want.shape
    for a, b in zip(got.tolist(), want.tolist()):  # float32 scores: the same sets but for exact ties
        assert len(set(a) & set(b)) >= len(set(b)) - 1  # (sets: a short context pads with repeated -1s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("heads, rank, rope", [(128, 512, 64), (16, 512, 64), (20, 96, 32)])
def test_sparse_attention_kernel_matches_reference(heads, rank, rope, dtype, cache_dtype):
    gen = torch.Generator(device="cuda").manual_seed(heads)
    cache, _ = paged(1, [4096], rank + rope, 64, gen)
    cache = cache.to(dtype) if cache_dtype is None else quantize_rows(cache, cache_dtype)
    tokens, k = 9, 300
    slots = torch.stack([torch.randperm(4096, generator=gen, device="cuda")[:k] + 64 for _ in range(tokens)])
    slots[2, 150:] = -1  # fewer candidates than k: -1 after the valid slots
    q_latent = torch.randn(tokens, heads, rank, generator=gen, device="cuda").to(dtype)
    q_pe = torch.randn(tokens, heads, rope, generator=gen, device="cuda").to(dtype)
    want = sparse_latent_attention(q_latent.float(), q_pe.float(), cache, slots, 0.05, rank)
    got = TritonMLABackend().sparse_latent(q_latent, q_pe, cache, slots, 0.05, rank)
    tol = 1e-4 if dtype == torch.float32 and cache_dtype is None else 5e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def generate_all(path, backend: str, eager: bool, graphs: bool | None = None, **options) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(3, 250, (n,), generator=gen).tolist()} for n in (5, 40, 120, 300)
    ]
    llm = LLM(str(path), dtype="float32", device="cuda", attention_backend=backend, enforce_eager=eager,
              num_kv_blocks=128, block_size=16, max_model_len=512, **options)  # fmt: skip
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False
    )
    assert llm.stats()["kv_blocks_used"] == 0
    if graphs is not None:  # decode steps replayed from CUDA graphs, or not (the model declares which)
        assert (llm.engine.runner.graphs is not None) == graphs
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_v32_engine_triton_equals_torch_backend(tmp_path, kv_cache_dtype):
    (tmp_path / "config.json").write_text(json.dumps(V32))
    opts = dict(load_format="dummy", skip_tokenizer_init=True, seed=3, kv_cache_dtype=kv_cache_dtype)
    # max_model_len 512 > index_topk 16: every captured decode step selects (the graph cannot pick dense)
    assert generate_all(tmp_path, "triton_mla", False, graphs=True, **opts) == generate_all(
        tmp_path, "torch", True, **opts
    )


@pytest.mark.parametrize("name, options", [
    ("mistral", dict(sliding_window=24)),
    ("qwen2", dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=24, max_window_layers=2)),
])  # fmt: skip
def test_windowed_engine_triton_equals_torch_backend(tmp_path, name, options):
    path = build_tiny(name, tmp_path, max_position_embeddings=1024, **options)
    # Per-head K/V caches decode through SDPA, which the engine does not capture: these run eagerly either way.
    assert generate_all(path, "triton_mla", False, graphs=False) == generate_all(path, "torch", True)
