"""bench/soak.py's fault bookkeeping, and the freeze and abuse figures of docs/reliability.md against their result
file."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from kvpush.v1 import directory_pb2 as dpb
from tests.fixtures.bench_scripts import load_bench

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "reliability.md"
NEW_FAULTS = {"decode-freeze", "oversized", "invalid-flood"}


@pytest.fixture(scope="module")
def soak():
    return load_bench("soak")


def test_padding_keeps_the_request_and_adds_exactly_its_size(soak):
    request = dpb.GetEngineRequest(engine_id="decode-1").SerializeToString()
    padded = soak._with_padding(request, 20 * 2**20)
    assert dpb.GetEngineRequest.FromString(padded).engine_id == "decode-1"
    assert 20 * 2**20 < len(padded) - len(request) <= 20 * 2**20 + 8


def test_fault_outcomes_count_the_requests_sent_during_the_fault(soak):
    bound = (1 + soak.MAX_FAILOVERS) * soak.FIRST_BYTE_TIMEOUT_S
    outcomes = [soak.Outcome(0, "completed", 9.0, 1.0, False),  # before the fault
                soak.Outcome(1, "completed", 10.5, 2.0, True),
                soak.Outcome(2, "failed", 11.0, bound + 1, False, status=502),
                soak.Outcome(3, "completed", 12.0, 0.5, False, corrupt=True),
                soak.Outcome(4, "completed", 21.0, 1.0, False)]  # after its recovery
    got = soak.fault_outcomes(outcomes, {"fault": "decode-freeze", "at_s": 10.0, "recovered_at_s": 20.0})
    assert got == {"completed": 2, "failed": 1, "aborted": 0, "hung": 0, "corrupt": 1, "slowest_s": bound + 1,
                   "over_failover_bound": 1, "failed_by_status": {502: 1}}


def test_served_rate_compares_each_fault_with_the_time_outside_every_fault(soak):
    # One completion a second from 0 to 59 s, none ending from 20 to 30 s (a fault at 20-25 s, plus its 5 s tail).
    # One request sent during the fault waited 15 s and failed: sent, not served.
    outcomes = [soak.Outcome(i, "completed", t - 0.5, 0.5, False) for i, t in enumerate(range(60))
                if not 20 <= t <= 30] + [soak.Outcome(99, "failed", 22.0, 15.0, False, status=502)]
    rates = soak.served_rate(outcomes, [{"fault": "oversized", "at_s": 20.0, "recovered_at_s": 25.0}], load_s=60.0)
    assert rates["outside_faults_s"] == pytest.approx(40.0, abs=0.2)  # 10-60 s less 20-30 s
    assert rates["completed_per_s_outside_faults"] == pytest.approx(1.0, abs=0.03)
    (during,) = rates["during_faults"]
    assert (during["fault"], during["from_s"], during["to_s"]) == ("oversized", 20.0, 30.0)
    assert during["completed_per_s"] == 0.0 and during["ratio_to_outside"] == 0.0
    assert during["sent_per_s"] == pytest.approx(0.1)


def _section() -> str:
    text = DOC.read_text()
    start = text.index("### Freeze and abuse faults")
    return text[start:text.index("\n### ", start + 1)]


def _cells(section: str, header_start: str) -> list[list[str]]:
    """The body rows of the table whose header row starts with `header_start`, as stripped cells."""
    lines = section.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(header_start)) + 2
    rows = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip().strip("*") for cell in line.strip("|").split("|")])
    return rows


def test_the_documented_run_is_the_committed_result_and_its_figures_match(soak):
    section = _section()
    (command,) = [line.strip() for line in section.splitlines() if "bench/soak.py" in line and line.startswith("    ")]
    words = shlex.split(command)
    args = words[words.index("bench/soak.py") + 1:]
    parsed, faults = soak.parse_args(args)
    assert set(faults) >= NEW_FAULTS
    result = json.loads((ROOT / parsed.out).read_text())
    assert result["command"] == "python bench/soak.py " + " ".join(args)
    assert {e["fault"] for e in result["faults_injected"]} >= NEW_FAULTS

    ((completed, failed, aborted, hung, corrupt, leaked),) = _cells(section, "| completed (all token-identical)")
    assert [int(completed), int(failed), int(aborted)] == [result["outcomes"][k] for k in ("completed", "failed",
                                                                                           "aborted")]
    assert [int(hung), int(corrupt), int(leaked)] == [result["hung"], result["corrupt"], result["leaked"]] == [0, 0, 0]

    rates = result["served_rate"]
    outside = re.search(r"completed ([\d.]+) requests/s outside the faults \(([\d.]+)/s sent\)", section)
    assert outside is not None
    assert float(outside[1]) == round(rates["completed_per_s_outside_faults"], 2)
    assert float(outside[2]) == round(rates["sent_per_s_outside_faults"], 1)
    for name, figures, _ in _cells(section, "| fault | completed/s"):
        fault = name.split("`")[1]
        documented = [(float(rate), float(ratio)) for rate, ratio in re.findall(r"([\d.]+) \(([\d.]+)\)", figures)]
        measured = [(round(d["completed_per_s"], 2), round(d["ratio_to_outside"], 2))
                    for d in rates["during_faults"] if d["fault"] == fault]
        assert documented == measured, fault
