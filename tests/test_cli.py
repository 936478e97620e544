"""The command line on a tiny model: generate prints one completion per prompt; chat streams and keeps history."""

import io
import json

import pytest

from mlaserve.cli import main
from mlaserve.testing.tiny_models import build_tiny


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


def test_generate_reads_prompt_file_and_keeps_prompts_and_completions_apart(model_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w3 w4\n\nw10\n")
    assert (
        main(["generate", "--prompt-file", str(prompts), "--model", str(model_dir), "--max-tokens", "3"]) == 0
    )
    out = capsys.readouterr().out
    blocks = out.strip().split("\n\n")
    assert len(blocks) == 2
    for number, (block, prompt) in enumerate(zip(blocks, ["w3 w4", "w10"]), 1):
        lines = block.splitlines()
        assert lines[0] == f"### prompt {number}" and lines[1] == prompt
        assert lines[2].startswith(f"### completion {number} (")


@pytest.mark.slow
def test_a_completion_with_newlines_stays_inside_its_block(capsys):
    code = main(
        ["generate", "def fibonacci(n):", "Name a color.", "--max-tokens", "24", "--dtype", "float32"]
    )
    assert code == 0
    out = capsys.readouterr().out
    first, second = out.split("### prompt 2\n")
    assert first.startswith("### prompt 1\ndef fibonacci(n):\n### completion 1 (")
    assert "\n" in first.split("### completion 1", 1)[1].strip()  # code spans lines, still in block 1
    assert second.startswith("Name a color.\n### completion 2 (")


@pytest.mark.slow
def test_export_tokenizer_writes_a_folder_transformers_loads(tmp_path, capsys):
    from transformers import AutoTokenizer

    from mlaserve.loader.model_files import resolve_model
    from mlaserve.loader.tokenizer import load_tokenizer

    assert main(["export-tokenizer", str(tmp_path / "tok")]) == 0
    ours = load_tokenizer(resolve_model(None, need_weights=False))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    for text in (
        "The capital of France is Paris.",
        "def f(x):\n    return x  # ünïcode 123",
        "<|im_start|>user",
    ):
        assert theirs.encode(text) == ours.encode(text)
    messages = [{"role": "user", "content": "Hi"}]
    assert theirs.apply_chat_template(messages, tokenize=False) == ours.apply_chat_template(
        messages, tokenize=False
    )
    assert theirs.eos_token == ours.eos_token


def test_generate_reports_bad_input(model_dir, capsys):
    assert main(["generate", "w3", "--model", str(model_dir), "--top-p", "2"]) == 2
    assert "top_p" in capsys.readouterr().err
    assert main(["generate", "w3", "--model", "/no/such/model"]) == 2
    assert "/no/such/model" in capsys.readouterr().err


def test_chat_needs_a_template(model_dir, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main(["chat", "--model", str(model_dir), "--max-tokens", "3"]) == 2
    assert "chat template" in capsys.readouterr().err


@pytest.mark.slow
def test_chat_streams_with_the_smollm2_template(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?\n\n"))
    assert main(["chat", "--max-tokens", "24", "--dtype", "float32"]) == 0
    assert "Paris" in capsys.readouterr().out
