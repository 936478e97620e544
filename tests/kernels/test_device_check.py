"""kernels/device_check.checked_once: a library GEMM's check runs once per (device, grouping) and its verdict,
good or bad, is what every later call gets."""

import torch

from mlaserve.kernels.device_check import checked_once


def test_each_device_and_grouping_is_checked_once_and_remembered() -> None:
    calls: list[tuple[torch.device, int]] = []

    def run(device: torch.device, group_n: int) -> str:
        calls.append((device, group_n))
        return "ok" if group_n == 128 else "failed: wrong answer"

    verdicts: dict[tuple[int, int], str] = {}
    for _ in range(3):
        assert checked_once(verdicts, torch.device("cuda", 0), 128, run) == "ok"
        assert checked_once(verdicts, torch.device("cuda", 0), 1, run) == "failed: wrong answer"
        assert checked_once(verdicts, torch.device("cuda", 1), 128, run) == "ok"
    assert calls == [
        (torch.device("cuda", 0), 128),
        (torch.device("cuda", 0), 1),
        (torch.device("cuda", 1), 128),
    ]
    assert verdicts == {(0, 128): "ok", (0, 1): "failed: wrong answer", (1, 128): "ok"}


def test_a_call_during_graph_capture_runs_no_check(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    verdicts: dict[tuple[int, int], str] = {}
    assert checked_once(verdicts, torch.device("cuda", 0), 128, lambda d, g: 1 / 0) == "unchecked"
    assert verdicts == {}
