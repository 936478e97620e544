"""One run on one GPU: ceilings, kernel correctness against the torch reference, kernel and engine timings.

    python -m benchmarks.gpu_suite --sections ceilings,kernels,decode,tiny,lite --out benchmarks/results/h200-DATE.json

Run it as a module from the repository root (it imports its sections as the `benchmarks` package). `--help` lists
the sections (benchmarks/gpu_sections.py holds their table). Timings are medians of CUDA-event runs with L2 emptied
before each (gpu_timing.bench), or of repeated wall-clock runs after a warm-up.
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.gpu_sections import DEFAULT, SECTIONS, SuiteRun, sections_help
from benchmarks.gpu_timing import ceilings, run_header


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, epilog=sections_help(), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sections", default=DEFAULT)
    parser.add_argument(
        "--hf-peer", action="store_true", help="also time transformers generate in the lite section"
    )
    parser.add_argument(
        "--tune", action="store_true", help="sweep the decode kernel's tile sizes, report the best"
    )
    parser.add_argument(
        "--flashinfer-peer",
        action="store_true",
        help="also run the flashinfer section: FlashInfer's MLA decode beside ours (it must be importable)",
    )
    parser.add_argument("--eager", action="store_true", help="lite: no CUDA graphs")
    parser.add_argument("--profile", action="store_true", help="lite: print a torch profile of one request")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sections = args.sections.split(",")
    unknown = sorted(set(sections) - {s.name for s in SECTIONS} - {"ceilings"})
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; --help lists them")
    if args.flashinfer_peer and "flashinfer" not in sections:
        sections.append("flashinfer")
    report = {**run_header(), "torch": torch.__version__}
    import triton

    report["triton"] = triton.__version__
    out = args.out or f"benchmarks/results/h200-{report['date']}.json"
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        ceil = ceilings() if "ceilings" in sections else {}
        report["ceilings"] = ceil
        print("ceilings", ceil, flush=True)
        run = SuiteRun(Path(tmp), ceil, args.hf_peer, args.tune, args.eager, args.profile)
        for section in SECTIONS:
            name = section.name
            if name in sections:
                t = time.perf_counter()
                try:
                    report[name] = section.run(run)
                except Exception as e:  # keep the other sections' figures
                    report[name] = {"error": f"{type(e).__name__}: {e}"}
                report[name + "_seconds"] = time.perf_counter() - t
                print(name, json.dumps(report[name])[:2000], flush=True)
                Path(out).write_text(
                    json.dumps(report, indent=2)
                )  # each section's figures, should a later one crash
    print("wrote", out)


if __name__ == "__main__":
    main()
