""".ci/check_comments.py: lab notes (commit hashes, record paths, measured figures) are refused in comments and
docstrings, and nothing else is read: code, message strings and plain numbers pass."""

import importlib.util
import sys
from pathlib import Path

import pytest

# .ci is no package (its name starts with a dot): the script is loaded from its path, and registered first because
# its dataclass looks its own module up while it is built.
SCRIPT = Path(__file__).resolve().parents[2] / ".ci" / "check_comments.py"
_spec = importlib.util.spec_from_file_location("check_comments", SCRIPT)
check_comments = importlib.util.module_from_spec(_spec)
sys.modules["check_comments"] = check_comments
_spec.loader.exec_module(check_comments)


def kinds(source: str) -> list[tuple[int, str, str]]:
    return [(f.line, f.kind, f.text) for f in check_comments.check_source(source, "x.py")]


@pytest.mark.parametrize(
    ("note", "kind", "text"),
    [
        ("# measured at 3e0922f on an H200", "commit hash", "3e0922f"),
        ("# the change (d38482f-e3972db) made it", "commit hash", "d38482f"),
        (
            "# a full one: 0123456789abcdef0123456789abcdef01234567",
            "commit hash",
            "0123456789abcdef0123456789abcdef01234567",
        ),
        ("# see benchmarks/results for the run", "result path", "benchmarks/results"),
        ("# (results/h200-diagnose.json)", "result path", "results/"),
        ("# in h200-sparse-2026-12-01.json", "result path", "h200-sparse-2026-12-01.json"),
        ("# serving-2026-12-01-c{1,8,32}.json", "result path", "serving-2026-12-01-c{1,8,32}.json"),
        ("# the split step took 0.087 ms", "measured figure", "0.087 ms"),
        ("# 114.8 us per layer", "measured figure", "114.8 us"),
        ("# 12 µs here", "measured figure", "12 µs"),
        ("# 4,237 GB/s of copy", "measured figure", "4,237 GB/s"),
        ("# 789 TFLOP/s dense", "measured figure", "789 TFLOP/s"),
        ("# batch 32 reached 2,572 tok/s", "measured figure", "2,572 tok/s"),
        ("# 53 req/s on the burst", "measured figure", "53 req/s"),
        ("# calls took 2-7 us longer", "measured figure", "2-7 us"),
        ("# fp8 at 0.599x the bf16 time", "speedup", "0.599x"),
        ("# integer operations took 1.4-1.6x its time", "speedup", "1.4-1.6x"),
        ("# it is 3x faster", "speedup", "3x faster"),
        ("# about 2 x faster", "speedup", "2 x faster"),
        ("# this was 5-7% faster", "speedup", "5-7% faster"),
        ("# 80.4% of copy", "speedup", "80.4% of copy"),
    ],
)
def test_a_lab_note_in_a_comment_is_found(note, kind, text):
    assert (1, kind, text) in kinds(note + "\nx = 1\n")


def test_docstrings_are_read_and_each_finding_has_its_own_line():
    source = '''"""Module.

Timed at 0.094 ms with the zeroing flush."""


class Plan:
    """A plan."""

    def split(self) -> int:
        """How many splits.

        Four were fastest (results/h200-x.json)."""
        return 4
'''
    assert kinds(source) == [
        (3, "measured figure", "0.094 ms"),
        (12, "result path", "results/"),
        (12, "result path", "h200-x.json"),
    ]


def test_a_bare_string_statement_counts_as_a_docstring():
    assert kinds('x = 1\n"made 1.42x faster at abc1234"\n') == [
        (2, "commit hash", "abc1234"),
        (2, "speedup", "1.42x faster"),
    ]


@pytest.mark.parametrize(
    "source",
    [
        'MESSAGE = "took 12 ms at abc1234 (results/h200.json), 1.5x faster"\n',  # a string value, not prose
        'log.info("%.3f ms", t)\n',
        '"{} ms".format(t)\n',  # a string statement that goes on: not a docstring
        "TIMEOUT_MS = 40  # milliseconds of a kept-alive connection\n",
        "# block 0 is the null block; ids 1234567 and 7654321 are plain numbers\n",
        "# 0xdeadbeef1 and 0x6400 are constants; deadbeef and facade are words\n",
        "# the tokenizer's config.json and tokenizer_config.json\n",
        "# 8x8 tiles, 576x576 weights, 2x the target splits, fp8_e4m3, sm_90a, e4m3\n",
        "# 5 s after the load drops; a 1e-5 tolerance; 6-12% of an e4m3 step\n",
        "# results are compared with the reference\n",
    ],
)
def test_code_and_plain_prose_pass(source):
    assert kinds(source) == []


def test_main_prints_file_line_and_text_and_fails_only_on_findings(tmp_path, capsys):
    clean = tmp_path / "clean.py"
    clean.write_text('"""Why the split count follows the grid."""\n\nSPLITS = 4\n')
    assert check_comments.main([str(clean)]) == 0
    assert capsys.readouterr().out == ""

    dirty = tmp_path / "pkg" / "dirty.py"
    dirty.parent.mkdir()
    dirty.write_text("x = 1\n# 0.3 ms at 6e5b0e8\n")
    assert check_comments.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"{dirty}:2: measured figure '0.3 ms': # 0.3 ms at 6e5b0e8" in out
    assert f"{dirty}:2: commit hash '6e5b0e8'" in out
    assert "2 lab notes in 1 files" in out
