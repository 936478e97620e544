"""The opt-in step trace (mlaserve/engine/step_trace.py) writes one line per event when asked and nothing
otherwise, and benchmarks/step_trace.py lines up a run's last step across the processes' files."""

from benchmarks import step_trace as reader
from mlaserve.engine import step_trace


def test_events_are_written_only_when_asked(tmp_path, monkeypatch):
    monkeypatch.setattr(step_trace, "_dir", None)
    monkeypatch.setattr(step_trace, "_file", None)
    step_trace.trace("core_sent")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(step_trace, "_dir", str(tmp_path))
    step_trace.trace("api_recv", 64, 2)
    step_trace._file.close()
    (line,) = next(tmp_path.iterdir()).read_text().splitlines()
    t, event, *fields = line.split()
    assert float(t) > 0 and event == "api_recv" and fields == ["64", "2"]


def test_the_reader_lines_up_the_last_step(tmp_path):
    core = []
    for i in range(4):  # steps of 10 ms; the last one finishes both requests and sends 5 ms late
        start = i * 0.010
        finished = 2 if i == 3 else 0
        sent = start + 0.009 + (0.005 if finished else 0)
        core += [f"{start} core_step_start", f"{start + 0.008} core_collected"]
        core += [f"{start + 0.0085} core_step_end 2 {finished}", f"{sent} core_sent"]
    (tmp_path / "trace-1.txt").write_text("\n".join(core) + "\n")
    final = 0.044
    (tmp_path / "trace-2.txt").write_text(
        f"{final + 0.0005} api_recv 2 2\n{final + 0.001} api_deliver 2 2\n"
        f"{final + 0.002} api_written 1\n{final + 0.004} api_written 1\n"
    )
    (tmp_path / "trace-3.txt").write_text(
        f"{final + 0.003} client_final {final + 0.003} {final - 0.012}\n"
        f"{final + 0.005} client_final {final + 0.005} {final - 0.012}\n"
    )
    lines = reader.report(tmp_path)
    assert "sent     0.00  outputs 2 finished 2" in lines[4]
    assert "median 10.00 ms" in lines[5]  # the steps before the last one, send to send
    assert lines[6] == "api trace-2: last deliver 1.00; finishing writes min 2.00 p50 4.00 max 4.00 (n 2)"
    assert lines[7] == "clients: last token min 3.00 p50 5.00 max 5.00 (n 2)"
    assert lines[8] == "clients: the token before it min -12.00 p50 -12.00 max -12.00 (n 2)"
