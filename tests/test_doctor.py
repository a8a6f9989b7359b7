"""``vgraph doctor``: the CPU message, the report's verdict, and the graph check's code path
(run here on CPU, where buckets pad the compiled forward instead of replaying graphs)."""
from __future__ import annotations

import torch

from vgraph import doctor


def test_without_cuda_it_says_so_and_fails():
    lines: list[str] = []
    assert doctor.run(torch.device("cpu"), lines.append) == 1
    assert len(lines) == 1 and "no CUDA device" in lines[0]


def test_the_report_fails_when_any_check_fails_and_keeps_going_after_an_error():
    def broken() -> list[doctor.Finding]:
        raise RuntimeError("capture failed")

    findings = [doctor.Finding("device", True, "x")] + doctor._guarded("CUDA graphs", broken)
    lines: list[str] = []
    assert doctor.report(findings, lines.append) == 1
    assert lines[1].startswith("FAIL  CUDA graphs: RuntimeError: capture failed")
    assert lines[-1] == "1 passed, 1 failed"
    assert doctor.report(findings[:1], lines.append) == 0


def test_graph_check_passes_on_cpu(tmp_path):
    findings = doctor.check_graphs(torch.device("cpu"), str(tmp_path))
    assert [f.check for f in findings if not f.ok] == []
    assert len(findings) == 2 + len(doctor.BATCH_SIZES)


def test_cli_doctor_without_cuda_is_one_line_and_exit_1(capsys):
    from vgraph import cli
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "no CUDA device" in out[0]
