"""The command line on a tiny model: generate prints one completion per prompt; chat streams and keeps history."""

import io
import json

import pytest

from mlaserve.cli import main
from tests.tiny_models import build_tiny


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny("llama", tmp_path_factory.mktemp("cli"))


def test_generate_prints_json_lines(model_dir, capsys):
    code = main(
        [
            "generate",
            "w5 w6",
            "w7 w8 w9",
            "--model",
            str(model_dir),
            "--max-tokens",
            "5",
            "--json",
            "--device",
            "cpu",
        ]
    )
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [r["prompt"] for r in lines] == ["w5 w6", "w7 w8 w9"]
    assert all(r["finish_reason"] in ("stop", "length") for r in lines)


def test_generate_reads_prompt_file(model_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w3 w4\n\nw10\n")
    assert (
        main(["generate", "--prompt-file", str(prompts), "--model", str(model_dir), "--max-tokens", "3"]) == 0
    )
    assert (
        len(capsys.readouterr().out.strip().splitlines()) <= 2 * 3
    )  # two completions, words joined by spaces


def test_generate_reports_bad_input(model_dir, capsys):
    assert main(["generate", "w3", "--model", str(model_dir), "--top-p", "2"]) == 2
    assert "top_p" in capsys.readouterr().err
    assert main(["generate", "w3", "--model", "/no/such/model"]) == 2
    assert "/no/such/model" in capsys.readouterr().err


def test_chat_needs_a_template(model_dir, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main(["chat", "--model", str(model_dir), "--max-tokens", "3"]) == 2
    assert "chat template" in capsys.readouterr().err


def test_chat_streams_with_the_smollm2_template(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?\n\n"))
    assert main(["chat", "--max-tokens", "24", "--dtype", "float32"]) == 0
    assert "Paris" in capsys.readouterr().out
