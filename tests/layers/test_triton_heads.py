"""The per-head grouped GEMM of absorbed MLA decode against einsum, under TRITON_INTERPRET=1 on CPU (fp16: the
interpreter's bf16 dots are broken; bf16 runs in tests/gpu through the engine)."""

import pytest
import torch

pytest.importorskip("triton")

from mlaserve.layers.triton_heads import per_head_matmul  # noqa: E402


@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_matches_einsum_for_both_absorbed_products(tokens: int) -> None:
    heads, nope, rope, rank, v = 4, 32, 16, 64, 24
    gen = torch.Generator().manual_seed(tokens)
    q = torch.randn(tokens, heads, nope + rope, generator=gen).half()
    w = (torch.randn(heads, nope + v, rank, generator=gen) / rank**0.5).half()
    w_uk, w_uv = w[:, :nope].contiguous(), w[:, nope:].contiguous()
    head_ids = (torch.arange(16 * heads) % heads).int()

    q_nope = q[..., :nope]  # a strided view, as MLA passes it
    got = per_head_matmul(q_nope, w_uk.transpose(1, 2), head_ids)
    want = torch.einsum("thd,hdr->thr", q_nope.float(), w_uk.float())
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)

    latent = torch.randn(tokens, heads, rank, generator=gen).half()
    got = per_head_matmul(latent, w_uv, head_ids)
    want = torch.einsum("thr,hvr->thv", latent.float(), w_uv.float())
    assert got.shape == (tokens, heads, v)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_rejects_mismatched_heads() -> None:
    with pytest.raises(ValueError, match="per_head_matmul"):
        per_head_matmul(torch.zeros(2, 3, 8).half(), torch.zeros(4, 5, 8).half(), torch.zeros(64).int())
