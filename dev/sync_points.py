"""Where launching a step waits for the device. A step launched ahead (asynchronous scheduling) only helps if its
launch never waits for the step before it: any stream sync inside ModelRunner.launch holds the host until the GPU
is idle again. Here every launch of a step scheduled ahead runs under torch's sync debug mode ("warn"), and each
synchronizing call is recorded with the innermost mlaserve frame that made it.

Tiny DeepSeek-V2 model, random weights, float32, on CUDA: CUDA graphs and eager, each over three workloads
(greedy decodes with requests waiting, so prompt chunks and admissions are launched ahead; sampled rows with
temperature / top-k / top-p / min-p; seeded rows and logit_bias). Prints per (mode, workload, kind of step) the
launches ahead and those that waited, then each place that waited; writes the same as JSON.

    python -m dev.sync_points OUT.json           (GPU)
    python -m dev.sync_points OUT.json --cpu     (the workloads alone: a smoke run, no sync mode)

Run it as a module from the repository root: on a GPU it takes its record header from benchmarks/gpu_suite.py.
"""

from __future__ import annotations

import json
import sys
import tempfile
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

import mlaserve
from mlaserve import LLM, SamplingParams
from mlaserve.runner.model_runner import ModelRunner
from mlaserve.testing.tiny_models import build_tiny

# Frames under this folder are the engine's own; whichever mlaserve was imported is the one whose syncs count.
PACKAGE = str(Path(mlaserve.__file__).resolve().parent)

WORKLOADS = {
    "greedy": [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)],
    "sampled": [
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.7, min_p=0.1, max_tokens=24, ignore_eos=True),
    ],
    "seeded_bias": [
        SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, logit_bias={5: 2.0}, max_tokens=24, ignore_eos=True),
    ],
}


def step_kind(output) -> str:
    prompt = any(s.num_new_tokens > 1 for s in output.scheduled)
    ahead = any(s.lookahead for s in output.scheduled)
    return {(False, True): "decode", (True, True): "prompt+decode", (True, False): "prompt"}.get(
        (prompt, ahead), "decode, known inputs"
    )


def where(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame in mlaserve: the call that synchronized."""
    ours = [f for f in stack if f.filename.startswith(PACKAGE)]
    frame = ours[-1] if ours else stack[-1]
    return f"{Path(frame.filename).relative_to(Path(PACKAGE).parent)}:{frame.lineno} {frame.line}"


def run(path: Path, enforce_eager: bool, workload: str, on_gpu: bool) -> dict:
    launches: Counter = Counter()
    waited: Counter = Counter()
    sites: Counter = Counter()
    original = ModelRunner.launch

    def launch(self, output, previous=None):
        if previous is None:
            return original(self, output, previous)
        kind = step_kind(output)
        launches[kind] += 1
        if not on_gpu:
            return original(self, output, previous)
        seen: list[str] = []

        def record(message, category, filename, lineno, file=None, line=None) -> None:
            seen.append(where(traceback.extract_stack()[:-1]))

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return original(self, output, previous)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                waited[kind] += bool(seen)
                sites.update(seen)

    ModelRunner.launch = launch
    try:
        llm = LLM(str(path), dtype="float32", device="cuda" if on_gpu else "cpu", async_scheduling=True,
                  enforce_eager=enforce_eager, num_kv_blocks=64, block_size=16, max_model_len=256,
                  max_num_seqs=4, max_num_batched_tokens=48)  # fmt: skip
        gen = torch.Generator().manual_seed(0)
        prompts = [
            {"prompt_token_ids": torch.randint(3, 250, (int(n),), generator=gen).tolist()}
            for n in torch.randint(4, 90, (10,), generator=gen)
        ]
        params = [WORKLOADS[workload][i % len(WORKLOADS[workload])] for i in range(len(prompts))]
        llm.generate(prompts, params, use_tqdm=False)
        del llm
    finally:
        ModelRunner.launch = original
    return {
        "launches_ahead": dict(launches),
        "launches_that_waited": dict(waited),
        "sync_sites": dict(sites.most_common()),
    }


def main() -> None:
    out, on_gpu = Path(sys.argv[1]), "--cpu" not in sys.argv
    if on_gpu and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --cpu for a smoke run of the workloads)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny("deepseek_v2", Path(tmp) / "model")
        for mode in ["graphs", "eager"] if on_gpu else ["eager"]:
            for workload in WORKLOADS:
                row = {"mode": mode, "workload": workload, **run(path, mode == "eager", workload, on_gpu)}
                rows.append(row)
                for kind, n in row["launches_ahead"].items():
                    print(f"{mode:6} {workload:12} {kind:22} {n:4} ahead, "
                          f"{row['launches_that_waited'].get(kind, 0):4} waited")  # fmt: skip
                for site, n in row["sync_sites"].items():
                    print(f"        {n:5} x {site}")
    header = {
        "command": " ".join(["python -m dev.sync_points", *sys.argv[1:]]),
        "device": "cuda" if on_gpu else "cpu",
    }
    if on_gpu:
        from benchmarks.gpu_timing import run_header

        header = run_header()
    out.write_text(json.dumps({**header, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
