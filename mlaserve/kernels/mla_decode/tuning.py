"""The decode kernels' tuning knobs, for benchmarks only: the engine's call (decode.mla_decode) takes none.

`mla_decode_tuned` names a kernel of the table (dispatch.DECODE_KERNELS: "gluon_fp8", "gluon_wgmma8",
"gluon_seesaw", "gluon_wgmma", "triton", "torch reference"; None: the dispatcher's) and sets the knobs it lists in
`tunables` (ValueError for others, and for a kernel that cannot run the call):

- all but the torch reference: num_splits (the grid's context slices), partial_dtype (how the per-split partial
  outputs are stored for the merge).
- "triton": block_h (heads per program), block_n (rows per tile), num_warps, num_stages; prefetch (load the next
  tile into registers before working on this one; default on for 8-bit caches, whose tiles are converted in
  registers, where Triton's pipeliner cannot stream them); page_ahead (look the next tile's page up while working
  on this one, so the pipeliner gives the tile two shared-memory buffers; default on at 16 heads per program with
  16-bit caches); q_f16 (8-bit caches: fp16 dots instead of bf16, a cheaper widening; default on at 16 heads per
  program with a 16-bit q); widen_bits (8-bit caches with fp16 dots: widen by integer operations instead of
  conversion instructions, exact for every byte); balanced and min_span_rows (spans.py).
- "gluon_seesaw": block_n (rows per tile: 32, four ring slots, the default; or 64, two slots); tma (copy whole
  tiles by TMA instead of cp.async; pages a multiple of block_n); prefetch (consumer 0 issues the next pair's
  score dots behind its last value dot: its softmax then overlaps consumer 1's score dots, for some spilled
  registers). The table takes it only once rules.SEESAW_BY_DEFAULT is set; until then only a benchmark or test
  that names it runs it.
- "gluon_fp8": pdl (launch the split step and the merge with programmatic dependent launch, each behind the
  kernel before it; default on). Its query goes in as two e4m3 terms, about bf16's precision; what remains is the
  fp8 tensor cores' accumulation, within the error the cache's own fp8 rounding brings.
"""

from collections.abc import Mapping

import torch

from mlaserve.kernels.fit import first_that_builds
from mlaserve.kernels.mla_decode import decode, dispatch
from mlaserve.kernels.mla_decode.rules import DecodeCall, DecodeDevice, DecodePlan, DecodeShape


def tuned_plan(
    shape: DecodeShape, call: DecodeCall, device: DecodeDevice, kernel: str | None = None, **tuning: object
) -> DecodePlan:
    """The launch of one call: the dispatcher's kernel, or the one named (where it can run: ValueError otherwise,
    pays rules aside), with `tuning` (knobs the kernel lists in `tunables`) over its defaults."""
    if kernel is None:
        chosen = dispatch.choose_kernel(shape, call, device)
    elif kernel not in dispatch.KERNELS_BY_NAME:
        raise ValueError(f"unknown decode kernel {kernel!r}; choose one of {list(dispatch.KERNELS_BY_NAME)}")
    else:
        chosen = dispatch.KERNELS_BY_NAME[kernel]
        why = dispatch.refusal(chosen, shape, call, device)
        if why is not None:
            raise ValueError(
                f"decode kernel {kernel!r} cannot run {dispatch.describe_shape(shape, device)}: it {why}"
            )
    extra = set(tuning) - chosen.tunables
    if extra:
        raise ValueError(f"decode kernel {chosen.name!r} takes no {', '.join(sorted(extra))}; its tuning knobs: "
                         f"{', '.join(sorted(chosen.tunables)) or 'none'}")  # fmt: skip
    return dispatch.plan_for(chosen, shape, call, device, tuning)


def tuned_plans(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    max_seq_len: int,
    kv_lora_rank: int,
    d_rope: int,
    kernel: str | None,
    tuning: Mapping[str, object],
) -> tuple[DecodePlan, ...]:
    """The engine's ladder (decode.decode_plans) where nothing is named; the named or tuned plan alone otherwise."""
    described = decode.describe_call(q, kv_cache, max_seq_len, kv_lora_rank, d_rope)
    if kernel is None and not tuning:
        return dispatch.default_ladder(*described)
    return (tuned_plan(*described, kernel, **tuning),)


def decode_plan(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    max_seq_len: int,
    kv_lora_rank: int,
    d_rope: int,
    kernel: str | None = None,
    **tuning: object,
) -> DecodePlan:
    """What a decode call over q ([B, H, ...]) and kv_cache would launch: the dispatcher's kernel, or `kernel`
    with `tuning` over its defaults."""
    return tuned_plans(q, kv_cache, max_seq_len, kv_lora_rank, d_rope, kernel, tuning)[0]


def mla_decode_tuned(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    kv_lora_rank: int,
    scale: float,
    q_pe: torch.Tensor | None = None,
    kernel: str | None = None,
    **tuning: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """decode.mla_decode with a named kernel and knobs (this module's docstring)."""
    q, q_pe = decode.query_parts(q, q_pe, kv_lora_rank)
    plans = tuned_plans(q, kv_cache, max_seq_len, kv_lora_rank, q_pe.shape[-1], kernel, tuning)
    return first_that_builds(
        "mla_decode",
        plans,
        lambda plan: decode.launch(plan, q, q_pe, kv_cache, block_table, seq_lens, kv_lora_rank, scale),
    )
