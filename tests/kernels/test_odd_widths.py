"""Every tiled Triton kernel at widths that are no multiple of its tiles (7 heads, a 40-wide latent, 16-wide rope,
hidden 224, expert width 80), against its torch reference, in each dtype the device runs. A twin test: in CI it runs
on the CPU interpreter at small sizes; on a GPU (TRITON_INTERPRET=0, `-m twin`) natively at full sizes. The tiles
were tuned for bf16; float32 doubles their shared memory, which an H200 once refused (kernels/fit.py)."""

import pytest
import torch
import torch.nn.functional as F

from mlaserve.testing.device import kernel_test_dtypes, on_gpu

GPU = on_gpu()
DTYPES = kernel_test_dtypes()
HEADS, LAT, ROPE, HIDDEN, INTER = 7, 40, 16, 224, 80


def tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 3e-2


def randn(*shape: int, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, device=gen.device) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_m", [None, 16, 32, 64, 128] if GPU else [None, 16, 64])
@pytest.mark.parametrize("tokens", [1, 40, 300] if GPU else [1, 40])
def test_fused_moe(device, dtype, block_m, tokens):
    from mlaserve.kernels.moe.dispatch import fused_experts
    from mlaserve.layers.moe import experts_reference

    gen = torch.Generator(device=device).manual_seed(tokens)
    experts, top_k = 8, 2
    x = randn(tokens, HIDDEN, dtype=dtype, gen=gen)
    w13 = randn(experts, 2 * INTER, HIDDEN, dtype=dtype, gen=gen, scale=0.1)
    w2 = randn(experts, HIDDEN, INTER, dtype=dtype, gen=gen, scale=0.1)
    ids = torch.stack([torch.randperm(experts, device=device, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, device=device, generator=gen)
    want = experts_reference(x.float(), w13.float(), w2.float(), weights, ids, F.silu)
    got = fused_experts(x, w13, w2, weights, ids, F.silu, block_m=block_m)
    tol = tolerance(dtype)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "dtype", [d for d in DTYPES if d != torch.float32]
)  # 16-bit kernels; float32 uses F.linear
@pytest.mark.parametrize("rows", [1, 7, 16])
@pytest.mark.parametrize("n", [80, 1900] if GPU else [80])
def test_skinny_linear_and_per_head(device, dtype, rows, n):
    from mlaserve.kernels.skinny import per_head, per_head_reference, skinny_linear

    gen = torch.Generator(device=device).manual_seed(rows * n)
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
def test_mla_decode(device, dtype, page):
    from mlaserve.attention.metadata import build_metadata
    from mlaserve.attention.torch_ref import TorchBackend
    from mlaserve.kernels.mla_decode.decode import mla_decode

    gen = torch.Generator(device=device).manual_seed(page)
    seq_lens = [1, 70, 333, 1000] if GPU else [1, 70, 133]
    blocks = [-(-n // page) for n in seq_lens]
    cache = randn(sum(blocks) + 1, page, 1, LAT + ROPE, dtype=dtype, gen=gen)
    order = (torch.randperm(sum(blocks), device=device, generator=gen) + 1).int()
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=device)
    for i, start in enumerate(torch.tensor([0, *blocks]).cumsum(0)[:-1].tolist()):
        table[i, : blocks[i]] = order[start : start + blocks[i]]
    q = randn(len(seq_lens), HEADS, LAT + ROPE, dtype=dtype, gen=gen)
    empty = torch.zeros(0, dtype=torch.long, device=device)
    meta = build_metadata(page, table, [1] * len(seq_lens), seq_lens, len(seq_lens), empty)
    want, want_lse = TorchBackend().decode(q.float(), cache.float(), None, meta, 0.15, LAT, need_lse=True)
    got, lse = mla_decode(q, cache, table, meta.seq_lens, max(seq_lens), LAT, 0.15)
    tol = tolerance(dtype)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want_lse, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_index_scores(device, dtype):
    from mlaserve.kernels.index_topk import index_scores_paged

    gen = torch.Generator(device=device).manual_seed(9)
    page, dim, heads, length = 16, 32, 5, 1001 if GPU else 201
    blocks = -(-length // page)
    cache = randn(blocks + 1, page, 1, dim, dtype=dtype, gen=gen)
    table = (torch.randperm(blocks, device=device, generator=gen) + 1).int().view(1, -1)
    visible = torch.tensor([3, length // 2, length], device=device)
    rows = torch.zeros(3, dtype=torch.long, device=device)
    q = randn(3, heads, dim, dtype=dtype, gen=gen)
    weights = torch.randn(3, heads, device=device, generator=gen)
    got = index_scores_paged(q, weights, cache, table, rows, visible, length, 0.3)
    keys = cache.float().view(-1, dim)
    pos = torch.arange(length, device=device)
    slots = table[0, pos // page].long() * page + pos % page
    want = (torch.relu(0.3 * q.float() @ keys[slots].T) * weights[:, :, None]).sum(1)
    want = torch.where(pos[None, :] < visible[:, None], want, float("-inf"))
    tol = tolerance(dtype)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_norm_act_and_prefill_kv(device, dtype):
    from mlaserve.kernels.act import silu_and_mul
    from mlaserve.kernels.norm import rms_norm
    from mlaserve.kernels.prefill_kv import prefill_kv, prefill_kv_reference
    from mlaserve.kernels.router import gate_logits
    from mlaserve.layers.norm import rms_norm_reference

    gen = torch.Generator(device=device).manual_seed(1)
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
