"""On a GPU (skipped in CI): the block-FP8 kernels in bf16 at DeepSeek-V3's shapes, eagerly and captured in a CUDA
graph (replayed on new inputs: nothing may be sized or synced on the host), against layers/block_fp8.py's
references: the W8A16 decode kernels as is, the W8A8 GEMM with quantized activations, the fused MoE's fp8 experts
on dequantized weights. Also the activation quantization byte for byte at a prefill's size."""

import pytest
import torch
import torch.nn.functional as F

from mlaserve.kernels.block_fp8 import block_fp8_linear
from mlaserve.kernels.fp8_quant import quantize_per_token_group
from mlaserve.kernels.moe.dispatch import W8A8_PAIRS_PER_EXPERT, fused_experts
from mlaserve.kernels.registry import BLOCK_FP8_LINEAR, FUSED_MOE
from mlaserve.layers import block_fp8 as ref
from mlaserve.layers.moe import experts_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (N, K, group_n): V3's o_proj slice, fused q_a + kv_a (one scale row per weight row), q_b, kv_b
SHAPES = [(7168, 2048, 128), (2112, 7168, 1), (2112, 7168, 128), (24576, 1536, 128), (32768, 512, 128)]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def fp8_weight(n: int, k: int, group_n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return ref.quantize(torch.randn(n, k, device="cuda", generator=gen) * k**-0.5, block_n=group_n)


def graphed(fn, *inputs: torch.Tensor):
    """fn captured in a CUDA graph over static copies of inputs: call it with new inputs to replay."""
    static = [t.clone() for t in inputs]
    fn(*static)  # compile and pick tiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static)

    def replay(*new: torch.Tensor) -> torch.Tensor:
        for s, t in zip(static, new):
            s.copy_(t)
        graph.replay()
        torch.cuda.synchronize()
        return out.clone()

    return replay


@pytest.mark.parametrize("rows", [1, 2, 4, 7, 16, 64, 512, 4096])
@pytest.mark.parametrize("n, k, group_n", SHAPES)
def test_linear_at_v3_shapes(rows, n, k, group_n):
    w, s = fp8_weight(n, k, group_n, n + k)
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=gen, dtype=torch.bfloat16)
    assert BLOCK_FP8_LINEAR.why_not(x, w, s, group_n, bias) is None
    quantized = rows > 16
    want = ref.linear_reference(x, w, s, group_n, bias, quantize_activations=quantized)
    assert relative_error(block_fp8_linear(x, w, s, group_n, bias), want) < 1e-2
    if quantized:
        assert relative_error(block_fp8_linear(x, w, s, group_n, bias, fuse_quant=True), want) < 1e-2


@pytest.mark.parametrize("rows", [1, 4, 16, 256])
@pytest.mark.parametrize("fuse_quant", [False, True])
def test_linear_in_a_cuda_graph(rows, fuse_quant):
    """Two layers back to back in one graph (the second reads the first's output), replayed on a new input."""
    (w1, s1), (w2, s2) = fp8_weight(2112, 7168, 1, 1), fp8_weight(7168, 2112, 128, 2)

    def two_layers(x: torch.Tensor) -> torch.Tensor:
        h = block_fp8_linear(x, w1, s1, 1, fuse_quant=fuse_quant)
        return block_fp8_linear(h, w2, s2, 128, fuse_quant=fuse_quant)

    gen = torch.Generator(device="cuda").manual_seed(rows)
    first, second = (
        torch.randn(rows, 7168, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in "ab"
    )
    replay = graphed(two_layers, first)
    for x in (second, first):
        assert relative_error(replay(x), two_layers(x)) < 1e-3
        quantized = rows > 16
        h = ref.linear_reference(x, w1, s1, 1, quantize_activations=quantized)
        want = ref.linear_reference(h, w2, s2, 128, quantize_activations=quantized)
        assert relative_error(replay(x), want) < 2e-2


@pytest.mark.parametrize("pow2", [False, True])
def test_activation_quantization_byte_for_byte_at_a_prefill(pow2):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8192, 7168, device="cuda", generator=gen) * torch.logspace(-6, 3, 7168, device="cuda")
    x = x.to(torch.bfloat16)
    q, s = quantize_per_token_group(x, pow2_scale=pow2)
    want_q, want_s = ref.quantize_per_token_group(x, pow2_scale=pow2)
    assert torch.equal(s, want_s)
    mismatched = (q.view(torch.uint8) != want_q.view(torch.uint8)).sum().item()
    assert mismatched == 0, f"{mismatched} fp8 values differ"


# The W8A8 experts' gated activations reach the second GEMM rounded to bf16 before they are quantized, where the
# reference quantizes them from float32: an fp8 step apart wherever they sit near a rounding boundary.
W8A8_ERROR = 2e-2


def v3_experts(experts: int, group_n: int) -> tuple[torch.Tensor, ...]:
    inter, hidden = 2048, 7168
    w13, s13 = fp8_weight(experts * 2 * inter, hidden, group_n, 3)
    w2, s2 = fp8_weight(experts * hidden, inter, group_n, 4)
    return (
        w13.view(experts, 2 * inter, hidden),
        s13.view(experts, -1, s13.shape[-1]),
        w2.view(experts, hidden, inter),
        s2.view(experts, -1, s2.shape[-1]),
    )


@pytest.mark.parametrize("group_n", [1, 128])
@pytest.mark.parametrize("tokens", [1, 4, 64, 512])
def test_fp8_experts_at_v3_shapes(group_n, tokens):
    """V3's expert widths (hidden 7168, I 2048), 16 experts, top-8: pair tiles, sorted tiles of each height, and the
    W8A8 tiles against the reference that quantizes activations (the table's choice from W8A8_PAIRS_PER_EXPERT)."""
    experts, top_k = 16, 8
    w13, s13, w2, s2 = v3_experts(experts, group_n)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 7168, device="cuda", generator=gen, dtype=torch.bfloat16)
    ids = torch.rand(tokens, experts, device="cuda", generator=gen).topk(top_k, dim=-1)[1]
    weights = torch.rand(tokens, top_k, device="cuda", generator=gen)
    fp8 = {"w13_scale": s13, "w2_scale": s2, "group_n": group_n}
    assert FUSED_MOE.why_not(x, w13, w2, weights, ids, F.silu, **fp8) is None
    want = experts_reference(
        x.float(), ref.dequantize(w13, s13, group_n), ref.dequantize(w2, s2, group_n), weights, ids, F.silu
    )
    dequantized = (ref.dequantize(w13, s13, group_n), ref.dequantize(w2, s2, group_n))
    quantized = experts_reference(x.float(), *dequantized, weights, ids, F.silu, quantize_activations=True)
    w8a8 = fused_experts(x, w13, w2, weights, ids, F.silu, kernel="fp8_w8a8_tiles", **fp8)
    assert relative_error(w8a8, quantized) < W8A8_ERROR
    table_w8a8 = W8A8_PAIRS_PER_EXPERT is not None and tokens * top_k >= W8A8_PAIRS_PER_EXPERT * experts
    got = fused_experts(x, w13, w2, weights, ids, F.silu, **fp8)
    assert relative_error(got, quantized if table_w8a8 else want) < (W8A8_ERROR if table_w8a8 else 1e-2)
    for block_m in (16, 64, 128):
        got = fused_experts(x, w13, w2, weights, ids, F.silu, block_m=block_m, **fp8)
        assert relative_error(got, want) < 1e-2, block_m


@pytest.mark.parametrize("tokens", [1, 8])
def test_fp8_experts_in_a_cuda_graph(tokens):
    experts, top_k = 16, 8
    w13, s13, w2, s2 = v3_experts(experts, 128)
    gen = torch.Generator(device="cuda").manual_seed(tokens)

    def step(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return fused_experts(x, w13, w2, weights, ids, F.silu, w13_scale=s13, w2_scale=s2, group_n=128)

    def inputs() -> tuple[torch.Tensor, ...]:
        x = torch.randn(tokens, 7168, device="cuda", generator=gen, dtype=torch.bfloat16)
        ids = torch.rand(tokens, experts, device="cuda", generator=gen).topk(top_k, dim=-1)[1]
        return x, ids, torch.rand(tokens, top_k, device="cuda", generator=gen)

    first, second = inputs(), inputs()
    replay = graphed(step, *first)
    for args in (second, first):
        x, ids, weights = args
        want = experts_reference(
            x.float(), ref.dequantize(w13, s13, 128), ref.dequantize(w2, s2, 128), weights, ids, F.silu
        )
        assert relative_error(replay(*args), want) < 1e-2


@pytest.mark.parametrize(
    "path, rows", [("w8a16", 64), ("w8a16", 130), ("dequant_cublas", 256), ("torch_blockwise", 256)]
)
@pytest.mark.parametrize("n, k, group_n", SHAPES[:3])
def test_forced_dense_paths_eagerly_and_in_a_cuda_graph(path, rows, n, k, group_n):
    """The candidates fp8_paths times (kernels/block_fp8.py's table), each against its reference, and replayed
    from a graph on a new input. torch's blockwise GEMM only where its one-time check passed on this GPU."""
    from mlaserve.kernels.block_fp8 import torch_blockwise_layout

    w, s = fp8_weight(n, k, group_n, n + k)
    gen = torch.Generator(device="cuda").manual_seed(rows)
    first, second = (torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in "ab")
    if path == "torch_blockwise" and torch_blockwise_layout(first, w, group_n) is None:
        pytest.skip("torch's blockwise GEMM declines this call on this torch and GPU")

    def linear(x: torch.Tensor) -> torch.Tensor:
        return block_fp8_linear(x, w, s, group_n, path=path)

    replay = graphed(linear, first)
    for x in (second, first):
        want = ref.linear_reference(x, w, s, group_n, quantize_activations=path == "torch_blockwise")
        assert relative_error(linear(x), want) < 1e-2
        assert relative_error(replay(x), want) < 1e-2


def test_w8a8_experts_in_a_cuda_graph():
    """The W8A8 tiles at a prompt's size (both stages' activation quantization inside the graph), replayed on new
    routes against the reference that quantizes activations."""
    experts, top_k, tokens = 16, 8, 300
    w13, s13, w2, s2 = v3_experts(experts, 128)
    gen = torch.Generator(device="cuda").manual_seed(tokens)

    def step(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return fused_experts(
            x, w13, w2, weights, ids, F.silu, w13_scale=s13, w2_scale=s2, group_n=128, kernel="fp8_w8a8_tiles"
        )

    def inputs() -> tuple[torch.Tensor, ...]:
        x = torch.randn(tokens, 7168, device="cuda", generator=gen, dtype=torch.bfloat16)
        ids = torch.rand(tokens, experts, device="cuda", generator=gen).topk(top_k, dim=-1)[1]
        return x, ids, torch.rand(tokens, top_k, device="cuda", generator=gen)

    first, second = inputs(), inputs()
    replay = graphed(step, *first)
    dequantized = (ref.dequantize(w13, s13, 128), ref.dequantize(w2, s2, 128))
    for x, ids, weights in (second, first):
        want = experts_reference(x.float(), *dequantized, weights, ids, F.silu, quantize_activations=True)
        assert relative_error(replay(x, ids, weights), want) < W8A8_ERROR
