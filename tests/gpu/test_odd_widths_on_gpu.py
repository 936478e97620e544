"""On a GPU: every tiled Triton kernel in float32, bf16 and fp16 at widths that are no multiple of its tiles (7 heads,
a 40-wide latent, 16-wide rope, hidden 224, expert width 80), against its torch reference; then float32
DeepSeek-V2, V3 and V3.2 engines of those widths with CUDA graphs on, captured up to the default max_num_seqs (so
the MoE's 64- and 128-row tiles are built), against the torch backend run eagerly. The kernels' tiles were tuned for
bf16; float32 doubles their shared memory, which an H200 once refused (kernels/fit.py)."""

import pytest
import torch
import torch.nn.functional as F

from mlaserve import LLM, SamplingParams
from mlaserve.testing.tiny_models import build_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HEADS, LAT, ROPE, HIDDEN, INTER = 7, 40, 16, 224, 80


def tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 3e-2


def randn(*shape: int, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_m", [None, 16, 32, 64, 128])
@pytest.mark.parametrize("tokens", [1, 40, 300])
def test_fused_moe(dtype, block_m, tokens):
    from mlaserve.kernels.moe.dispatch import fused_experts
    from mlaserve.layers.moe import experts_reference

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    experts, top_k = 8, 2
    x = randn(tokens, HIDDEN, dtype=dtype, gen=gen)
    w13 = randn(experts, 2 * INTER, HIDDEN, dtype=dtype, gen=gen, scale=0.1)
    w2 = randn(experts, HIDDEN, INTER, dtype=dtype, gen=gen, scale=0.1)
    ids = torch.stack([torch.randperm(experts, device="cuda", generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, device="cuda", generator=gen)
    want = experts_reference(x.float(), w13.float(), w2.float(), weights, ids, F.silu)
    got = fused_experts(x, w13, w2, weights, ids, F.silu, block_m=block_m)
    tol = tolerance(dtype)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 16])
@pytest.mark.parametrize("n", [80, 1900])
def test_skinny_linear_and_per_head(dtype, rows, n):
    from mlaserve.kernels.skinny import per_head, per_head_reference, skinny_linear

    gen = torch.Generator(device="cuda").manual_seed(rows * n)
    x = randn(rows, HIDDEN, dtype=dtype, gen=gen)
    w = randn(n, HIDDEN, dtype=dtype, gen=gen, scale=HIDDEN**-0.5)
    tol = tolerance(dtype)
    want = F.linear(x.float(), w.float())
    torch.testing.assert_close(skinny_linear(x, w).float(), want, atol=tol, rtol=tol)
    if rows <= 4:  # per_head's GEMV rows
        xh = randn(rows, HEADS, LAT, dtype=dtype, gen=gen)
        wh = randn(HEADS, 24, LAT, dtype=dtype, gen=gen, scale=LAT**-0.5)
        want_h = per_head_reference(xh.float(), wh.float())
        torch.testing.assert_close(per_head(xh, wh).float(), want_h, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page", [16, 64])
def test_mla_decode(dtype, page):
    from mlaserve.attention.metadata import build_metadata
    from mlaserve.attention.torch_ref import TorchBackend
    from mlaserve.kernels.mla_decode.decode import mla_decode

    gen = torch.Generator(device="cuda").manual_seed(page)
    seq_lens = [1, 70, 333, 1000]
    blocks = [-(-n // page) for n in seq_lens]
    cache = randn(sum(blocks) + 1, page, 1, LAT + ROPE, dtype=dtype, gen=gen)
    order = (torch.randperm(sum(blocks), device="cuda", generator=gen) + 1).int()
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device="cuda")
    for i, start in enumerate(torch.tensor([0, *blocks]).cumsum(0)[:-1].tolist()):
        table[i, : blocks[i]] = order[start : start + blocks[i]]
    q = randn(len(seq_lens), HEADS, LAT + ROPE, dtype=dtype, gen=gen)
    empty = torch.zeros(0, dtype=torch.long, device="cuda")
    meta = build_metadata(page, table, [1] * len(seq_lens), seq_lens, len(seq_lens), empty)
    want, want_lse = TorchBackend().decode(q.float(), cache.float(), None, meta, 0.15, LAT, need_lse=True)
    got, lse = mla_decode(q, cache, table, meta.seq_lens, max(seq_lens), LAT, 0.15)
    tol = tolerance(dtype)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want_lse, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_index_scores(dtype):
    from mlaserve.kernels.index_topk import index_scores_paged

    gen = torch.Generator(device="cuda").manual_seed(9)
    page, dim, heads, length = 16, 32, 5, 1001
    blocks = -(-length // page)
    cache = randn(blocks + 1, page, 1, dim, dtype=dtype, gen=gen)
    table = (torch.randperm(blocks, device="cuda", generator=gen) + 1).int().view(1, -1)
    visible = torch.tensor([3, 500, length], device="cuda")
    rows = torch.zeros(3, dtype=torch.long, device="cuda")
    q = randn(3, heads, dim, dtype=dtype, gen=gen)
    weights = torch.randn(3, heads, device="cuda", generator=gen)
    got = index_scores_paged(q, weights, cache, table, rows, visible, length, 0.3)
    keys = cache.float().view(-1, dim)
    pos = torch.arange(length, device="cuda")
    slots = table[0, pos // page].long() * page + pos % page
    want = (torch.relu(0.3 * q.float() @ keys[slots].T) * weights[:, :, None]).sum(1)
    want = torch.where(pos[None, :] < visible[:, None], want, float("-inf"))
    tol = tolerance(dtype)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_norm_act_and_prefill_kv(dtype):
    from mlaserve.kernels.act import silu_and_mul
    from mlaserve.kernels.norm import rms_norm
    from mlaserve.kernels.prefill_kv import prefill_kv, prefill_kv_reference
    from mlaserve.kernels.router import gate_logits
    from mlaserve.layers.norm import rms_norm_reference

    gen = torch.Generator(device="cuda").manual_seed(1)
    tol = tolerance(dtype)
    x = randn(13, HIDDEN, dtype=dtype, gen=gen)
    gate = randn(7, HIDDEN, dtype=dtype, gen=gen, scale=0.1)
    torch.testing.assert_close(gate_logits(x, gate), F.linear(x.float(), gate.float()), atol=tol, rtol=tol)
    weight = randn(HIDDEN, dtype=dtype, gen=gen)
    normed, _ = rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(
        normed.float(), rms_norm_reference(x, weight, 1e-6).float(), atol=tol, rtol=tol
    )
    gate_up = randn(13, 2 * INTER, dtype=dtype, gen=gen)
    gate, up = gate_up.float().chunk(2, dim=-1)
    want = F.silu(gate) * up
    torch.testing.assert_close(silu_and_mul(gate_up).float(), want, atol=tol, rtol=tol)
    kv, k_pe = randn(9, HEADS, 24 + 20, dtype=dtype, gen=gen), randn(9, ROPE, dtype=dtype, gen=gen)
    for got_t, want_t in zip(prefill_kv(kv, k_pe, 24), prefill_kv_reference(kv, k_pe, 24)):
        assert torch.equal(got_t, want_t)


ODD = dict(
    hidden_size=HIDDEN,
    num_attention_heads=HEADS,
    num_key_value_heads=HEADS,
    kv_lora_rank=LAT,
    qk_rope_head_dim=ROPE,
    qk_nope_head_dim=24,
    v_head_dim=20,
    intermediate_size=180,
    moe_intermediate_size=INTER,
)


def greedy_runs(path) -> dict[str, list]:
    gen = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(3, 250, (n,), generator=gen).tolist()} for n in (1, 9, 77, 300)
    ]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
    runs = {}
    for label, backend, eager in (("ref", "torch", True), ("graphs", "triton_mla", False)):
        llm = LLM(str(path), dtype="float32", device="cuda", attention_backend=backend, enforce_eager=eager,
                  num_kv_blocks=1024, block_size=16, max_model_len=512)  # fmt: skip
        if not eager:  # captured up to the default max_num_seqs: 256 rows, 64-row MoE tiles
            assert llm.engine.runner.graphs is not None and max(llm.engine.runner.graphs.sizes) == 256
        runs[label] = llm.generate(prompts, params, use_tqdm=False)
        assert llm.stats()["kv_blocks_used"] == 0
        del llm
    return runs


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3", "deepseek_v32"])
def test_float32_engine_at_odd_widths_equals_the_torch_backend(tmp_path, name):
    runs = greedy_runs(build_tiny(name, tmp_path, **ODD))
    for ref, got in zip(runs["ref"], runs["graphs"]):
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        for want, have, tok in zip(
            ref.outputs[0].logprobs, got.outputs[0].logprobs, ref.outputs[0].token_ids
        ):
            assert abs(want[tok] - have[tok]) < 1e-3
