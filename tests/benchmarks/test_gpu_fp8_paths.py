"""benchmarks/gpu_fp8_paths.py's CPU-checkable parts: the paths it forces exist in the tables it measures, a path
is checked against its reference (and one that raises is kept with its error), and the winners per row count turn
into the thresholds the tables take."""

import pytest
import torch

pytest.importorskip("triton")

from benchmarks import gpu_fp8_paths as section  # noqa: E402
from mlaserve.kernels.block_fp8 import DENSE_PATHS  # noqa: E402
from mlaserve.kernels.moe.dispatch import MOE_KERNELS  # noqa: E402
from mlaserve.layers.block_fp8 import linear_reference, quantize  # noqa: E402


def test_the_forced_paths_are_the_tables_own():
    assert set(section.OUR_DENSE_PATHS) - {"w8a8_fused_quant"} | {"flashinfer_blockscale"} == set(DENSE_PATHS)
    assert set(section.DENSE_FP8_PATHS) == {*section.OUR_DENSE_PATHS, *section.PEER_PATHS}
    assert not set(section.PEER_PATHS) & set(section.OUR_DENSE_PATHS)
    assert {"pair_tiles", "sorted_tiles", "fp8_w8a8_tiles"} <= {k.name for k in MOE_KERNELS}


@pytest.mark.parametrize("path", ["w8a8", "w8a8_fused_quant", "dequant_cublas", "torch_blockwise"])
def test_a_path_is_checked_then_timed_or_kept_with_its_error(path):
    gen = torch.Generator().manual_seed(0)
    w, s = quantize(torch.randn(80, 256, generator=gen) / 16)
    x = torch.randn(20, 256, generator=gen)
    want = linear_reference(x, w, s, 128, quantize_activations=path in section.W8A8_KINDS)
    result = section.measure(section._dense_call(path, x, w, s), want, lambda call: 1.5)
    if path == "torch_blockwise":  # CPU: declined with the reason, never run
        assert result == {
            "error": "ValueError: block_fp8_linear: torch_blockwise cannot take this call: needs a CUDA device"
        }
    else:
        assert result["ms"] == 1.5 and result["relative_error"] < 1e-3


def test_winners_become_thresholds():
    def row(rows: int, winner: str) -> dict:
        return {"rows": rows, "fastest": winner}

    dense = [row(1, "w8a16"), row(1, "w8a16"), row(16, "w8a16"), row(16, "w8a8"), row(32, "w8a8"),
             row(512, "torch_blockwise"), row(4096, "torch_blockwise"), row(4096, "torch_blockwise"),
             row(4096, "w8a8"), row(64, None)]  # fmt: skip
    winners = section.winners_by_rows(dense, "rows")
    assert winners[4096] == {"torch_blockwise": 2, "w8a8": 1} and 64 not in winners
    moe = [
        {"pairs_per_expert": p, "fastest_fp8": f}
        for p, f in ((1, "fp8_w8a16"), (60, "fp8_w8a8"), (500, "fp8_w8a8"))
    ]
    suggested = section.suggestions(winners, moe)
    assert suggested["W8A16_MAX_ROWS"] == 1  # a tie at 16 rows is no majority
    assert suggested["TORCH_BLOCKWISE_MIN_ROWS"] == 512
    assert suggested["DEQUANT_MIN_ROWS"] is None and suggested["FLASHINFER_MIN_ROWS"] is None
    assert suggested["flashinfer_won_most_at_rows"] == []
    band = section.winners_by_rows([row(32, "flashinfer_blockscale"), row(512, "flashinfer_blockscale"),
                                    row(4096, "w8a8")], "rows")  # fmt: skip
    assert section.suggestions(band, moe)["flashinfer_won_most_at_rows"] == [32, 512]
    assert suggested["W8A8_PAIRS_PER_EXPERT"] == 60


def test_only_paths_near_their_reference_can_be_fastest():
    paths = {"w8a8": {"ms": 1.0, "relative_error": 0.5}, "w8a16": {"ms": 2.0, "relative_error": 0.01},
             "torch_blockwise": {"error": "RuntimeError: no"}, "bf16": {"ms": 0.1, "relative_error": 0.0}}  # fmt: skip
    assert section.fastest(paths, section.DENSE_FP8_PATHS) == "w8a16"
    assert section.fastest({}, section.DENSE_FP8_PATHS) is None


def test_a_peer_is_compared_with_the_fastest_of_ours():
    paths = {"w8a8": {"ms": 2.0, "relative_error": 0.01}, "torch_blockwise": {"ms": 1.0, "relative_error": 0.5},
             "flashinfer_blockscale": {"ms": 0.5, "relative_error": 0.01}}  # fmt: skip
    assert section.peer_over_ours(paths) == {"flashinfer_blockscale": 4.0}  # torch_blockwise is too far off
    assert section.fastest(paths, section.DENSE_FP8_PATHS) == "flashinfer_blockscale"
    paths["flashinfer_blockscale"] = {
        "error": "ValueError: block_fp8_linear: flashinfer_blockscale cannot ..."
    }
    assert section.peer_over_ours(paths) == {}
    assert section.peer_over_ours({"flashinfer_blockscale": {"ms": 0.5, "relative_error": 0.0}}) == {}


def test_an_unavailable_peer_is_recorded_with_its_reason(monkeypatch):
    from benchmarks import fp8_peers
    from mlaserve.kernels import fp8_flashinfer

    def no_deep_gemm(name: str) -> None:
        raise ModuleNotFoundError(f"No module named '{name}'")

    monkeypatch.setattr(
        fp8_flashinfer, "_IMPORTED", {"gemm": "FlashInfer does not import: ModuleNotFoundError"}
    )
    monkeypatch.setattr(fp8_peers.importlib, "import_module", no_deep_gemm)
    assert fp8_peers.peer_checks(torch.device("cpu")) == {
        "flashinfer_blockscale": "unavailable: FlashInfer does not import: ModuleNotFoundError",
        "deep_gemm_fp8": "unavailable: ModuleNotFoundError: No module named 'deep_gemm'",
    }


def test_the_whole_section_runs_at_tiny_sizes_on_cpu(capsys):
    """Every dense and MoE path through the section's own loop (float32 under the interpreter; torch's blockwise
    GEMM declines on CPU and is kept with its reason), the timer stubbed: rows, winners and suggestions come out."""
    timed = []

    def bench_graph(call, **options: float) -> float:
        timed.append(options)
        return 1.0 + len(timed) % 3

    report = section.fp8_paths(
        {"copy_GBps": 1000.0}, bench_graph, device="cpu", dtype=torch.float32,
        dense_shapes=[("tiny", 80, 256)], path_rows=(1, 20),
        moe_shapes=[("tiny moe", 4, 256, 128, 2)], moe_tokens=(1, 40),
    )  # fmt: skip
    assert report["torch_blockwise_check"] == {"skipped": "not CUDA"}
    assert [r["rows"] for r in report["dense"]] == [1, 20]
    one, twenty = report["dense"]
    assert set(one["paths"]) == set(twenty["paths"]) == {"bf16", *section.DENSE_FP8_PATHS}
    assert (one["table"], twenty["table"]) == ("w8a16", "w8a8")
    assert "needs a CUDA device" in one["paths"]["torch_blockwise"]["error"]
    assert report["peers"] == {
        "flashinfer_blockscale": "skipped: not CUDA",
        "deep_gemm_fp8": "skipped: not CUDA",
    }
    assert report["peer_wins_by_rows"] == {"flashinfer_blockscale": {}, "deep_gemm_fp8": {}}
    for row in report["dense"]:  # the peers' rows say why they did not run, and nothing is compared with them
        assert row["paths"]["flashinfer_blockscale"] == {
            "error": "ValueError: block_fp8_linear: flashinfer_blockscale cannot take this call: needs a CUDA device"
        }
        assert row["paths"]["deep_gemm_fp8"] == {
            "error": "ValueError: deep_gemm_fp8: needs bf16 x on a CUDA device, not torch.float32 on cpu"
        }
        assert row["peer_over_ours"] == {} and row["fastest_ours"] == row["fastest"]
    for row in report["dense"]:
        for path, result in row["paths"].items():
            assert "error" in result or result["relative_error"] < 1e-3, (row["rows"], path, result)
        assert row["fastest"] in section.DENSE_FP8_PATHS
    assert [r["tokens"] for r in report["moe"]] == [1, 40]
    for row in report["moe"]:
        assert set(row["paths"]) == set(section.MOE_PATHS) and row["checked_against"] == "reference"
        for path, result in row["paths"].items():
            assert result["relative_error"] < 1e-3, (row["tokens"], path, result)
    assert set(report["suggested"]) >= {"W8A16_MAX_ROWS", "W8A8_PAIRS_PER_EXPERT"}
    assert all(options == section.TIMING for options in timed)
    assert "fp8_paths suggested" in capsys.readouterr().out
