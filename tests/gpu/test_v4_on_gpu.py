"""On a GPU (skipped in CI): DeepSeek-V4's torch reference runs on CUDA and gives the CPU's tokens in float32, with
its decode steps captured in CUDA graphs (three cache groups: the rows' window, entries 4:1 and 8:1) and eagerly.

The config is written out field by field, as transformers' save_pretrained writes it, so the GPU image's
transformers (which may have no DeepseekV4Config) reads it through the engine's spelled-out fallback. The CPU suite
checks the model itself against transformers (tests/models/test_deepseek_v4.py), also through a captured step's
inputs. On CUDA the default backend (triton_mla) runs its decode attention on the paged Triton kernels
(attention/v4_decode.py); the torch backend keeps the torch decode. Random weights drawn on the CPU and saved, so
both devices run the same model.
"""

import json

import pytest
import torch
from safetensors.torch import save_file

from mlaserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

V4 = dict(
    architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", vocab_size=256, hidden_size=64,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.5,
    qk_rope_head_dim=16, q_lora_rank=48, sliding_window=16, o_groups=2, o_lora_rank=24,
    layer_types=["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention"],
    mlp_layer_types=["hash_moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    compress_rope_theta=160000.0, rope_theta=10000.0,
    rope_parameters={"main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                     "compress": {"rope_type": "default", "rope_theta": 160000.0, "partial_rotary_factor": 0.5}},
    index_topk=4, index_n_heads=16, index_head_dim=32, hc_mult=2, hc_sinkhorn_iters=5, hc_eps=1e-6,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
    scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, swiglu_limit=10.0, norm_topk_prob=True,
    rms_norm_eps=1e-6, max_position_embeddings=512, bos_token_id=2, eos_token_id=1, tie_word_embeddings=False,
)  # fmt: skip


def generate(llm: LLM) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (5, 40, 120)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.stats()["kv_blocks_used"] == 0
    return [o.outputs[0].token_ids for o in outs]


def test_v4_on_cuda_gives_the_cpu_tokens(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(V4))
    options = dict(
        dtype="float32", skip_tokenizer_init=True, num_kv_blocks=96, block_size=16, max_model_len=256
    )
    cpu = LLM(str(tmp_path), device="cpu", load_format="dummy", seed=3, **options)
    # the CPU model's random weights, saved under the model's own names, are what the GPU run loads
    weights = {name: t.contiguous() for name, t in cpu.engine.executor.model.state_dict().items()}
    save_file(weights, str(tmp_path / "model.safetensors"))
    want = generate(cpu)
    graphs = LLM(str(tmp_path), device="cuda", **options)
    assert graphs.engine.runner.graphs is not None  # captured
    assert all(layer.attn.on_kernels for layer in graphs.engine.executor.model.model.layers)
    assert generate(graphs) == want
    del graphs
    assert generate(LLM(str(tmp_path), device="cuda", enforce_eager=True, **options)) == want
    torch_decode = LLM(str(tmp_path), device="cuda", attention_backend="torch", **options)
    assert not any(layer.attn.on_kernels for layer in torch_decode.engine.executor.model.model.layers)
    assert generate(torch_decode) == want


def test_v4_on_an_fp8_cache_reads_it_alike_on_the_kernels_and_in_torch(tmp_path):
    # The same 8-bit rows (kvcache/segments.py) read by the kernels from captured decode steps and eager prefills,
    # and dequantized by the torch backend: tokens equal, blocks returned.
    (tmp_path / "config.json").write_text(json.dumps(V4))
    options = dict(
        dtype="float32", skip_tokenizer_init=True, num_kv_blocks=96, block_size=16, max_model_len=256,
        kv_cache_dtype="fp8_e4m3", load_format="dummy", seed=3, device="cuda",
    )  # fmt: skip
    kernels = LLM(str(tmp_path), **options)
    assert kernels.engine.runner.graphs is not None
    assert kernels.stats()["kv_cache_dtype"] == "float8_e4m3fn"
    got = generate(kernels)
    del kernels
    assert generate(LLM(str(tmp_path), attention_backend="torch", **options)) == got
