"""benchmarks/diagnose/fp8_phases.py instruments the fp8-dot kernel by patching its source at anchors: they must
still match today's kernel (the tool fails loudly otherwise), and the patched module must still build as a Gluon
kernel."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks" / "diagnose"))


def test_the_instrumented_kernel_builds_from_todays_source(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import fp8_phases

    module = fp8_phases.instrumented_module()
    names = module.stage1_fp8.arg_names
    assert names[names.index("split_target") + 1] == "Times"  # just after the sizes mla_decode passes
    source = (tmp_path / "mlaserve_fp8_phases.py").read_text()
    assert (
        source.count("%globaltimer") == 6
    )  # start, prologue end, and first scores / loop end / store per consumer
