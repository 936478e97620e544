"""The query split into two e4m3 terms (kernels/mla_decode/fp8_query.py), under the Triton interpreter on CPU: the
terms rebuild the query to about bf16's precision, head by head, whatever the heads' magnitudes."""

import pytest
import torch

from mlaserve.kernels.mla_decode.fp8_query import split_queries


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_two_terms_rebuild_the_query(dtype):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 5, 64, generator=gen)
    q_pe = torch.randn(3, 5, 16, generator=gen)
    q[:, 1] *= 1e-3  # heads of very different sizes, each with its own scales
    q_pe[:, 2] *= 300.0
    q[0, 3], q_pe[0, 3] = 0.0, 0.0  # an all-zero head
    q[1, 4, :8] = torch.tensor([1e-6, -2e-5, 3.0, -3.0, 7e-3, 0.5, -0.25, 1e-9])  # values far under max|q|
    q, q_pe = q.to(dtype), q_pe.to(dtype)
    terms, scales = split_queries(q, q_pe)
    assert terms.shape == (3, 5, 2, 80) and terms.dtype == torch.float8_e4m3fn
    assert scales.shape == (3, 5, 2)
    want = torch.cat((q, q_pe), -1).float()
    a, b = scales[..., :1], scales[..., 1:]
    rebuilt = terms[:, :, 0].float() * a + terms[:, :, 1].float() * b
    # hi's rounding leaves at most 2^-4 of each value (or half its subnormal step), lo's the same of that residual
    bound = 2**-8 * want.abs() + 2**-13 * a + 2**-9 * b
    assert ((rebuilt - want).abs() <= bound).all()
    # one e4m3 term alone would be 2^-4 off: the second term is what brings the query to bf16's precision
    assert (rebuilt - want).abs().max() < (terms[:, :, 0].float() * a - want).abs().max() / 8
    assert torch.equal(terms[0, 3].float(), torch.zeros(2, 80)) and torch.equal(scales[0, 3], torch.ones(2))
    amax = want.abs().amax(-1)
    torch.testing.assert_close(scales[..., 0], torch.where(amax > 0, amax / 448, torch.ones_like(amax)))
