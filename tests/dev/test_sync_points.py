"""dev/sync_points.py on the CPU (no sync mode there): every workload launches prompt-only,
prompt+decode and decode steps ahead, and a synchronizing call is named by its innermost mlaserve frame."""

import json
import sys
import traceback

from dev import sync_points


def test_the_workloads_launch_every_kind_of_step_ahead(tmp_path, monkeypatch):
    out = tmp_path / "sync.json"
    monkeypatch.setattr(sys, "argv", ["sync_points.py", str(out), "--cpu"])
    sync_points.main()
    rows = json.loads(out.read_text())["rows"]
    assert [r["workload"] for r in rows] == list(sync_points.WORKLOADS)
    for row in rows:
        assert {"prompt+decode", "decode"} <= set(row["launches_ahead"]), row
        assert row["launches_that_waited"] == {} and row["sync_sites"] == {}


def test_a_sync_is_named_by_the_innermost_mlaserve_frame():
    package = sync_points.PACKAGE
    stack = [
        traceback.FrameSummary("/x/bench.py", 3, "main", line="run()"),
        traceback.FrameSummary(f"{package}/runner/model_runner.py", 10, "launch", line="self._forward()"),
        traceback.FrameSummary(f"{package}/layers/sampler.py", 20, "_sample", line="t = torch.tensor(v)"),
        traceback.FrameSummary("/torch/_tensor.py", 5, "op", line="..."),
    ]
    assert sync_points.where(stack) == "mlaserve/layers/sampler.py:20 t = torch.tensor(v)"
