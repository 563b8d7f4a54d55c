"""`python -m bench`: every subcommand names a script that exists, and bench_io stamps what every result records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import bench_io
from bench.__main__ import COMMANDS, Script, resolve

ROOT = Path(__file__).resolve().parents[3]


def _scripts() -> list[tuple[list[str], Script]]:
    found = []
    for name, entry in COMMANDS.items():
        if isinstance(entry, Script):
            found.append(([name], entry))
        else:
            found += [([name, mode], script) for mode, script in entry.items()]
    return found


@pytest.mark.parametrize("words, script", _scripts(), ids=[" ".join(w) for w, _ in _scripts()])
def test_each_subcommand_resolves_to_a_script_with_a_main(words, script):
    found = resolve([*words, "--flag", "value"])
    assert found == (script, words, ["--flag", "value"])
    source = (ROOT / "bench" / f"{script.path}.py").read_text()
    assert "\ndef main(" in source


def test_a_group_without_its_mode_and_an_unknown_name_answer_with_usage():
    assert "latency" in resolve(["gateway"]) and "tokenize" in resolve(["gateway", "nope"])
    assert resolve(["nope"]).startswith("unknown subcommand 'nope'")
    assert all(name in resolve(["--help"]) for name in COMMANDS)


def test_help_runs_as_a_module_and_a_script_help_names_the_subcommand():
    top = subprocess.run([sys.executable, "-m", "bench", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert top.returncode == 0 and "dataplane <cpu|gpu|gil|stream>" in top.stdout
    plan = subprocess.run([sys.executable, "-m", "bench", "plan", "run", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    assert plan.stdout.startswith("usage: python -m bench plan run [-h] [--reps REPS]")


def test_write_result_puts_command_commit_machine_and_date_first(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-m", "bench", "plan", "run", "--reps", "3"])
    path = bench_io.write_result(tmp_path / "x" / "r.json", {"command": "old", "cases": [1, 2]}, echo=False)
    result = json.loads(path.read_text())
    assert list(result) == ["command", "commit", "dirty", "machine", "date", "cases"]
    assert result["command"] == "python -m bench plan run --reps 3"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert result["commit"] == head and isinstance(result["dirty"], bool)
    assert result["machine"]["cores"] and result["machine"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert set(result["machine"]) == {"cpu", "cores", "gpus", "os", "python", "torch", "vllm", "nixl"}
    assert result["cases"] == [1, 2] and result["date"].endswith("Z")


def test_the_command_is_relative_to_the_checkout_and_quoted_as_typed():
    argv = ["/usr/bin/python3", str(ROOT / "bench" / "gpu_e2e.py"), "hops", "--connector-extra", '{"a": false}']
    assert bench_io.command_line(argv) == "python bench/gpu_e2e.py hops --connector-extra '{\"a\": false}'"


def test_emit_names_the_file_by_prefix_and_utc_time(tmp_path, capsys):
    path = bench_io.emit({"x": 1}, tmp_path, "hops")
    assert path.parent == tmp_path and path.name.startswith("hops-2") and path.name.endswith("Z.json")
    assert json.loads(capsys.readouterr().out)["x"] == 1


def test_a_named_commit_wins_over_the_checkouts_git(monkeypatch):
    """KVPUSH_BENCH_COMMIT (set where a copy runs) is recorded as the commit, with dirty unknown."""
    monkeypatch.setenv("KVPUSH_BENCH_COMMIT", "e05f99a")
    stamp = bench_io.provenance()
    assert (stamp["commit"], stamp["dirty"]) == ("e05f99a", None)
    monkeypatch.delenv("KVPUSH_BENCH_COMMIT")
    assert bench_io.provenance()["commit"] != "e05f99a"
