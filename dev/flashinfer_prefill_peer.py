"""Add FlashInfer's batch-prefill sources to the slim FlashInfer wheel, so the prefill128 section's fa3 peer
(BatchPrefillWithRaggedKVCacheWrapper) can JIT-compile on the GPU machine. The shared recipe
(../shared/peers/flashinfer/build.sh) keeps only the MLA decode's sources; this puts back the top-level
flashinfer/data/csrc/batch_prefill* files from the original wheel and rewrites RECORD.

    ../shared/peers/flashinfer/build.sh .whl-peer --aot
    python dev/flashinfer_prefill_peer.py .whl-peer/flashinfer_python-*.whl

It downloads the original wheel (flashinfer-python 0.7.2.post1, the version build.sh packs) from the package
registry. On the GPU machine FlashInfer then compiles the ragged prefill module on first use.
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


def wanted(name: str) -> bool:
    rest = name[len(CSRC) :] if name.startswith(CSRC) else ""
    return bool(rest) and "/" not in rest and rest.startswith("batch_prefill")


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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("slim", help="the slim wheel build.sh wrote; rewritten in place")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        original = zipfile.ZipFile(download(tmp))
        added = {n: original.read(n) for n in original.namelist() if wanted(n)}
        out = os.path.join(tmp, "slim.whl")
        with zipfile.ZipFile(args.slim) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
            record_name = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
            records = [line for line in src.read(record_name).decode().splitlines() if line and line.split(",")[0]
                       not in added and line.split(",")[0] != record_name]  # fmt: skip
            for info in src.infolist():
                if info.filename != record_name and info.filename not in added:
                    dst.writestr(info, src.read(info.filename), compresslevel=9)
            for name, data in sorted(added.items()):
                dst.writestr(zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0)), data, compresslevel=9)
                records.append(record_line(name, data))
            dst.writestr(record_name, "\n".join([*records, f"{record_name},,"]) + "\n")
        os.replace(out, args.slim)
    print(
        f"added {len(added)} batch_prefill sources to {args.slim}: {os.path.getsize(args.slim) / 2**20:.2f} MiB"
    )


if __name__ == "__main__":
    main()
