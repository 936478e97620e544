"""benchmarks/diagnose/ncu_stalls.py's parsing of Nsight Compute output, on small hand-made samples of its two
formats."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks" / "diagnose"))
import ncu_stalls  # noqa: E402

SECTIONS = """
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    SM Frequency                    Ghz         1.32
    Duration                         us       231.62
    Section: Scheduler Statistics
    Issued Warp Per Scheduler                        0.43
    Eligible Warps Per Scheduler        warp         0.56
"""
HEAD = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_wait",
        "stall_barrier", "stall_wait (Not Issued)"]  # fmt: skip
ROWS = [["0x1", "  FADD R1, R2, R3", "6", "100", "6", "0", "6"],
        ["0x2", "  WARPGROUP.DEPBAR.LE gsb0, 0x0", "10", "100", "1", "9", "1"],
        ["0x3", "  EXIT", "", "100", "", "", ""]]  # fmt: skip


def test_metrics_are_read_from_the_section_tables() -> None:
    assert ncu_stalls.metric(SECTIONS, "Duration") == 231.62
    assert ncu_stalls.metric(SECTIONS, "Issued Warp Per Scheduler") == 0.43
    assert ncu_stalls.metric(SECTIONS, "Eligible Warps Per Scheduler") == 0.56
    assert ncu_stalls.metric(SECTIONS, "DRAM Throughput") is None


def test_stall_shares_and_hot_instructions() -> None:
    quote = lambda row: ",".join(f'"{cell}"' for cell in row)  # noqa: E731
    csv_text = "==PROF== Connected\n" + "\n".join(
        [quote(["Kernel Name", "stage1_fp8"]), quote(HEAD), *map(quote, ROWS)]
    )
    summary = ncu_stalls.summarize(csv_text, top=2)
    assert summary["kernel"] == "stage1_fp8" and summary["samples"] == 16
    assert summary["stall_shares"] == {
        "barrier": 9 / 16,
        "wait": 7 / 16,
    }  # "Not Issued" columns are not counted
    assert [row["sass"] for row in summary["top_instructions"]] == [
        "WARPGROUP.DEPBAR.LE gsb0, 0x0",
        "FADD R1, R2, R3",
    ]
    assert summary["top_instructions"][0]["reasons"] == {"barrier": 9, "wait": 1}
