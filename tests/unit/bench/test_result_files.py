"""bench/results holds only what a page cites, each file says where it came from, and the pages' bench commands run.

The pages are README.md, docs/ and deploy/. A result file no page names is deleted, not kept "just in case"; a page
that names a missing file is a broken link. Every `python -m bench ...` command a page gives names a subcommand (and
mode) of bench/__main__.py, and every --flag it passes is one the script's parser declares.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from bench.__main__ import resolve

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "bench" / "results"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "deploy").rglob("*.md"))]


def _text() -> str:
    return "\n".join(page.read_text() for page in PAGES)


def _cited(text: str) -> set[str]:
    """File names under bench/results a page names in a path or a link."""
    return set(re.findall(r"bench/results/([\w.\-]+\.(?:json|png))", text))


def test_every_result_file_is_cited_by_a_page_and_every_cited_file_exists():
    files = {path.name for path in RESULTS.iterdir()}
    cited = _cited(_text())
    assert sorted(files - cited) == [], "result files no page cites: delete them or cite them"
    assert sorted(cited - files) == [], "pages cite result files that do not exist"


@pytest.mark.parametrize("name", sorted(p.name for p in RESULTS.glob("*.json")))
def test_every_result_records_its_command_commit_machine_and_date(name):
    result = json.loads((RESULTS / name).read_text())
    assert list(result)[:5] == ["command", "commit", "dirty", "machine", "date"], list(result)[:6]
    assert result["command"].strip() and result["date"][:4] == "2026"
    assert re.fullmatch(r"[0-9a-f]{7,40}|unknown \(before \d{4}-\d\d-\d\d\)", result["commit"]), result["commit"]
    assert {"cpu", "cores", "gpus", "python", "torch", "vllm", "nixl"} <= set(result["machine"])


def _bench_commands() -> list[str]:
    """Every `python -m bench ...` of the pages, with its continuation lines, cut at the end of its code span."""
    commands = []
    for page in PAGES:
        text = page.read_text().replace("\\\n", " ")
        for match in re.finditer(r"python -m bench ([^`\n|]*)", text):
            words = match.group(1).split(" and ")[0].split(";")[0].split(" #")[0]
            commands.append(f"{page.name}: {words.strip()}")
    return commands


@pytest.mark.parametrize("command", _bench_commands())
def test_each_documented_bench_command_names_a_subcommand_and_its_flags(command):
    page, words = command.split(": ", 1)
    argv = [w for w in shlex.split(words) if w != "..."]
    if not argv or argv[0] in ("--help", "<subcommand>"):
        return
    found = resolve(argv)
    assert not isinstance(found, str), f"{page}: {words}"
    script, _, rest = found
    source = (ROOT / "bench" / f"{script.path}.py").read_text()
    for flag in (w.split("=", 1)[0] for w in rest if w.startswith("--")):
        if flag == "--help":
            continue
        bare = flag[2:]
        assert f'"{flag}"' in source or f'"--no-{bare}"' in source or (
            bare.startswith("no-") and f'"--{bare[3:]}"' in source and "BooleanOptionalAction" in source), \
            f"{page}: {script.path} has no {flag}"
