"""Offline generation throughput: mlaserve's LLM.generate against transformers' generate, side by side.

Both systems load the same model, get the same token ids (every prompt cut to exactly --prompt-len tokens, so
transformers needs no padding) and produce exactly --new-tokens tokens per prompt, greedily. Wall time covers
prefill and decode of the whole batch; after one warm-up call each, the timed runs alternate between the two
systems so that noise on a shared machine hits both alike. The medians give output tokens/s and the ratio.

    python benchmarks/offline_throughput.py                      # SmolLM2-135M GGUF, batch 16, 64 new tokens
    python benchmarks/offline_throughput.py --skip-hf --repeats 5
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from mlaserve import LLM, SamplingParams
from mlaserve.loader.model_files import default_model_path

# Where the record goes and which tree git describes: the checkout this file is in.
REPO_ROOT = Path(__file__).resolve().parent.parent

# Varied on purpose (topics, lengths, punctuation, numbers) so rows tokenize differently and greedy decoding
# takes different paths; row i starts at sentence i and wraps around.
SENTENCES = (
    "The old lighthouse keeper climbed the spiral stairs every evening to light the lamp.",
    "Photosynthesis converts sunlight, water and carbon dioxide into glucose and oxygen.",
    "In 1969, two astronauts walked on the Moon while a third orbited above them.",
    "A good sourdough starter needs flour, water, patience and a warm kitchen.",
    "Why do cats knock things off tables when they know you are watching?",
    "The committee postponed its vote until the budget figures were checked again.",
    "Rivers carve valleys slowly, grain by grain, over thousands of years.",
    "Please write a short poem about a city waking up in the rain.",
    "Compilers translate source code into machine instructions that a processor can run.",
    "She packed three books, a compass and a thermos of tea for the long hike.",
    "Explain the difference between a virus and a bacterium in simple terms.",
    "The orchestra tuned their instruments as the audience slowly took their seats.",
    "Interest rates rose by half a percent, and mortgage applications fell sharply.",
    "Honeybees communicate the location of flowers through a dance called the waggle dance.",
    "What are three practical ways to reduce food waste at home?",
    "The museum's new wing displays fossils found along the northern coast.",
)
AGREE_TOKENS = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    today = dt.date.today().isoformat()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        default=None,
        help="HF folder or .gguf file (default: the SmolLM2 GGUF); 'tiny-llama': the tests' random Llama "
        "(mlaserve/testing/tiny_models.py) at hidden 256, 8 heads, 4 KV heads, 4 layers",
    )
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt, exactly")
    parser.add_argument(
        "--prompt-format",
        choices=("plain", "chat"),
        default="plain",
        help="plain sentences, or wrapped in the model's chat template (SmolLM2's adds ~25 tokens)",
    )
    parser.add_argument("--dtype", choices=("float32",), default="float32")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs per system; the median is reported"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument(
        "--prefix-caching",
        action="store_true",
        help="keep mlaserve's prefix cache on (off by default: repeats would reuse the warm-up's prefill)",
    )
    parser.add_argument(
        "--output", default=str(REPO_ROOT / "benchmarks" / "results" / f"offline_throughput-{today}.json")
    )
    parser.add_argument("--skip-hf", action="store_true", help="time mlaserve only")
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="mlaserve's ranks (processes on this machine)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after timing, profile one call of each system (torch.profiler)",
    )
    args = parser.parse_args(argv)
    for name in ("batch_size", "new_tokens", "prompt_len", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def build_prompts(tokenizer, batch_size: int, prompt_len: int, prompt_format: str) -> list[list[int]]:
    """batch_size rows of exactly prompt_len token ids; chat rows keep the template's head and tail whole."""
    head: list[int] = []
    tail: list[int] = []
    if prompt_format == "chat":
        if not getattr(tokenizer, "chat_template", None):
            raise SystemExit("--prompt-format chat: this model's tokenizer has no chat template")
        marker = "\u2063MARK\u2063"
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": marker}], add_generation_prompt=True, tokenize=False
        )
        before, after = text.split(marker)
        head = tokenizer.encode(before, add_special_tokens=False)
        tail = tokenizer.encode(after, add_special_tokens=False)
        if len(head) + len(tail) >= prompt_len:
            raise SystemExit(
                f"--prompt-len {prompt_len} leaves no room for content: the chat template alone takes "
                f"{len(head) + len(tail)} tokens; raise --prompt-len or use --prompt-format plain"
            )
    want = prompt_len - len(head) - len(tail)
    rows = []
    for row in range(batch_size):
        content: list[int] = []
        k = row
        while len(content) < want:
            sentence = SENTENCES[k % len(SENTENCES)]
            content += tokenizer.encode(sentence if not content else " " + sentence, add_special_tokens=False)
            k += 1
        rows.append(head + content[:want] + tail)
    return rows


def git_state() -> tuple[str | None, bool | None]:
    """(short commit, whether tracked files differ from it: the figures may come from uncommitted code)."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None, None
    return commit, bool(status.strip())


class OursRunner:
    def __init__(
        self,
        model: str | None,
        dtype: str,
        new_tokens: int,
        prefix_caching: bool,
        tensor_parallel_size: int = 1,
    ) -> None:
        start = time.perf_counter()
        self.llm = LLM(
            model=model,
            dtype=dtype,
            device="cpu",
            enable_prefix_caching=prefix_caching,
            tensor_parallel_size=tensor_parallel_size,
        )
        self.load_s = time.perf_counter() - start
        self.new_tokens = new_tokens
        self.params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)

    def generate(self, prompts: list[list[int]]) -> list[list[int]]:
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], self.params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        bad = [i for i, t in enumerate(tokens) if len(t) != self.new_tokens]
        if bad:
            raise RuntimeError(
                f"mlaserve: rows {bad[:8]} produced {[len(tokens[i]) for i in bad[:8]]} tokens, "
                f"expected {self.new_tokens}"
            )
        return tokens


class HFRunner:
    def __init__(self, model: str | None, dtype: str, new_tokens: int) -> None:
        from transformers import AutoModelForCausalLM

        path = Path(model).expanduser() if model else default_model_path()
        start = time.perf_counter()
        if path.suffix.lower() == ".gguf":  # dequantized to dtype by transformers (needs accelerate + gguf)
            self.model = AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype)
            )
        else:
            self.model = AutoModelForCausalLM.from_pretrained(
                str(path), dtype=getattr(torch, dtype), local_files_only=True
            )
        self.model.eval()
        config = self.model.generation_config
        self.pad_token_id = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
        self.load_s = time.perf_counter() - start
        self.new_tokens = new_tokens

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]]) -> list[list[int]]:
        input_ids = torch.tensor(prompts, dtype=torch.long)  # all rows the same length: no padding
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=self.new_tokens,
            min_new_tokens=self.new_tokens,
            do_sample=False,
            pad_token_id=self.pad_token_id,
        )
        expected = (input_ids.shape[0], input_ids.shape[1] + self.new_tokens)
        if tuple(out.shape) != expected:
            raise RuntimeError(f"transformers: output shape {tuple(out.shape)}, expected {expected}")
        return out[:, input_ids.shape[1] :].tolist()


def timed(fn, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    tokens = fn(prompts)
    return time.perf_counter() - start, tokens


def summarize(times: list[float], num_tokens: int) -> dict:
    median = statistics.median(times)
    return {
        "wall_s_median": median,
        "wall_s_all": times,
        "output_tokens": num_tokens,
        "output_tokens_per_s": num_tokens / median,
    }


# The weight GEMMs under each system's CPU path: MKL through aten (transformers), oneDNN packed (mlaserve).
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise")


def profile_call(generate, prompts: list[list[int]]) -> dict:
    """Where one generate call spends its CPU time: the matrix-multiply share and the top operators."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        generate(prompts)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    gemm = sum(e.self_cpu_time_total for e in events if e.key in GEMM_OPS)
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
    return {
        "gemm_share_of_self_cpu": gemm / total,
        "self_cpu_s": total / 1e6,
        "top_ops": [{"op": e.key, "self_cpu_s": e.self_cpu_time_total / 1e6, "calls": e.count} for e in top],
    }


def tiny_llama() -> str:
    import tempfile

    from mlaserve.testing.tiny_models import build_tiny

    widths = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8)
    folder = Path(tempfile.mkdtemp(prefix="mlaserve-tiny-llama-"))
    return str(build_tiny("llama", folder, num_key_value_heads=4, max_position_embeddings=4096, **widths))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.model == "tiny-llama":
        args.model = tiny_llama()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()

    print(f"loading mlaserve ({args.model or 'default SmolLM2 GGUF'}) ...", flush=True)
    ours = OursRunner(args.model, args.dtype, args.new_tokens, args.prefix_caching, args.tensor_parallel_size)
    tokenizer = ours.llm.get_tokenizer()
    prompts = build_prompts(tokenizer, args.batch_size, args.prompt_len, args.prompt_format)
    hf = None
    if not args.skip_hf:
        print("loading transformers ...", flush=True)
        hf = HFRunner(args.model, args.dtype, args.new_tokens)

    print("warm-up ...", flush=True)
    ours.generate(prompts)
    if hf is not None:
        hf.generate(prompts)

    ours_times: list[float] = []
    hf_times: list[float] = []
    ours_tokens = hf_tokens = None
    for i in range(args.repeats):  # alternate, so drifting machine load is shared by both systems
        seconds, ours_tokens = timed(ours.generate, prompts)
        ours_times.append(seconds)
        line = f"repeat {i + 1}/{args.repeats}: mlaserve {seconds:.2f}s"
        if hf is not None:
            seconds, hf_tokens = timed(hf.generate, prompts)
            hf_times.append(seconds)
            line += f", transformers {seconds:.2f}s"
        print(line, flush=True)

    num_tokens = args.batch_size * args.new_tokens
    commit, dirty = git_state()
    result: dict = {
        "benchmark": "offline_throughput",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "command": shlex.join(["python", *sys.argv] if argv is None else ["python", __file__, *argv]),
        "git_commit": commit,
        "git_dirty": dirty,
        "model": str(args.model or default_model_path()),
        "dtype": args.dtype,
        "device": "cpu",
        "batch_size": args.batch_size,
        "prompt_len": args.prompt_len,
        "prompt_format": args.prompt_format,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "timing": "median wall time of one generate call over the whole batch, prefill included, after one warm-up",
        "mlaserve": {
            **summarize(ours_times, num_tokens),
            "load_s": ours.load_s,
            "prefix_caching": args.prefix_caching,
            "tensor_parallel_size": args.tensor_parallel_size,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "stats": ours.llm.stats(),
        },
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": None,
            "cpu_count": os.cpu_count(),
            "torch_num_threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
    }
    if hf is not None:
        import transformers

        result["environment"]["transformers"] = transformers.__version__
        result["transformers"] = {**summarize(hf_times, num_tokens), "load_s": hf.load_s}
        result["speedup"] = (
            result["mlaserve"]["output_tokens_per_s"] / result["transformers"]["output_tokens_per_s"]
        )
        result["greedy_agreement"] = greedy_agreement(
            ours_tokens, hf_tokens, args.new_tokens, getattr(tokenizer, "eos_token_id", None)
        )

    if args.profile:
        print("profiling ...", flush=True)
        result["mlaserve"]["profile"] = profile_call(ours.generate, prompts)
        if hf is not None:
            result["transformers"]["profile"] = profile_call(hf.generate, prompts)

    print_table(result)
    out_path = Path(args.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out_path}")
    return result


def greedy_agreement(
    ours: list[list[int]], hf: list[list[int]], new_tokens: int, eos_token_id: int | None
) -> dict:
    """Informational: do the two systems pick the same greedy tokens on the first few rows?

    They may legitimately part at an EOS: with ignore_eos mlaserve emits the EOS token and carries on, while
    transformers' min_new_tokens masks EOS out and takes the runner-up. So rows are also compared only up to
    mlaserve's first EOS; a mismatch there is a real numerical difference (or an fp32 near-tie).
    """
    rows, tokens = min(8, len(ours)), min(AGREE_TOKENS, new_tokens)
    full = [ours[r][:tokens] == hf[r][:tokens] for r in range(rows)]
    before_eos = []
    for r in range(rows):
        cut = ours[r].index(eos_token_id) if eos_token_id in ours[r][:tokens] else tokens
        before_eos.append(ours[r][:cut] == hf[r][:cut])
    first_diff = [next((j for j, (a, b) in enumerate(zip(o, h)) if a != b), None) for o, h in zip(ours, hf)]
    return {
        "rows_checked": rows,
        "tokens_checked": tokens,
        "fraction_rows_matching": sum(full) / rows,
        "fraction_rows_matching_before_eos": sum(before_eos) / rows,
        "eos_token_id": eos_token_id,
        "first_mismatch_index_per_row": first_diff,
        "mlaserve_token_at_first_mismatch": [None if j is None else o[j] for j, o in zip(first_diff, ours)],
    }


def print_table(result: dict) -> None:
    print()
    print(
        f"batch {result['batch_size']} x prompt {result['prompt_len']} + {result['new_tokens']} new tokens, "
        f"{result['dtype']}, {result['environment']['torch_num_threads']} threads, median of {result['repeats']}"
    )
    print(f"{'system':<14}{'wall s':>10}{'out tok':>10}{'tok/s':>10}")
    for name in ("mlaserve", "transformers"):
        if name in result:
            r = result[name]
            print(
                f"{name:<14}{r['wall_s_median']:>10.2f}{r['output_tokens']:>10}{r['output_tokens_per_s']:>10.1f}"
            )
    if "speedup" in result:
        agree = result["greedy_agreement"]
        print(f"speedup (mlaserve / transformers): {result['speedup']:.2f}x")
        print(
            f"greedy agreement: {agree['fraction_rows_matching']:.2f} of the first {agree['rows_checked']} rows "
            f"match on their first {agree['tokens_checked']} tokens; "
            f"{agree['fraction_rows_matching_before_eos']:.2f} up to mlaserve's first EOS "
            "(ignore_eos emits EOS, min_new_tokens suppresses it)"
        )


if __name__ == "__main__":
    main()
