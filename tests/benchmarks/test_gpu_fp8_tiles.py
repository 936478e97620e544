"""benchmarks/gpu_fp8_tiles.py's loop at tiny sizes on the CPU interpreter (one tile of each grid, the timer
stubbed): every configuration it times is checked against the default's output and comes out with a time, and the
fastest and the per-configuration totals are named."""

import pytest
import torch

pytest.importorskip("triton")

from benchmarks import gpu_fp8_tiles as section  # noqa: E402


def test_the_section_runs_at_tiny_sizes_on_cpu(monkeypatch, capsys):
    monkeypatch.setattr(section, "DENSE_TILES", ((64, 128, 4, 2),))
    monkeypatch.setattr(section, "MOE_TILES", ((64, 128, 4, 2),))
    clock = iter(range(1, 1000))
    report = section.fp8_tiles(
        lambda call, **options: float(next(clock)), device="cpu", dtype=torch.float32,
        dense_shapes=[("tiny", 80, 256)], rows=(40,), moe_shapes=[("tiny moe", 4, 256, 128, 2)], moe_tokens=(40,),
    )  # fmt: skip
    (dense,) = report["dense"]
    assert set(dense["configs"]) == {"bf16", "dequant_cublas", "default", "m64 g8 (64, 128, 4, 2)",
                                     "m128 g8 (64, 128, 4, 2)"}  # fmt: skip
    for config, result in dense["configs"].items():  # bf16 activations where the default quantizes them
        assert result["relative_error"] < (0.1 if config in ("bf16", "dequant_cublas") else 1e-3), (
            config,
            result,
        )
    (moe,) = report["moe"]
    assert {"default", "bf16", "m64 split (64, 128, 4, 2)", "m128 fused (64, 128, 4, 2)"} <= set(
        moe["configs"]
    )
    for config, result in moe["configs"].items():
        assert result["relative_error"] < (0.1 if config == "bf16" else 1e-3), (config, result)
    assert dense["fastest"] == "dequant_cublas" and moe["fastest"] == "default"  # the stub's clock only rises
    assert [name for name, _ in report["best"]["moe"]][0] == "default"
    assert "fp8_tiles" in capsys.readouterr().out
