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
        "per_head": (torch.zeros(1, 2, 8).half(), torch.zeros(2, 4, 8).half()),
        "skinny_linear": (x.half(), w.half()),
        "gate_logits": (x, w),
        "route_greedy": (torch.zeros(2, 4), None, 2, True, 1.0),
        "fused_moe": (x, torch.zeros(3, 8, 8), torch.zeros(3, 8, 4), torch.ones(2, 1), torch.zeros(2, 1)),
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


def test_the_layers_do_not_import_triton():
    """Every kernel module is imported on first use on CUDA: CPU runs never load triton."""
    code = (
        "import sys; import mlaserve.kernels.registry, mlaserve.models.deepseek, mlaserve.layers.mla; "
        "import mlaserve.layers.moe, mlaserve.layers.embedding, mlaserve.kernels.mla_decode.dispatch; "
        "assert 'triton' not in sys.modules, sorted(m for m in sys.modules if 'triton' in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
