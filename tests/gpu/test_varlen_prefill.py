"""On a GPU (skipped in CI): the SDPA backend's one-call varlen flash prefill against the torch reference, with
chunked prefills (fewer queries than context, bottom-right causal), MLA's unequal K/V head sizes and GQA."""

import pytest
import torch

from mlaserve.attention.metadata import build_metadata
from mlaserve.attention.sdpa import SdpaBackend, can_use_varlen
from mlaserve.attention.torch_ref import TorchBackend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("heads, kv_heads, dk, dv", [(16, 16, 192, 128), (8, 2, 64, 64)])
def test_varlen_prefill_matches_reference(heads, kv_heads, dk, dv):
    gen = torch.Generator(device="cuda").manual_seed(heads + dk)
    query_lens, seq_lens = [1, 7, 37, 200, 64], [1, 7, 100, 200, 300]  # the last three are later chunks
    table = torch.arange(100, dtype=torch.int32, device="cuda").view(5, 20)  # 20 blocks of 16 hold 300
    meta = build_metadata(16, table, query_lens, seq_lens, 0, torch.zeros(1, dtype=torch.long, device="cuda"))
    q = torch.randn(sum(query_lens), heads, dk, device="cuda", generator=gen, dtype=torch.bfloat16)
    k = torch.randn(sum(seq_lens), kv_heads, dk, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn(sum(seq_lens), kv_heads, dv, device="cuda", generator=gen, dtype=torch.bfloat16)
    assert can_use_varlen(q)
    got = SdpaBackend().prefill(q, k, v, meta, 0.1)
    want = TorchBackend().prefill(q, k, v, meta, 0.1)
    assert got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
