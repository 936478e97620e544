"""Rejects lab notes in the package's comments and docstrings: commit hashes, paths of benchmark records, and
measured figures (times, bandwidths, rates, speedups).

Such notes go stale the day the code or the machine changes, and nothing checks them; the measurement belongs in
benchmarks/results with its command, cited from docs/performance.md and benchmarks/RESULTS.md. Comments say why the
code is as it is, not what it measured once.

    python .ci/check_comments.py [PATH ...]      (default: mlaserve/; exit 1 and one line per finding)

Only comments and docstrings are read (through tokenize): a figure in code or in a message string is the code's
business.
"""

from __future__ import annotations

import io
import re
import sys
import tokenize
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# A short or full git hash: lowercase hex, as git prints it, with a digit and a letter so that numbers ("1234567")
# and words ("deadbeef" has no digit, "decade" is too short) pass. 0x-prefixed constants are not words here; a
# range ("abc1234-def5678") or a dirty tree ("abc1234-dirty") still shows its hashes.
_HASH = re.compile(r"(?<![\w.])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?!\w)")

# Where records live, and record file names: a date or a machine name before .json/.txt (config.json passes).
_RESULT = re.compile(
    r"benchmarks/results|(?<![\w/])results/"
    r"|[\w.{},*\-]*\d{4}-\d{2}-\d{2}[\w.{},*\-]*\.(?:json|txt)\b"
    r"|\b(?:[hab]\d00|cpu|gpu)[-_][\w.{},*\-]*\.(?:json|txt)\b"
)

_NUMBER = r"\d[\d,]*(?:\.\d+)?"
_UNITS = r"[uµμn]s|ms|[KMGT]i?B/s|[GT]FLOP/?s|[GT]FLOPS|tok(?:ens?)?/s|req(?:uests?)?/s|it/s|ops/s"
# A number and a unit of time or rate ("0.087 ms", "4,237 GB/s", "336 tok/s", "1.2-3.4 us").
_FIGURE = re.compile(rf"(?<![\w.]){_NUMBER}(?:\s*-\s*{_NUMBER})?\s?(?:{_UNITS})(?![\w/])")
# Speedups: "2-3x faster", "x faster", "5-7% faster", "80% of copy", "1.42x", "1.4-1.6x" (the wordy forms first: the
# bare multiple would take their number and hide them).
_SPEEDUP = re.compile(
    rf"(?<![\w.]){_NUMBER}(?:\s*-\s*{_NUMBER})?\s*x\s+(?:faster|slower|speed-?up|as fast)\b"
    rf"|\bx\s+(?:faster|slower)\b"
    rf"|(?<![\w.]){_NUMBER}(?:%?\s*-\s*{_NUMBER})?\s*%\s+"
    rf"(?:faster|slower|speed-?up|quicker|of (?:the )?(?:copy|gemm|peak|roofline|ceiling|bandwidth))\b"
    rf"|(?<![\w.]){_NUMBER}(?:x?\s*-\s*{_NUMBER})?x(?!\w)",
    re.IGNORECASE,
)
# A bare multiple counts only with a fraction ("1.42x"): "2x" alone is as often a design factor ("2x the target
# splits") as a measurement.
_WHOLE_MULTIPLE = re.compile(r"^\d[\d,]*(?:x?\s*-\s*\d[\d,]*)?x$", re.IGNORECASE)

CHECKS: list[tuple[str, re.Pattern[str]]] = [
    ("commit hash", _HASH),
    ("result path", _RESULT),
    ("measured figure", _FIGURE),
    ("speedup", _SPEEDUP),
]


@dataclass(frozen=True, slots=True)
class Finding:
    path: str
    line: int
    kind: str
    text: str
    context: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.kind} {self.text!r}: {self.context}"


def prose(source: str) -> Iterator[tuple[int, str]]:
    """(first line, text) of every comment and docstring in `source`. A docstring here is any string statement
    that stands alone (module, class and function docstrings, and bare strings used as comments)."""
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    skip = {tokenize.NL, tokenize.COMMENT}
    statement_start = True  # after NEWLINE, INDENT, DEDENT or at the top: the next token begins a statement
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
        elif tok.type == tokenize.STRING and statement_start:
            j = i  # implicit concatenation: "a" "b" on one statement
            while j + 1 < len(tokens) and tokens[j + 1].type in (tokenize.STRING, *skip):
                j += 1
            if j + 1 == len(tokens) or tokens[j + 1].type in (tokenize.NEWLINE, tokenize.ENDMARKER):
                for k in range(i, j + 1):
                    if tokens[k].type == tokenize.STRING:
                        yield tokens[k].start[0], tokens[k].string
            i = j
        if tok.type not in skip:
            statement_start = tok.type in (
                tokenize.NEWLINE,
                tokenize.INDENT,
                tokenize.DEDENT,
                tokenize.ENCODING,
            )
        i += 1


def check_source(source: str, path: str) -> list[Finding]:
    findings = []
    for first_line, text in prose(source):
        lines = text.split("\n")
        for offset, line in enumerate(lines):
            for kind, pattern in CHECKS:
                for match in pattern.finditer(line):
                    found = match.group(0).strip()
                    if kind == "speedup" and _WHOLE_MULTIPLE.match(found):
                        continue
                    findings.append(Finding(path, first_line + offset, kind, found, line.strip()))
    return findings


def python_files(paths: list[Path]) -> Iterator[Path]:
    for path in paths:
        if path.is_dir():
            yield from sorted(p for p in path.rglob("*.py") if "__pycache__" not in p.parts)
        else:
            yield path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    root = Path(__file__).resolve().parent.parent
    paths = [Path(a) for a in args] or [root / "mlaserve"]
    findings: list[Finding] = []
    for file in python_files(paths):
        shown = file.resolve().relative_to(root) if file.resolve().is_relative_to(root) else file
        findings += check_source(file.read_text(encoding="utf-8"), str(shown))
    for finding in findings:
        print(finding)
    if findings:
        per_file = Counter(f.path for f in findings)
        print(
            f"\n{len(findings)} lab notes in {len(per_file)} files (comments say why; figures go to benchmarks/results):"
        )
        for path, count in per_file.most_common():
            print(f"  {count:4} {path}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
