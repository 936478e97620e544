"""Put sources back into the slim FlashInfer wheel, so a peer kernel beyond the MLA decode can JIT-compile on the GPU
machine. The shared recipe (../shared/peers/flashinfer/build.sh) keeps only the MLA decode's sources; this adds
the files one or more kernels below need from the original wheel and rewrites RECORD.

- prefill (the default): the top-level flashinfer/data/csrc/batch_prefill* files, for the prefill128 section's fa3
  peer (BatchPrefillWithRaggedKVCacheWrapper).
- fp8_blockscale_gemm: what flashinfer.gemm.fp8_blockscale_gemm_sm90 (the fp8_paths section's peer) compiles and
  reads: its binding, the DeepGEMM include-dir hook and the TensorRT-LLM tree under csrc/nv_internal, whose
  deep_gemm/ headers the module also hands to NVRTC when it builds a kernel per GEMM shape at run time.

    ../shared/peers/flashinfer/build.sh .whl-peer --aot
    python dev/flashinfer_prefill_peer.py .whl-peer/flashinfer_python-*.whl                      # prefill
    python dev/flashinfer_prefill_peer.py .whl-peer/flashinfer_python-*.whl --kernels prefill,fp8_blockscale_gemm

It downloads the original wheel (flashinfer-python 0.7.2.post1, the version build.sh packs) from the package
registry unless --original names a copy already here. On the GPU machine FlashInfer compiles each module on first use.
"""

import argparse
import base64
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

CSRC = "flashinfer/data/csrc/"
VERSION = "0.7.2.post1"


def _prefill(rest: str) -> bool:
    return "/" not in rest and rest.startswith("batch_prefill")


def _fp8_blockscale_gemm(rest: str) -> bool:
    # the jit spec's sources (flashinfer/jit/gemm/fp8_blockscale.py) and the include dirs it names, all under
    # nv_internal; the whole tree, since which of its headers a TensorRT-LLM source pulls in is only known to nvcc
    return rest.startswith("nv_internal/") or rest in (
        "fp8_blockscale_gemm_sm90_binding.cu",
        "fused_moe/cutlass_backend/deepgemm_jit_setup.cu",
    )


# kernel name -> which files under flashinfer/data/csrc/ it needs beyond what the slim wheel keeps
KERNELS = {"prefill": _prefill, "fp8_blockscale_gemm": _fp8_blockscale_gemm}


def wanted(name: str, kernels: tuple[str, ...] = ("prefill",)) -> bool:
    """Whether the original wheel's file `name` is one that `kernels` need put back."""
    rest = name[len(CSRC) :] if name.startswith(CSRC) else ""
    return bool(rest) and not rest.endswith("/") and any(KERNELS[k](rest) for k in kernels)


def parse_kernels(text: str) -> tuple[str, ...]:
    """The comma-separated kernel names of --kernels, each one of KERNELS."""
    names = tuple(n for n in text.split(",") if n)
    unknown = [n for n in names if n not in KERNELS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"--kernels {text!r}: each must be one of {sorted(KERNELS)}")
    return names


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def download(folder: str) -> str:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
         "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "-d", folder,
         f"flashinfer-python=={VERSION}"],
        check=True,
    )  # fmt: skip
    return next(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".whl"))


def add_sources(slim: str, original: str, kernels: tuple[str, ...], tmp: str) -> int:
    """Rewrite the wheel `slim` in place with the files `kernels` need from `original`; how many were added."""
    with zipfile.ZipFile(original) as orig:
        added = {n: orig.read(n) for n in orig.namelist() if wanted(n, kernels)}
    out = os.path.join(tmp, "with_sources.whl")
    with zipfile.ZipFile(slim) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        record_name = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        records = [line for line in src.read(record_name).decode().splitlines() if line and line.split(",")[0]
                   not in added and line.split(",")[0] != record_name]  # fmt: skip
        for info in src.infolist():
            if info.filename != record_name and info.filename not in added:
                dst.writestr(info, src.read(info.filename), compresslevel=9)
        for name, data in sorted(added.items()):
            info = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED  # a bare ZipInfo would store the file uncompressed
            dst.writestr(info, data, compresslevel=9)
            records.append(record_line(name, data))
        dst.writestr(record_name, "\n".join([*records, f"{record_name},,"]) + "\n")
    os.replace(out, slim)
    return len(added)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("slim", help="the slim wheel build.sh wrote; rewritten in place")
    parser.add_argument(
        "--kernels", type=parse_kernels, default=("prefill",), help=f"comma-separated: {sorted(KERNELS)}"
    )
    parser.add_argument("--original", help="the original flashinfer-python wheel, if already downloaded")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        count = add_sources(args.slim, args.original or download(tmp), args.kernels, tmp)
    size = os.path.getsize(args.slim) / 2**20
    print(f"added {count} sources for {', '.join(args.kernels)} to {args.slim}: {size:.2f} MiB")


if __name__ == "__main__":
    main()
