"""The engine's paged MLA decode: the dispatcher's plan for the call, launched by its kernel's table entry.

`mla_decode` takes no tuning: the shape, the step and the device choose the kernel and its parameters
(dispatch.py). Where the chosen kernel's tile cannot be built on the device, the call moves down the plan's ladder
to smaller tiles (kernels/fit.py). Benchmarks that name a kernel or set its knobs go through tuning.py.
"""

import torch

from mlaserve.kernels.fit import first_that_builds
from mlaserve.kernels.mla_decode import dispatch
from mlaserve.kernels.mla_decode.rules import DecodeCall, DecodeDevice, DecodePlan, DecodeShape, tma_rows


def describe_call(
    q: torch.Tensor, kv_cache: torch.Tensor, max_seq_len: int, kv_lora_rank: int, d_rope: int, window: int = 0
) -> tuple[DecodeShape, DecodeCall, DecodeDevice]:
    """The shape, step and device of a decode call over q ([B, H, ...]) and kv_cache, as dispatch.py reads them."""
    shape = DecodeShape(q.shape[1], kv_lora_rank, d_rope, kv_cache.dtype, q.dtype, kv_cache.shape[1])
    device = dispatch.decode_device(q.device)
    # only the fp8-dot kernel copies rows by TMA: the alignment is read for it alone
    aligned = not device.gluon or kv_cache.dtype != torch.float8_e4m3fn or tma_rows(kv_cache)
    return shape, DecodeCall(q.shape[0], max_seq_len, aligned, window), device


def decode_plans(
    q: torch.Tensor, kv_cache: torch.Tensor, max_seq_len: int, kv_lora_rank: int, d_rope: int, window: int = 0
) -> tuple[DecodePlan, ...]:
    """The plan the dispatcher picks for the call, then those that run it if that one cannot be built on the
    device (dispatch.default_ladder)."""
    return dispatch.default_ladder(*describe_call(q, kv_cache, max_seq_len, kv_lora_rank, d_rope, window))


def query_parts(
    q: torch.Tensor, q_pe: torch.Tensor | None, kv_lora_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(latent part, rope part) of the query, each with a contiguous last dimension, as the kernels read them."""
    if q_pe is None:
        q, q_pe = q[..., :kv_lora_rank], q[..., kv_lora_rank:]
    return q if q.stride(-1) == 1 else q.contiguous(), q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()


def launch(
    plan: DecodePlan,
    q: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `plan` by its kernel's entry over q [B, H, kv_lora_rank] and q_pe [B, H, rope] (query_parts)."""
    kernel = dispatch.KERNELS_BY_NAME[plan.kernel]
    return kernel.launch(plan, q, q_pe, kv_cache, block_table, seq_lens, kv_lora_rank, scale)


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    kv_lora_rank: int,
    scale: float,
    q_pe: torch.Tensor | None = None,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode over a paged latent cache, by the kernel dispatch.py picks for the call.

    q: [B, H, kv_lora_rank + rope], or [B, H, kv_lora_rank] with the rope part in q_pe [B, H, rope] (views of
    other tensors are fine, only the last dimension must be contiguous); kv_cache: [blocks, page, 1, kv_lora_rank +
    rope] (8-bit rows: then the 16-byte scale tail, kvcache/quant.py); block_table [B, max_blocks]; seq_lens [B];
    max_seq_len: the most rows a sequence of the call reads (sets the split count); window: each sequence reads
    only its last `window` rows (0: all), found through its table from its first row, so the table may name freed
    blocks before the window (a sliding-window group's). Returns (out [B, H, kv_lora_rank] in q's dtype, lse [B,
    H] float32, natural log)."""
    q, q_pe = query_parts(q, q_pe, kv_lora_rank)
    plans = decode_plans(q, kv_cache, max_seq_len, kv_lora_rank, q_pe.shape[-1], window)
    return first_that_builds(
        "mla_decode",
        plans,
        lambda plan: launch(plan, q, q_pe, kv_cache, block_table, seq_lens, kv_lora_rank, scale),
    )
