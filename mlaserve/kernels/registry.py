"""The kernels the layers call, one entry per op (kernel.py's shape), with the rules that say where each runs.

A layer asks its entry for a call's kernel and keeps its torch code for every call the entry declines: that code
is its CPU path and the kernel's reference. Each kernel's module is named here as a string and imported on first
use, so nothing here imports triton. `KERNELS` holds them by op name.
"""

import torch

from mlaserve.kernels.kernel import KERNEL_DTYPES, Kernel, Lazy, on_cuda

# skinny.py's tile kernel takes one tensor-core tile of rows; larger batches keep cuBLAS.
SKINNY_MAX_ROWS = 16
# skinny.py's GEMV kernel sums this many rows against each weight block in registers, one after another.
GEMV_MAX_ROWS = 4
# Outputs from which skinny.py's tile kernel streams the weight as well as the GEMV at any row count (LM heads).
LM_HEAD_WIDTH = 32768
# The widest output at which skinny.py's tile kernel beat cuBLAS, which splits narrow GEMMs over K in two kernels.
SKINNY_NARROW_WIDTH = 1024
# router.py's gate GEMM; past this cuBLAS's GEMM shares each weight tile between tokens.
GATE_MAX_TOKENS = 16
# Block-FP8 weights (layers/block_fp8.py): scale columns are this wide; scale rows span one or this many rows.
FP8_BLOCK = 128
FP8_GROUPS_N = (1, FP8_BLOCK)
# Whether prefill takes kernels/prefill_attn's Triton kernel (V at its own width) where it can, instead of torch's
# flash varlen op (V zero-padded to K's width). Off until the GPU suite's prefill128 section has measured it
# faster than flash varlen at 128 heads; tests and benchmarks turn it on to run it through the backend.
TRITON_PREFILL_BY_DEFAULT = False
# The widest query/key and value heads the prefill kernel keeps in registers (a query tile and an accumulator).
PREFILL_MAX_WIDTH = 256


def _silu_and_mul(gate_up: torch.Tensor) -> str | None:
    return on_cuda(gate_up)


def _rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> str | None:
    reason = on_cuda(x, weight)
    if reason is None and residual is not None and (residual.dtype != x.dtype or residual.shape != x.shape):
        return "adds a residual of x's dtype and shape only"
    return reason


def _rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, *rope: object) -> str | None:
    return on_cuda(q, k)


def _mla_prep(positions: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, *rest: object) -> str | None:
    return on_cuda(q, kv)


def _prefill_kv(kv: torch.Tensor, k_pe: torch.Tensor, nope_dim: int, pad_values: bool = True) -> str | None:
    if pad_values and kv.shape[-1] - nope_dim > nope_dim + k_pe.shape[-1]:
        return "pads V to K's width: V no wider than K"
    return on_cuda(kv, k_pe)


def prefill_attention_problem(
    device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, qk_dim: int, v_dim: int
) -> str | None:
    """None when the prefill attention kernel takes this shape, else why not (one line)."""
    if kv_heads < 1 or heads % kv_heads:
        return f"takes query heads a multiple of K/V heads, not {heads} and {kv_heads}"
    if max(qk_dim, v_dim) > PREFILL_MAX_WIDTH:
        return f"takes heads up to {PREFILL_MAX_WIDTH} wide, not {qk_dim} and {v_dim}"
    if dtype not in KERNEL_DTYPES:
        return f"takes float32, bfloat16 and float16, not {dtype}"
    return None if device.type == "cuda" else "needs CUDA tensors"


def _prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: object, **options: object
) -> str | None:
    if k.shape[-1] != q.shape[-1] or k.shape[:2] != v.shape[:2] or not q.dtype == k.dtype == v.dtype:
        return "takes q and k of one width, k and v of one length and head count, all of one dtype"
    if not (q.device == k.device == v.device) or any(t.stride(-1) != 1 for t in (q, k, v)):
        return "takes q, k and v on one device with unit-stride last dimensions"
    return prefill_attention_problem(q.device, q.dtype, q.shape[1], k.shape[1], q.shape[-1], v.shape[-1])


def prefill_attention_pays(*args: object, **options: object) -> bool:
    """TRITON_PREFILL_BY_DEFAULT, read at each call."""
    return TRITON_PREFILL_BY_DEFAULT


def _sixteen_bit_pair(x: torch.Tensor, w: torch.Tensor) -> str | None:
    if x.dtype != w.dtype or x.dtype == torch.float32:
        return "takes 16-bit x and weights of one dtype"
    return on_cuda(x, w)


def _per_head(x: torch.Tensor, w: torch.Tensor) -> str | None:
    if x.shape[0] > GEMV_MAX_ROWS:
        return f"takes up to {GEMV_MAX_ROWS} rows"
    return _sixteen_bit_pair(x, w)


def _skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> str | None:
    if x.dim() != 2 or x.shape[0] > SKINNY_MAX_ROWS:
        return f"takes 2-D x of up to {SKINNY_MAX_ROWS} rows"
    return _sixteen_bit_pair(x, weight)


def _skinny_pays(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Its GEMV at every width up to GEMV_MAX_ROWS rows; beyond that the widths where its tile kernel beat cuBLAS
    (narrow outputs, and LM heads)."""
    n = weight.shape[0]
    return x.shape[0] <= GEMV_MAX_ROWS or n <= SKINNY_NARROW_WIDTH or n >= LM_HEAD_WIDTH


def _gate_logits(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    if x.dim() != 2 or x.shape[0] > GATE_MAX_TOKENS:
        return f"takes 2-D x of up to {GATE_MAX_TOKENS} tokens"
    return on_cuda(x, weight)


def _on_cuda_device(x: torch.Tensor, *rest: object, **options: object) -> str | None:
    """Kernels that take any dtype they are given (float32 routing logits; MoE weights as loaded)."""
    return None if x.is_cuda else "needs CUDA tensors"


def _scale_problem(weight: torch.Tensor, scale: torch.Tensor | None, group_n: int, name: str) -> str | None:
    """None when `scale` is a float32 block scale [..., ceil(N/group_n), ceil(K/128)] of weight [..., N, K]."""
    if scale is None:
        return f"takes {name}'s float32 block scale with its float8_e4m3fn weight"
    want = (*weight.shape[:-2], -(-weight.shape[-2] // group_n), -(-weight.shape[-1] // FP8_BLOCK))
    if scale.dtype != torch.float32 or tuple(scale.shape) != want:
        return f"takes {name}'s scale as float32 {want}, not {scale.dtype} {tuple(scale.shape)}"
    return None


def expert_scales_problem(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    group_n: int,
) -> str | None:
    """None when the expert weights are 16-bit or float32 without scales, or both float8_e4m3fn with block
    scales of group_n (1 or 128) rows by 128 columns; else why not."""
    fp8 = torch.float8_e4m3fn
    if w13.dtype != fp8 and w2.dtype != fp8:
        if w13_scale is not None or w2_scale is not None:
            return "takes scales with float8_e4m3fn weights only"
        return None
    if w13.dtype != fp8 or w2.dtype != fp8:
        return "takes w13 and w2 both float8_e4m3fn or neither"
    if group_n not in FP8_GROUPS_N:
        return f"takes block scales of {FP8_GROUPS_N} rows, not {group_n}"
    return _scale_problem(w13, w13_scale, group_n, "w13") or _scale_problem(w2, w2_scale, group_n, "w2")


def _fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *rest: object,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    group_n: int = FP8_BLOCK,
    **options: object,
) -> str | None:
    """MoE weights as loaded: any dtype, or block FP8 with their scales (passed by keyword)."""
    return expert_scales_problem(w13, w2, w13_scale, w2_scale, group_n) or _on_cuda_device(x)


def _block_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    group_n: int,
    bias: torch.Tensor | None = None,
    **options: object,
) -> str | None:
    if weight.dtype != torch.float8_e4m3fn:
        return f"takes float8_e4m3fn weights, not {weight.dtype}"
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        return "takes 2-D x [M, K] and weight [N, K]"
    if x.dtype not in KERNEL_DTYPES:
        return f"takes float32, bfloat16 and float16 x, not {x.dtype}"
    if group_n not in FP8_GROUPS_N:
        return f"takes block scales of {FP8_GROUPS_N} rows, not {group_n}"
    problem = _scale_problem(weight, scale, group_n, "weight")
    if problem is None and bias is not None and tuple(bias.shape) != (weight.shape[0],):
        problem = "adds a bias of one value per output"
    if problem is None and not all(t.is_cuda for t in (x, weight, scale, *(() if bias is None else (bias,)))):
        problem = "needs CUDA tensors"
    return problem


def _mxfp4_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    *rest: object,
) -> str | None:
    """MXFP4 experts as loaded (layers/mxfp4_experts.py): contiguous packed bytes and e8m0 scales, all uint8."""
    if any(t.dtype != torch.uint8 or not t.is_contiguous() for t in (w13, w13_scale, w2, w2_scale)):
        return "takes contiguous uint8 packed weights and e8m0 scales"
    return on_cuda(x)


SILU_AND_MUL = Kernel("silu_and_mul", _silu_and_mul, Lazy("mlaserve.kernels.act", "silu_and_mul"))
RMS_NORM = Kernel("rms_norm", _rms_norm, Lazy("mlaserve.kernels.norm", "rms_norm"))
ROTARY = Kernel("rotary", _rotary, Lazy("mlaserve.kernels.rotary", "rotary"))
MLA_PREP = Kernel("mla_prep", _mla_prep, Lazy("mlaserve.kernels.mla_prep", "mla_prep"))
PREFILL_KV = Kernel("prefill_kv", _prefill_kv, Lazy("mlaserve.kernels.prefill_kv", "prefill_kv"))
PREFILL_ATTENTION = Kernel(
    "prefill_attention",
    _prefill_attention,
    Lazy("mlaserve.kernels.prefill_attn.triton_prefill", "prefill_attention"),
    pays=prefill_attention_pays,
)
PER_HEAD = Kernel("per_head", _per_head, Lazy("mlaserve.kernels.skinny", "per_head"))
SKINNY_LINEAR = Kernel(
    "skinny_linear", _skinny_linear, Lazy("mlaserve.kernels.skinny", "skinny_linear"), pays=_skinny_pays
)
GATE_LOGITS = Kernel("gate_logits", _gate_logits, Lazy("mlaserve.kernels.router", "gate_logits"))
ROUTE_GREEDY = Kernel("route_greedy", _on_cuda_device, Lazy("mlaserve.kernels.router", "route_greedy"))
FUSED_MOE = Kernel("fused_moe", _fused_moe, Lazy("mlaserve.kernels.moe.dispatch", "fused_experts"))
MXFP4_MOE = Kernel("mxfp4_moe", _mxfp4_moe, Lazy("mlaserve.kernels.moe.mxfp4_gemm", "mxfp4_experts"))
BLOCK_FP8_LINEAR = Kernel(
    "block_fp8_linear", _block_fp8_linear, Lazy("mlaserve.kernels.block_fp8", "block_fp8_linear")
)

KERNELS: dict[str, Kernel] = {
    kernel.name: kernel
    for kernel in (
        SILU_AND_MUL,
        RMS_NORM,
        ROTARY,
        MLA_PREP,
        PREFILL_KV,
        PREFILL_ATTENTION,
        PER_HEAD,
        SKINNY_LINEAR,
        GATE_LOGITS,
        ROUTE_GREEDY,
        FUSED_MOE,
        MXFP4_MOE,
        BLOCK_FP8_LINEAR,
    )
}
