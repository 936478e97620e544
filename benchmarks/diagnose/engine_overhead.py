"""Host time per engine step at high concurrency, on a tiny random DeepSeek-V2 model on CPU (the model itself is
cheap, so scheduling, batch building and output handling show).

    python benchmarks/diagnose/engine_overhead.py --requests 256 --prompt-len 100 --new-tokens 20

Prints (and with --output writes) the seconds spent in the scheduler, in build_model_input, in the model forward
and in whole engine steps, over one generate call.
"""

import argparse
import datetime as dt
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import mlaserve.runner.model_runner as model_runner  # noqa: E402
from mlaserve import LLM, SamplingParams  # noqa: E402
from tests.tiny_models import build_tiny  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--new-tokens", type=int, default=20)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny("deepseek_v2", Path(tmp) / "model")
        llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=4096, block_size=16,
                  max_num_seqs=args.requests, max_model_len=args.prompt_len + args.new_tokens)  # fmt: skip
    engine = llm.engine
    spent = dict.fromkeys(("schedule", "build_model_input", "forward", "step"), 0.0)

    def timed(name, fn):
        def wrapper(*a, **kw):
            start = time.perf_counter()
            result = fn(*a, **kw)
            spent[name] += time.perf_counter() - start
            return result

        return wrapper

    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
    engine.step = timed("step", engine.step)
    engine.runner.model.forward = timed("forward", engine.runner.model.forward)
    # the runner's two halves of building a batch (host lists and tensors, then the device copies)
    model_runner.plan_batch = timed("build_model_input", model_runner.plan_batch)
    model_runner.to_device = timed("build_model_input", model_runner.to_device)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(3, 100, (args.prompt_len,), generator=gen).tolist()}
        for _ in range(args.requests)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    report = {
        "benchmark": "engine_overhead",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "git_commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "wall_s": wall,
        "seconds": spent,
        "host_outside_forward_s": spent["step"] - spent["forward"],
    }
    print(json.dumps(report, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
