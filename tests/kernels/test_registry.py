"""The kernel registry's shape (kernels/kernel.py) and the rules of the entries the layers ask (kernels/registry.py),
without a GPU: entries decline CPU tensors and say why, thresholds sit where the kernels were measured to pay, and
nothing the layers import loads triton."""

import subprocess
import sys

import pytest
import torch

from mlaserve.kernels import registry
from mlaserve.kernels.kernel import Kernel, Lazy, always, first


def test_every_entry_declines_cpu_tensors_with_a_reason():
    x, w = torch.zeros(2, 8), torch.zeros(4, 8)
    calls = {
        "silu_and_mul": (x,),
        "rms_norm": (x, w[0], 1e-6),
        "rotary": (torch.zeros(2, dtype=torch.long), x[:, None], x[:, None], w[0], 1.0, 8, False),
        "mla_prep": (torch.zeros(2, dtype=torch.long), x[:, None], x),
        "prefill_kv": (torch.zeros(2, 1, 8), torch.zeros(2, 4), 4),
        "prefill_attention": (torch.zeros(2, 2, 8), torch.zeros(3, 1, 8), torch.zeros(3, 1, 4)),
        "per_head": (torch.zeros(1, 2, 8).half(), torch.zeros(2, 4, 8).half()),
        "skinny_linear": (x.half(), w.half()),
        "gate_logits": (x, w),
        "route_greedy": (torch.zeros(2, 4), None, 2, True, 1.0),
        "fused_moe": (x, torch.zeros(3, 8, 8), torch.zeros(3, 8, 4), torch.ones(2, 1), torch.zeros(2, 1)),
        "block_fp8_linear": (x, w.to(torch.float8_e4m3fn), torch.ones(1, 1), 128),
        "mxfp4_moe": (
            x,
            *(torch.zeros(3, *shape, dtype=torch.uint8) for shape in ((8, 4), (8, 1), (8, 2), (8, 1))),
            torch.zeros(2, 1, dtype=torch.long),
            torch.ones(2, 1),
            1.0,
        ),
    }
    assert set(calls) == set(registry.KERNELS)
    for name, args in calls.items():
        kernel = registry.KERNELS[name]
        assert kernel.choose(*args) is None, name
        assert kernel.why_not(*args) == "needs CUDA tensors", name


def test_shape_rules_come_before_the_device():
    """What a kernel cannot take is named first, wherever the tensors are."""
    half = torch.zeros(registry.SKINNY_MAX_ROWS + 1, 8).half()
    assert "up to 16 rows" in registry.SKINNY_LINEAR.why_not(half, torch.zeros(4, 8).half())
    assert "16-bit" in registry.SKINNY_LINEAR.why_not(torch.zeros(2, 8), torch.zeros(4, 8))
    assert "up to 4 rows" in registry.PER_HEAD.why_not(
        torch.zeros(5, 2, 8).half(), torch.zeros(2, 4, 8).half()
    )
    assert "16 tokens" in registry.GATE_LOGITS.why_not(torch.zeros(17, 8), torch.zeros(4, 8))
    # V (kv's last 12 - nope 4 = 8 columns) wider than K (nope 4 + rope 2)
    assert "V no wider than K" in registry.PREFILL_KV.why_not(torch.zeros(2, 1, 12), torch.zeros(2, 2), 4)
    assert registry.PREFILL_KV.why_not(torch.zeros(2, 1, 12), torch.zeros(2, 2), 4, pad_values=False) == (
        "needs CUDA tensors"
    )
    attention = registry.PREFILL_ATTENTION.why_not
    assert "of one width" in attention(torch.zeros(2, 2, 8), torch.zeros(3, 1, 16), torch.zeros(3, 1, 4))
    assert "multiple of K/V heads" in attention(
        torch.zeros(2, 3, 8), torch.zeros(3, 2, 8), torch.zeros(3, 2, 4)
    )
    assert "up to 256 wide" in attention(torch.zeros(2, 1, 320), torch.zeros(3, 1, 320), torch.zeros(3, 1, 4))


def test_triton_prefill_waits_for_its_measurement(monkeypatch):
    """Off by default: the prefill kernel pays only once TRITON_PREFILL_BY_DEFAULT is turned on (read per call)."""
    assert registry.TRITON_PREFILL_BY_DEFAULT is False
    args = (torch.zeros(2, 2, 8), torch.zeros(3, 2, 8), torch.zeros(3, 2, 4))
    assert registry.PREFILL_ATTENTION.pays(*args) is False
    monkeypatch.setattr(registry, "TRITON_PREFILL_BY_DEFAULT", True)
    assert registry.PREFILL_ATTENTION.pays(*args) is True


@pytest.mark.parametrize(
    "rows, width, pays",
    [
        (1, 4096, True),
        (4, 4096, True),
        (5, 4096, False),
        (16, 1024, True),
        (16, 32768, True),
        (16, 2048, False),
    ],
)
def test_skinny_gemm_pays_at_few_rows_and_at_narrow_or_lm_head_widths(rows, width, pays):
    """The GEMV up to GEMV_MAX_ROWS rows at any width; the tile kernel only where it beat cuBLAS."""
    x, w = torch.zeros(rows, 8).half(), torch.zeros(width, 8).half()
    assert registry.SKINNY_LINEAR.pays(x, w) is pays


def test_a_kernel_whose_module_does_not_import_declines():
    missing = Kernel("missing", lambda x: None, Lazy("mlaserve.kernels.no_such_module", "run"))
    assert missing.choose(1) is None
    assert missing.why_not(1) == "mlaserve.kernels.no_such_module does not import"
    with pytest.raises(ImportError, match="no_such_module does not import"):
        missing.launch(1)


def test_an_ordered_table_takes_the_first_that_supports_and_pays():
    table = (
        Kernel("wide", lambda n: None if n > 8 else "takes n > 8", lambda n: "wide"),
        Kernel("even", lambda n: None, lambda n: "even", pays=lambda n: n % 2 == 0),
        Kernel("any", lambda n: None, lambda n: "any", pays=always),
    )
    assert [first(table, n).name for n in (9, 4, 3)] == ["wide", "even", "any"]
    with pytest.raises(LookupError):
        first(table[:2], 3)


def test_block_fp8_rules_name_what_they_cannot_take():
    """Block-FP8 linear layers: fp8 weights with a float32 scale per group_n x 128 block, 2-D x of a kernel
    dtype; fused MoE takes fp8 experts only with both scales, by keyword."""
    fp8 = torch.float8_e4m3fn
    x, w = torch.zeros(3, 300), torch.zeros(200, 300).to(fp8)
    why = registry.BLOCK_FP8_LINEAR.why_not
    assert why(x, w, torch.ones(2, 3), 128) == "needs CUDA tensors"
    assert why(x, w, torch.ones(200, 3), 1) == "needs CUDA tensors"
    assert "float8_e4m3fn weights" in why(x, w.half(), torch.ones(2, 3), 128)
    assert "2-D x" in why(x[None], w, torch.ones(2, 3), 128)
    assert "not torch.float64" in why(x.double(), w, torch.ones(2, 3), 128)
    assert "not 64" in why(x, w, torch.ones(4, 3), 64)
    assert "float32 (2, 3)" in why(x, w, torch.ones(2, 2), 128)
    assert "float32 (2, 3)" in why(x, w, torch.ones(2, 3).half(), 128)
    assert "bias" in why(x, w, torch.ones(2, 3), 128, torch.zeros(199))
    moe = registry.FUSED_MOE.why_not
    w13, w2 = torch.zeros(4, 160, 224).to(fp8), torch.zeros(4, 224, 80).to(fp8)
    s13, s2 = torch.ones(4, 2, 2), torch.ones(4, 2, 1)
    route = (torch.ones(3, 2), torch.zeros(3, 2, dtype=torch.long), None)
    assert moe(x, w13, w2, *route, w13_scale=s13, w2_scale=s2) == "needs CUDA tensors"
    assert moe(
        x, w13, w2, *route, w13_scale=torch.ones(4, 160, 2), w2_scale=torch.ones(4, 224, 1), group_n=1
    ) == ("needs CUDA tensors")
    assert "w13's float32 block scale" in moe(x, w13, w2, *route)
    assert "w2's scale as float32 (4, 2, 1)" in moe(x, w13, w2, *route, w13_scale=s13, w2_scale=s13)
    assert "both float8_e4m3fn" in moe(x, w13, w2.half(), *route, w13_scale=s13, w2_scale=s2)
    assert "with float8_e4m3fn weights only" in moe(x, w13.half(), w2.half(), *route, w13_scale=s13)


def test_the_layers_do_not_import_triton():
    """Every kernel module is imported on first use on CUDA: CPU runs never load triton."""
    code = (
        "import sys; import mlaserve.kernels.registry, mlaserve.models.deepseek, mlaserve.layers.mla; "
        "import mlaserve.layers.moe, mlaserve.layers.embedding, mlaserve.kernels.mla_decode.dispatch; "
        "assert 'triton' not in sys.modules, sorted(m for m in sys.modules if 'triton' in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
