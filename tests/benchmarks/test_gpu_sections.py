"""The GPU suite's section table: names unique, the default run names only sections that exist, and the suite
refuses a misspelt section instead of skipping it silently."""

import subprocess
import sys

from benchmarks.gpu_sections import DEFAULT, SECTIONS, sections_help


def test_names_are_unique_and_the_default_exists() -> None:
    names = [s.name for s in SECTIONS]
    assert len(names) == len(set(names))
    assert set(DEFAULT.split(",")) <= set(names) | {"ceilings"}
    assert all(f"  {name}" in sections_help() for name in names)


def test_the_suite_refuses_an_unknown_section() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_suite", "--sections", "ceilings,decod"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2 and "unknown section(s) decod" in run.stderr
