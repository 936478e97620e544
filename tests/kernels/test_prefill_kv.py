"""The expanded prefill's K/V assembly kernel against its torch reference, under TRITON_INTERPRET=1 on CPU."""

import pytest
import torch

pytest.importorskip("triton")

from mlaserve.kernels.prefill_kv import prefill_kv, prefill_kv_reference  # noqa: E402


@pytest.mark.parametrize(
    "rows, heads, nope, rope, v_dim, dtype",
    [
        (37, 3, 128, 64, 128, torch.bfloat16),  # DeepSeek's widths, a block that ends mid-way
        (5, 16, 16, 8, 16, torch.float16),
        (9, 2, 24, 8, 32, torch.float32),  # widths that are not powers of two; v as wide as the key
        (0, 4, 16, 8, 16, torch.float32),  # an empty chunk
    ],
)
@pytest.mark.parametrize("pad_values", [True, False])
def test_matches_the_concatenation_and_padding(rows, heads, nope, rope, v_dim, dtype, pad_values):
    gen = torch.Generator().manual_seed(rows + heads)
    # kv as kv_b_proj leaves it: a view of one [rows, heads * (nope + v)] GEMM output; k_pe a column slice
    kv = torch.randn(rows, heads * (nope + v_dim), generator=gen).to(dtype).view(rows, heads, nope + v_dim)
    k_pe = torch.randn(rows, 512 + rope, generator=gen).to(dtype)[:, 512:]
    k, v = prefill_kv(kv, k_pe, nope, pad_values)
    want_k, want_v = prefill_kv_reference(kv, k_pe, nope, pad_values)
    assert v.shape[-1] == (nope + rope if pad_values else v_dim)
    assert k.is_contiguous() and v.is_contiguous()
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_refuses_values_wider_than_the_keys():
    kv = torch.zeros(2, 1, 16 + 40)
    with pytest.raises(ValueError, match="v_dim <= nope"):
        prefill_kv(kv, torch.zeros(2, 8), 16)


def test_values_wider_than_the_keys_unpadded():
    gen = torch.Generator().manual_seed(3)
    kv, k_pe = torch.randn(3, 2, 16 + 40, generator=gen), torch.randn(3, 8, generator=gen)
    k, v = prefill_kv(kv, k_pe, 16, pad_values=False)
    want_k, want_v = prefill_kv_reference(kv, k_pe, 16, pad_values=False)
    assert v.shape == (3, 2, 40) and torch.equal(k, want_k) and torch.equal(v, want_v)
