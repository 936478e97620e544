"""benchmarks/serving.py: its statistics on synthetic timings, a run against a stand-in server, and (once
`mlaserve serve` exists) one --launch run against a tiny model."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.benchmarks.fake_openai_server import TOKEN_DELAY_S, running_fake_server

REPO = Path(__file__).resolve().parents[2]


def _load_serving():
    spec = importlib.util.spec_from_file_location("benchmarks_serving", REPO / "benchmarks" / "serving.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building the class
    spec.loader.exec_module(module)
    return module


serving = _load_serving()


def test_percentile_interpolates_between_ranks() -> None:
    assert serving.percentile([], 50) is None
    assert serving.percentile([7.0], 99) == 7.0
    assert serving.percentile([5, 1, 4, 2, 3], 50) == 3
    assert serving.percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert serving.percentile([1, 2, 3, 4], 0) == 1 and serving.percentile([1, 2, 3, 4], 100) == 4


def test_request_timings_ttft_tpot_itl() -> None:
    ttft, tpot, itls = serving.request_timings(10.0, [10.1, 10.15, 10.3], 10.3, output_tokens=3)
    assert ttft == pytest.approx(0.1)
    assert tpot == pytest.approx((0.3 - 0.1) / 2)  # (e2e - ttft) / (tokens - 1)
    assert itls == pytest.approx([0.05, 0.15])
    # more tokens than chunks (a chunk may carry several tokens): TPOT uses the token count
    assert serving.request_timings(0.0, [0.1, 0.5], 0.5, output_tokens=5)[1] == pytest.approx(0.1)
    assert serving.request_timings(0.0, [0.2], 0.2, output_tokens=1) == (pytest.approx(0.2), None, [])
    assert serving.request_timings(0.0, [], 0.2, output_tokens=0) == (None, None, [])


def test_summarize_counts_failures_and_throughput() -> None:
    ok = serving.RequestRecord(
        ok=True, ttft=0.1, e2e=0.5, tpot=0.1, output_tokens=5, prompt_tokens=8, itls=[0.9] + [0.1] * 3
    )
    ok2 = serving.RequestRecord(
        ok=True, ttft=0.3, e2e=0.7, tpot=0.1, output_tokens=5, prompt_tokens=12, itls=[0.1]
    )
    bad = serving.RequestRecord(ok=False, error="HTTP 429: busy")
    summary = serving.summarize([ok, ok2, bad], duration_s=2.0)
    assert (summary["requests_completed"], summary["requests_failed"]) == (2, 1)
    assert summary["request_throughput_rps"] == 1.0 and summary["output_token_throughput_tps"] == 5.0
    assert summary["ttft_s"]["p50"] == pytest.approx(0.2) and summary["ttft_s"]["mean"] == pytest.approx(0.2)
    assert summary["itl_s"]["p99"] == pytest.approx(0.9 - 0.04 * 0.8)  # a long first gap: p99 near it
    assert summary["itl_after_first_s"]["p99"] == pytest.approx(0.1)  # without first gaps: the steady ones
    assert summary["itl_top_percent"] == {"1": [1, 0.9, 0.9]}  # 5 gaps: the top one, each request's first gap
    assert summary["itl_last_s"]["p50"] == pytest.approx(0.1)  # each request's last gap (ok2's only one)
    assert summary["mean_prompt_tokens"] == 10
    assert summary["errors"] == ["HTTP 429: busy"]


def test_only_loopback_urls_are_accepted() -> None:
    assert serving.is_loopback("http://127.0.0.1:8000/v1") and serving.is_loopback("http://localhost:1/v1")
    assert serving.is_loopback("http://[::1]:8000/v1") and serving.is_loopback("http://127.8.0.1/v1")
    assert not serving.is_loopback("http://10.0.0.5:8000/v1") and not serving.is_loopback(
        "https://api.openai.com/v1"
    )
    with pytest.raises(SystemExit):
        serving.parse_args(["--base-url", "http://example.com/v1"])


def test_run_against_stand_in_server(tmp_path: Path) -> None:
    output = tmp_path / "result.json"
    with running_fake_server() as base_url:
        argv = ["--base-url", base_url, "--concurrency", "2", "--num-prompts", "4", "--max-tokens", "5"]
        assert serving.main([*argv, "--prompt-len", "6", "--output", str(output)]) == 0
    result = json.loads(output.read_text())
    summary = result["summary"]
    assert summary["requests_completed"] == 4 and summary["total_output_tokens"] == 20
    assert summary["mean_prompt_tokens"] == 8  # "Request i:" + 6 words
    assert summary["itl_s"]["p50"] >= TOKEN_DELAY_S * 0.8 and summary["ttft_s"]["p50"] >= TOKEN_DELAY_S * 0.8
    assert summary["tpot_s"]["p50"] == pytest.approx(TOKEN_DELAY_S, rel=1.0)
    assert result["server_models"]["data"][0]["id"] == "fake-model"
    assert result["command"].startswith("python benchmarks/serving.py --base-url") and "date" in result
    assert len(result["requests"]) == 4


def test_client_processes_share_the_load_and_their_records_merge(tmp_path: Path) -> None:
    """--client-processes 2: every request is sent once, by one of two processes that start together."""
    import subprocess

    output = tmp_path / "result.json"
    with running_fake_server() as base_url:
        argv = ["--base-url", base_url, "--concurrency", "4", "--num-prompts", "6", "--max-tokens", "5"]
        argv += ["--client-processes", "2", "--output", str(output)]
        done = subprocess.run([sys.executable, "benchmarks/serving.py", *argv], cwd=REPO, capture_output=True)
        assert done.returncode == 0, done.stderr.decode()
    result = json.loads(output.read_text())
    summary = result["summary"]
    assert summary["requests_completed"] == 6 and summary["total_output_tokens"] == 30
    assert summary["duration_s"] < 10 and summary["ttft_s"]["p50"] >= TOKEN_DELAY_S * 0.8
    assert sorted(r["start"] for r in result["requests"])[-1] < summary["duration_s"]


def test_max_duration_bounds_the_run(tmp_path: Path) -> None:
    output = tmp_path / "result.json"
    with running_fake_server() as base_url:
        argv = ["--base-url", base_url, "--concurrency", "1", "--num-prompts", "50", "--max-tokens", "20"]
        serving.main([*argv, "--max-duration-s", "0.5", "--output", str(output)])
    summary = json.loads(output.read_text())["summary"]
    assert summary["duration_s"] < 2.0 and summary["requests_completed"] < 50
    assert summary["requests_completed"] + summary["requests_failed"] == 50


def _serve_exists() -> bool:
    return importlib.util.find_spec("mlaserve.server.run") is not None


@pytest.mark.skipif(not _serve_exists(), reason="`mlaserve serve` is not built yet")
@pytest.mark.slow
def test_launch_against_tiny_model(tmp_path: Path) -> None:
    from mlaserve.testing.tiny_models import build_tiny

    model = build_tiny("llama", tmp_path / "tiny-llama")
    output = tmp_path / "result.json"
    argv = [
        "--launch",
        "--model",
        str(model),
        "--concurrency",
        "2",
        "--num-prompts",
        "4",
        "--max-tokens",
        "8",
    ]
    # the word-salad prompts are unknown words to the tiny tokenizer; greedy then tends to emit special tokens,
    # which decode to no text and so stream no chunks: sample instead
    argv += ["--temperature", "1.0", "--launch-timeout-s", "180", "--output", str(output)]
    assert serving.main(argv) == 0
    result = json.loads(output.read_text())
    assert result["summary"]["requests_completed"] == 4 and result["summary"]["requests_failed"] == 0
    assert result["summary"]["total_output_tokens"] == 32 and result["summary"]["ttft_s"]["p50"] is not None
    assert result["server_models"]["data"][0]["id"] == "tiny-llama" and result["server_log_head"]


def test_the_largest_gaps_are_counted_by_their_place_in_the_stream() -> None:
    slow_second = [0.01, 0.5] + [0.01] * 98  # its second gap is the slowest of all
    slow_late = [0.01] * 20 + [0.3, 0.2] + [0.01] * 78
    records = [
        serving.RequestRecord(ok=True, itls=gaps, output_tokens=101) for gaps in (slow_second, slow_late)
    ]
    top = serving.summarize(records, duration_s=1.0)["itl_top_percent"]  # 200 gaps: the top 2
    assert top == {"2": [1, 0.5, 0.5], "11+": [1, 0.3, 0.3], "11+ at": [[0.5, 1]]}  # ended at 20 x 0.01 + 0.3


def test_the_client_writes_its_step_trace_line_only_when_asked(tmp_path, monkeypatch):
    monkeypatch.delenv("MLASERVE_STEP_TRACE", raising=False)
    monkeypatch.setattr(serving, "_trace_file", [])
    serving.step_trace("client_final", 1.5, 1.25)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("MLASERVE_STEP_TRACE", str(tmp_path))  # set after import, as serve_vs_offline.py does
    serving.step_trace("client_final", 1.5, 1.25)
    serving._trace_file[0].close()
    (line,) = next(tmp_path.iterdir()).read_text().splitlines()
    assert line.split()[1:] == ["client_final", "1.5", "1.25"]
