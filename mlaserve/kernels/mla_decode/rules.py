"""What a paged MLA decode call is (its shape, its step, its device) and the measured rules that launch it: split
counts, when each kernel pays, and each kernel's parameters (`DecodePlan`). Plain Python, no Triton: the table in
dispatch.py reads these, and the backend can name its kernel before anything is compiled.

Each rule was measured on Hopper GPUs; benchmarks/gpu_suite.py re-measures them through
tuning.mla_decode_tuned, and tests/kernels/snapshots/decode_plans.txt shows the plans they give DeepSeek's shapes.
"""

import dataclasses
import math
from collections.abc import Mapping

import torch

from mlaserve.kernels.fit import DEFAULT_SHARED_BYTES
from mlaserve.kvcache.quant import TAIL_BYTES, is_quantized

FP8 = torch.float8_e4m3fn
# Shared memory the Triton kernel's default tiles may take, as _shared_bytes estimates it: that of the largest
# default that builds on sm_90 (64 heads x 64 rows of 16-bit 576-wide rows, two tile buffers). The estimate matches
# what the compiler reports, also for wider rows that did not build.
SHARED_BUDGET = 221_184
# Tiles in the fp8-dot kernel's ring (gluon_fp8_ring.SLOTS), and what the compiled Gluon kernels take beyond their
# buffers (barriers, layout scratch), for the *_shared_bytes estimates.
FP8_SLOTS = 4
GLUON_SCRATCH_BYTES = 1024
# Balanced spans (DecodePlan.balanced): the fewest rows a program takes; longer spans were slower.
MIN_SPAN_ROWS = 128
# The seesaw kernel (gluon_seesaw.py) is off by default: it compiles for sm_90 but has not yet run on a GPU, so
# neither its results nor its speed against gluon_wgmma are known. Benchmarks and tests name it
# (tuning.mla_decode_tuned(kernel="gluon_seesaw")); set this once tests/gpu/test_mla_decode_seesaw.py passes and the
# GPU suite's decode section shows it faster.
SEESAW_BY_DEFAULT = False
# Rows per tile the seesaw kernel builds at: 32 (four ring slots beside the queries) or 64 (two, FlashMLA's tile).
SEESAW_TILES = (32, 64)


def tma_rows(kv_cache: torch.Tensor) -> bool:
    """Whether TMA can copy the cache's rows: 16-byte aligned start and row stride, unit stride within a row."""
    row = kv_cache.view(-1, kv_cache.shape[-1])
    return row.stride(1) == 1 and row.stride(0) * row.element_size() % 16 == 0 and row.data_ptr() % 16 == 0


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeShape:
    """What the model fixes at start-up: heads per rank, latent and rotary widths, cache and query dtypes, page."""

    num_heads: int
    kv_lora_rank: int
    rope_dim: int
    cache_dtype: torch.dtype
    query_dtype: torch.dtype
    block_size: int

    @property
    def quantized(self) -> bool:
        return is_quantized(self.cache_dtype)


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeCall:
    """What changes from step to step: the batch, the longest context the call is sized for (a CUDA graph sizes
    it for max_model_len), whether TMA can copy the cache's rows (16-byte aligned start), and the window: a call
    that reads only each sequence's last `window` rows (0: all of them)."""

    batch: int
    max_seq_len: int
    tma_rows: bool = True
    window: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeDevice:
    """What the device offers the kernels: its GPU generation ("sm_90"; None off CUDA), SM count, whether Triton
    kernels run there (a CUDA GPU, or the CPU interpreter under TRITON_INTERPRET=1) and whether Gluon's do, and the
    shared memory one program may take (kernels/fit.py)."""

    arch: str | None
    sms: int
    triton: bool
    gluon: bool
    shared_bytes: int = DEFAULT_SHARED_BYTES


@dataclasses.dataclass(frozen=True, slots=True)
class DecodePlan:
    """How one call is launched: the kernel (a name in dispatch.DECODE_KERNELS), the grid's split count, the tile
    and, for the Triton kernel, its padded widths and loop options (see triton_split._stage1).

    split_target is the measured rules' split count, which a batch of equal lengths takes; the kernels give each
    sequence its share of batch x split_target splits by its length (longer ones more, up to num_splits, the grid's
    count). 0: num_splits (a count a benchmark names)."""

    kernel: str
    num_splits: int
    block_h: int = 16
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 1
    lat_tile: int = 0  # kv_lora_rank padded to a power of two >= 16 (Triton kernel)
    rope_tile: int = 0  # rope_dim likewise
    page_ahead: bool = False
    prefetch: bool = False
    q_f16: bool = False
    widen_bits: bool = False
    tile_in_page: bool = True
    pdl: bool = False
    partial_dtype: torch.dtype = torch.float32
    split_target: int = 0
    balanced: bool = False  # Triton kernel: num_splits programs take equal runs of the batch's tiles
    min_span_rows: int = MIN_SPAN_ROWS  # balanced: the fewest rows a program takes
    window: int = 0  # each sequence's last `window` rows only (DecodeCall.window); 0: all
    # gluon_seesaw: whole tiles copied by TMA (gluon_seesaw_ring.py), else by cp.async; it reads `prefetch` as
    # "consumer 0 issues the next pair's score dots early" (gluon_seesaw.py)
    tma: bool = False


def num_splits_for(batch: int, head_groups: int, max_len: int, block_n: int, sms: int, block_h: int) -> int:
    """How many slices of the context each (sequence, head group) is split into; no slice under 4 KV tiles.

    The memory-bound kernel (16 heads per program) gets about two programs per SM, which is what fits at once and
    was fastest in CUDA-graph replays. The compute-bound kernel (64 heads per program) was fastest unsplit when one
    wave holds every program, so it takes the fewest splits whose last wave is within 5% of the best fill."""
    most = max(1, min(math.ceil(max_len / (4 * block_n)), 64))
    work = max(batch * head_groups, 1)
    if block_h <= 16:
        return max(1, min(most, round(2 * sms / work)))

    def fill(splits: int) -> float:
        programs = work * splits
        return programs / (math.ceil(programs / sms) * sms)

    best = max(fill(n) for n in range(1, most + 1))
    return next(n for n in range(1, most + 1) if fill(n) >= 0.95 * best)


# The partial outputs the grid's spare splits may claim (batch x heads x num_splits x kv_lora_rank float32).
GRID_ROOM_BYTES = 256 << 20


def grid_splits(target: int, batch: int, num_heads: int, kv_lora_rank: int, max_len: int) -> int:
    """The grid's split count for a call whose target is `target` splits per sequence, when the sequences' lengths
    under max_len are not known on the host (a CUDA graph is sized for max_model_len): room for a sequence up to four
    times the batch's mean length to take four times the target, so it is not the one program left running (in
    benchmarks/gpu_mixed.py's workload the room halved the split step). The room is bounded by its partial outputs'
    memory and by 64 splits of at least 256 rows; a program past its sequence's share does no tile work. Kernels
    whose programs cannot end cheaply take none (dispatch.DecodeKernel.grid_room)."""
    most = max(1, min(math.ceil(max_len / 256), 64))
    spare = GRID_ROOM_BYTES // max(batch * num_heads * kv_lora_rank * 4, 1)
    return max(target, min(most, 4 * target, spare))


def fp8_dot_splits(batch: int, head_groups: int, max_len: int, sms: int) -> int:
    """Splits for the fp8-dot kernel (gluon_fp8.py): its CTA takes a whole SM (shared memory), so about one
    per SM, each with at least 8 tiles of 64 rows (4 per warpgroup); at most 32. More, in waves, were slower at every
    shape timed: waves do not make up for the SMs' unequal bandwidth."""
    most = max(1, min(math.ceil(max_len / (8 * 64)), 32))
    return max(1, min(most, round(sms / max(batch * head_groups, 1))))


def fp8_dots_pay(batch: int, head_groups: int, max_len: int, splits: int) -> bool:
    """Whether the fp8-dot kernel beats the widening one for a call: when each CTA gets 16 tiles of 64 rows or
    more, or 4 or more and the call has 512 tiles in all: with fewer tiles per CTA its set-up is not paid back.
    The rule sees max_len, not the lengths: a graph sized for a longer context than the batch has picks by the
    graph's size."""
    tiles = math.ceil(max_len / 64)
    per_cta = math.ceil(tiles / splits)
    return per_cta >= 16 or (per_cta >= 4 and batch * head_groups * tiles >= 512)


def _groups(shape: DecodeShape, block_h: int) -> int:
    return -(-shape.num_heads // block_h)


def _tile(width: int) -> int:
    """A width as a Triton tile takes it: a power of two (tl.arange), at least 16 (tl.dot's smallest K and N)."""
    return max(16, 1 << max(width - 1, 0).bit_length())


# ---- when each kernel pays (the dispatcher takes the first kernel that fits and pays) ----------------------------


def always(shape: DecodeShape, device: DecodeDevice) -> bool:
    return True


def many_heads(shape: DecodeShape, device: DecodeDevice) -> bool:
    """The 64-head rule: with 64 heads or more each latent tile feeds 64 heads' dots, and the Gluon kernel's two
    warpgroups split the scores (Triton's both computed all of them: gluon_wgmma.py)."""
    return shape.num_heads >= 64


def seesaw_pays(shape: DecodeShape, device: DecodeDevice) -> bool:
    """The seesaw kernel takes the 64-head rule's calls once SEESAW_BY_DEFAULT is set (see there)."""
    return SEESAW_BY_DEFAULT and many_heads(shape, device)


def few_heads(shape: DecodeShape, device: DecodeDevice) -> bool:
    """The 8-bit Gluon kernels run 16 heads per program: with more heads the Triton kernel's 32- and 64-head
    programs read each latent tile fewer times."""
    return shape.num_heads <= 16


def fp8_widening_pays(shape: DecodeShape, device: DecodeDevice) -> bool:
    """The widening 8-bit Gluon kernel pays for fp8 caches at 16 heads or fewer, and at 64 or more, where it runs
    16-head groups, where the Triton kernel's 64-head programs widen each tile in registers that the dots also
    need. 17-63 heads were not measured and keep the Triton kernel. For
    int8 it gained too little over the Triton kernel at 16 heads, so int8 stays there unless named."""
    return shape.cache_dtype == FP8 and (few_heads(shape, device) or shape.num_heads >= 64)


def fp8_dots_pay_for(shape: DecodeShape, call: DecodeCall, device: DecodeDevice) -> bool:
    """fp8_dots_pay at the split count the fp8-dot kernel would take for this call."""
    groups = _groups(shape, 16)
    splits = fp8_dot_splits(call.batch, groups, call.max_seq_len, device.sms)
    return fp8_dots_pay(call.batch, groups, call.max_seq_len, splits)


# ---- each kernel's parameters: the defaults, and the tuning a benchmark passes (mla_decode_tuned) ---------------


def plan_triton(
    shape: DecodeShape, call: DecodeCall, device: DecodeDevice, tuning: Mapping[str, object]
) -> DecodePlan:
    """The Triton kernel (triton_split._stage1), any shape. Defaults from the sweep in gpu_suite.py --tune: 16
    heads per program when there are few (memory-bound: one latent read per 16 heads), 64 with many (each latent
    tile then feeds 64 heads' dots)."""
    heads, page, quantized = shape.num_heads, shape.block_size, shape.quantized
    block_h = tuning.get("block_h") or (16 if heads <= 16 else 32 if heads < 64 else 64)
    # 8-bit tiles are widened in registers; at 16 heads per program that conversion, not HBM, bounds the kernel,
    # and smaller tiles with fewer warps and fp16 dots (a cheaper widening) were fastest. The 64-head kernel keeps
    # the measured defaults of 16-bit caches.
    light = quantized and block_h <= 16
    q_f16 = tuning.get("q_f16")
    q_f16 = light and shape.query_dtype != torch.float32 if q_f16 is None else q_f16  # fp32 keeps fp32 dots
    num_stages = tuning.get("num_stages") or (3 if block_h <= 16 else 2)
    page_ahead = tuning.get("page_ahead")
    page_ahead = block_h <= 16 and not quantized if page_ahead is None else page_ahead
    block_n, num_warps, splits = tuning.get("block_n"), tuning.get("num_warps"), tuning.get("num_splits")
    balanced = tuning.get("balanced")
    if call.window:
        # a window's rows are few and equal in number: split shares, which know where a window starts
        balanced = False
    elif balanced is None:
        balanced = (
            block_h <= 16 and not quantized and spans_pay(call.batch, _groups(shape, block_h), device.sms)
        )
    if light:
        block_n, num_warps = block_n or 32, num_warps or 4
    elif block_h <= 16 and page_ahead and page % 32 == 0:
        # 16-bit tiles, two buffers each (page ahead). 32-row tiles with 4 warps fit two programs per SM and were
        # fastest once the grid fills the GPU; a grid under one program per SM (batch 1) wants 64-row tiles and 8
        # warps. Pages under 32 rows keep 64-row tiles: they span pages, so there is no page to look up ahead.
        # (a balanced plan's num_splits counts programs, not slices of a sequence)
        wide = (not balanced and splits) or num_splits_for(
            call.batch, _groups(shape, block_h), call.max_seq_len, 64, device.sms, block_h
        )
        small = call.batch * _groups(shape, block_h) * wide < device.sms and page % 64 == 0
        block_n, num_warps = block_n or (64 if small else 32), num_warps or (8 if small else 4)
    else:
        block_n, num_warps = block_n or 64, num_warps or 8
    lat_tile, rope_tile = _tile(shape.kv_lora_rank), _tile(shape.rope_dim)
    prefetch = tuning.get("prefetch")
    prefetch = quantized if prefetch is None else prefetch
    # Wider rows than DeepSeek's 16-bit ones (fp32 dots, a wider latent) take fewer rows, then fewer heads, then one
    # tile buffer, per program than the defaults above, until its shared memory is within what the defaults take
    # and what the device gives a program.
    row_bytes = (lat_tile + rope_tile) * (4 if shape.query_dtype == torch.float32 else 2)
    budget = min(SHARED_BUDGET, device.shared_bytes)
    while _shared_bytes(block_h, block_n, lat_tile, row_bytes, prefetch or num_stages == 1) > budget:
        if tuning.get("block_n") is None and block_n > 16 and (block_n >= block_h or block_h == 16):
            block_n //= 2
        elif tuning.get("block_h") is None and block_h > 16:
            block_h //= 2
        elif tuning.get("num_stages") is None and num_stages > 1:
            num_stages = 1
        else:
            break
    if balanced:
        splits = splits or balanced_programs(_groups(shape, block_h), device.sms)
    else:
        splits = splits or num_splits_for(call.batch, _groups(shape, block_h), call.max_seq_len, block_n,
                                          device.sms, block_h)  # fmt: skip
    in_page = page % block_n == 0
    return DecodePlan(
        "triton", splits, block_h, block_n, num_warps, num_stages, lat_tile, rope_tile,
        page_ahead=page_ahead and in_page, prefetch=prefetch,
        q_f16=q_f16 and quantized, widen_bits=tuning.get("widen_bits") is not False and quantized and q_f16,
        tile_in_page=in_page, partial_dtype=tuning.get("partial_dtype", torch.float32), balanced=balanced,
        min_span_rows=tuning.get("min_span_rows", MIN_SPAN_ROWS),
    )  # fmt: skip


def spans_pay(batch: int, head_groups: int, sms: int) -> bool:
    """Whether balanced spans (DecodePlan.balanced) beat split shares for the 16-head Triton kernel over a 16-bit
    cache: where the measured split rule (num_splits_for) gives a sequence at most six splits, from about 41
    sequences, whatever the context. With few splits, shares cut a long sequence into a few long slices that the
    batch waits on; with many they cut it finely, and spans only add their search."""
    return round(2 * sms / max(batch * head_groups, 1)) <= 6


def balanced_programs(head_groups: int, sms: int) -> int:
    """Programs per head group for balanced spans (DecodePlan.balanced): the two per SM that the memory-bound
    16-head program fits at once (num_splits_for), each then given an equal run of the batch's tiles."""
    return max(1, round(2 * sms / head_groups))


def _shared_bytes(block_h: int, block_n: int, lat_tile: int, row_bytes: int, one_buffer: bool) -> int:
    """The Triton kernel's shared memory: the queries and the KV tile, in two buffers where Triton's pipeliner
    streams it (one where the tile is prefetched into registers and only the dots' operand goes through, or nothing
    is pipelined); or, where larger, a layout conversion of the float32 [block_h, latent] accumulator, which the
    compiler stages through shared memory for many heads over a wide latent."""
    tiles = (block_h + (1 if one_buffer else 2) * block_n) * row_bytes
    return max(tiles, block_h * lat_tile * 4)


def triton_shared_bytes(plan: DecodePlan, shape: DecodeShape) -> int:
    """The Triton kernel's shared memory at `plan`'s tile: the estimate plan_triton keeps within the device's."""
    row_bytes = (plan.lat_tile + plan.rope_tile) * (4 if shape.query_dtype == torch.float32 else 2)
    return _shared_bytes(
        plan.block_h, plan.block_n, plan.lat_tile, row_bytes, plan.prefetch or plan.num_stages == 1
    )


# The Gluon kernels' shared memory: their buffers at the fixed tile, plus what the compiled kernels add beyond them
# (a few hundred bytes of barriers and scratch: GLUON_SCRATCH_BYTES).


def gluon_wgmma_shared_bytes(plan: DecodePlan, shape: DecodeShape) -> int:
    """16-bit queries, two tiles of rows, p."""
    width = shape.kv_lora_rank + shape.rope_dim
    buffers = 2 * (plan.block_h * width + 2 * plan.block_n * width + plan.block_h * plan.block_n)
    return buffers + GLUON_SCRATCH_BYTES


def gluon_seesaw_shared_bytes(plan: DecodePlan, shape: DecodeShape) -> int:
    """16-bit queries, a ring of 128 rows (four 32-row tiles or two 64-row ones; p lives in their rope columns),
    the two consumers' maxima and row sums."""
    width = shape.kv_lora_rank + shape.rope_dim
    buffers = 2 * (plan.block_h * width + 128 * width) + 2 * 2 * plan.block_h * 4
    return buffers + GLUON_SCRATCH_BYTES


def gluon_wgmma8_shared_bytes(plan: DecodePlan, shape: DecodeShape) -> int:
    """fp16 queries, two 8-bit tiles of rows, fp16 p."""
    width = shape.kv_lora_rank + shape.rope_dim
    buffers = 2 * plan.block_h * width + 2 * plan.block_n * width + 2 * plan.block_n * plan.block_h
    return buffers + GLUON_SCRATCH_BYTES


def gluon_fp8_shared_bytes(plan: DecodePlan, shape: DecodeShape) -> int:
    """A ring of fp8 tiles with their 16-byte tails, the query's two terms, p's two terms per consumer, the state
    one consumer hands the other."""
    width = shape.kv_lora_rank + shape.rope_dim
    buffers = FP8_SLOTS * plan.block_n * (width + TAIL_BYTES) + 2 * plan.block_h * width
    buffers += 2 * 2 * plan.block_h * plan.block_n + 2 * plan.block_h * 4
    return buffers + GLUON_SCRATCH_BYTES


def no_shared_bytes(plan: DecodePlan, shape: DecodeShape) -> int:
    """The torch reference's: none of the device's per-program shared memory."""
    return 0


def plan_gluon_wgmma(
    shape: DecodeShape, call: DecodeCall, device: DecodeDevice, tuning: Mapping[str, object]
) -> DecodePlan:
    """gluon_wgmma.py: fixed tile (64 heads, 64 rows, 8 warps), splits as the 64-head rule fills the GPU."""
    splits = tuning.get("num_splits") or num_splits_for(call.batch, _groups(shape, 64), call.max_seq_len, 64,
                                                        device.sms, 64)  # fmt: skip
    return DecodePlan(
        "gluon_wgmma", splits, 64, 64, 8, partial_dtype=tuning.get("partial_dtype", torch.float32)
    )


def plan_gluon_seesaw(
    shape: DecodeShape, call: DecodeCall, device: DecodeDevice, tuning: Mapping[str, object]
) -> DecodePlan:
    """gluon_seesaw.py: 64 heads, 32-row tiles unless block_n=64, 12 warps (a producer warpgroup and two consumers),
    tiles by cp.async unless tma=True, consumer 0's scores issued a pair ahead if prefetch=True; gluon_wgmma's split
    count (its 64-row tiles), so the two compare at the same grid."""
    block_n = tuning.get("block_n") or SEESAW_TILES[0]
    if block_n not in SEESAW_TILES:
        raise ValueError(f"gluon_seesaw takes block_n {' or '.join(map(str, SEESAW_TILES))}, not {block_n}")
    tma = bool(tuning.get("tma", False))
    if tma and shape.block_size % block_n:
        raise ValueError(f"gluon_seesaw copies by TMA only tiles inside a page: block_size {shape.block_size} is "
                         f"not a multiple of block_n {block_n}")  # fmt: skip
    splits = tuning.get("num_splits") or num_splits_for(call.batch, _groups(shape, 64), call.max_seq_len, 64,
                                                        device.sms, 64)  # fmt: skip
    return DecodePlan("gluon_seesaw", splits, 64, block_n, 12, prefetch=bool(tuning.get("prefetch", False)),
                      partial_dtype=tuning.get("partial_dtype", torch.float32), tma=tma)  # fmt: skip


def plan_gluon_wgmma8(
    shape: DecodeShape, call: DecodeCall, device: DecodeDevice, tuning: Mapping[str, object]
) -> DecodePlan:
    """gluon_wgmma8.py: fixed tile (16 heads, 64 rows, 4 warps); the split count of the Triton 8-bit
    kernel's 32-row tiles, with which it was measured."""
    splits = tuning.get("num_splits") or num_splits_for(call.batch, _groups(shape, 16), call.max_seq_len, 32,
                                                        device.sms, 16)  # fmt: skip
    return DecodePlan(
        "gluon_wgmma8", splits, 16, 64, 4, partial_dtype=tuning.get("partial_dtype", torch.float32)
    )


def plan_gluon_fp8(
    shape: DecodeShape, call: DecodeCall, device: DecodeDevice, tuning: Mapping[str, object]
) -> DecodePlan:
    """gluon_fp8.py: fixed tile (16 heads, 64 rows, 4 warps), about one CTA per SM (fp8_dot_splits), launched
    on programmatic dependent launch behind the query split unless pdl=False."""
    splits = tuning.get("num_splits") or fp8_dot_splits(
        call.batch, _groups(shape, 16), call.max_seq_len, device.sms
    )
    return DecodePlan("gluon_fp8", splits, 16, 64, 4, pdl=tuning.get("pdl", True),
                      partial_dtype=tuning.get("partial_dtype", torch.float32))  # fmt: skip


def plan_torch(
    shape: DecodeShape, call: DecodeCall, device: DecodeDevice, tuning: Mapping[str, object]
) -> DecodePlan:
    """The torch reference reads whole block tables: nothing to tune."""
    return DecodePlan("torch reference", 1)
