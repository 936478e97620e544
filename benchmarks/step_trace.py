"""Reads a MLASERVE_STEP_TRACE folder (mlaserve/engine/step_trace.py): where the last step of a run spent its time
on its way to the clients, against the steps before it.

    MLASERVE_STEP_TRACE=/tmp/t python -m benchmarks.serve_vs_offline ... ; python benchmarks/step_trace.py /tmp/t

Times are milliseconds from the core's send of the last step that finished requests (the run's end).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path


def read(folder: Path) -> dict[str, list[tuple[float, str, list[str]]]]:
    events = {}
    for path in sorted(folder.glob("trace-*.txt")):
        rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
        events[path.stem] = [(float(r[0]), r[1], r[2:]) for r in rows]
    return events


def core_steps(events: list[tuple[float, str, list[str]]]) -> list[dict]:
    """One dict per step: start, collected, end, sent (seconds), outputs and finished counts."""
    steps, current = [], {}
    for t, kind, fields in events:
        if kind == "core_step_start":
            current = {"start": t}
        elif kind == "core_collected":
            current.setdefault("collected", t)
        elif kind == "core_step_end":
            current.update(end=t, outputs=int(fields[0]), finished=int(fields[1]))
        elif kind == "core_sent" and "end" in current:
            current["sent"] = t
            steps.append(current)
            current = {}
    return steps


def spread(values: list[float]) -> str:
    if not values:
        return "none"
    values = sorted(values)
    return f"min {values[0]:.2f} p50 {values[len(values) // 2]:.2f} max {values[-1]:.2f} (n {len(values)})"


def report(folder: Path, window_s: float = 0.2) -> list[str]:
    events = read(folder)
    cores = [name for name, ev in events.items() if any(kind == "core_sent" for _, kind, _ in ev)]
    if len(cores) != 1:
        raise SystemExit(f"{folder}: expected one engine core's trace, found {len(cores)}")
    steps = core_steps(events[cores[0]])
    last = max((i for i, s in enumerate(steps) if s["finished"]), default=None)
    if last is None:
        raise SystemExit(f"{folder}: no step finished a request")
    t0 = steps[last]["sent"]
    ms = lambda t: (t - t0) * 1e3  # noqa: E731
    lines = [f"core {cores[0]}: the last steps (ms from the final send)"]
    for s in steps[max(0, last - 4) : last + 1]:
        lines.append(
            f"  start {ms(s['start']):8.2f}  collected {ms(s.get('collected', s['end'])):8.2f}  end {ms(s['end']):8.2f}"
            f"  sent {ms(s['sent']):8.2f}  outputs {s['outputs']} finished {s['finished']}"
        )
    intervals = [
        (b["sent"] - a["sent"]) * 1e3 for a, b in zip(steps, steps[1:]) if b["outputs"] == a["outputs"]
    ]
    if intervals:
        lines.append(
            f"  send-to-send interval of steps of equal size: median {statistics.median(intervals):.2f} ms"
        )
    for name, ev in events.items():
        near = [(t, kind, f) for t, kind, f in ev if abs(t - t0) <= window_s]
        delivers = [t for t, kind, f in near if kind == "api_deliver"]
        if delivers:
            finals = [ms(t) for t, kind, f in near if kind == "api_written" and f == ["1"]]
            lines.append(
                f"api {name}: last deliver {ms(delivers[-1]):.2f}; finishing writes {spread(finals)}"
            )
    client_last, client_prev = [], []
    for ev in events.values():
        for t, kind, f in ev:
            if kind == "client_final" and abs(t - t0) <= window_s:
                client_last.append(ms(float(f[0])))
                client_prev.append(ms(float(f[1])))
    lines.append(f"clients: last token {spread(client_last)}")
    lines.append(f"clients: the token before it {spread(client_prev)}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folder", type=Path)
    parser.add_argument(
        "--window-s", type=float, default=0.2, help="events this close to the final send count"
    )
    args = parser.parse_args()
    print("\n".join(report(args.folder, args.window_s)))


if __name__ == "__main__":
    main()
