"""A random paged MLA decode case at DeepSeek's widths: the GPU suite times kernels on it and tests/gpu checks them
on it against the torch reference, so both read the same layout."""

import torch

from mlaserve.attention.metadata import build_metadata

# DeepSeek-V2/V3's latent row: kv_lora_rank + qk_rope_head_dim.
LAT, ROPE = 512, 64


def paged_case(
    batch: int, heads: int, lengths: list[int], page: int, dtype: torch.dtype, seed: int, device: str = "cuda"
):
    """(q, cache, block_table, metadata) for one decode step: `batch` sequences of `lengths` cached rows each, in
    pages of `page` rows placed in shuffled blocks (block 0 is never handed out), and one
    query token of `heads` heads per sequence."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per = [-(-n // page) for n in lengths]
    num_blocks = sum(blocks_per) + 1
    cache = torch.randn(num_blocks, page, 1, LAT + ROPE, generator=gen, device=device).to(dtype)
    perm = (torch.randperm(num_blocks - 1, generator=gen, device=device) + 1).to(torch.int32)
    table = torch.zeros(batch, max(blocks_per), dtype=torch.int32, device=device)
    used = 0
    for i, k in enumerate(blocks_per):
        table[i, :k] = perm[used : used + k]
        used += k
    q = torch.randn(batch, heads, LAT + ROPE, generator=gen, device=device).to(dtype)
    slots = torch.zeros(0, dtype=torch.long, device=device)
    meta = build_metadata(page, table, [1] * batch, lengths, batch, slots)
    return q, cache, table, meta
