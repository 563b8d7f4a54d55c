"""README.md's "When to choose it" figures, and the same figures in docs/benchmarks.md's tables, are the ratios of the
result files they link, recomputed here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"


def _points(name: str) -> dict[tuple[str, int, float], dict]:
    return {(p["connector"], p["isl"], p["rate"]): p for p in json.loads((RESULTS / name).read_text())["points"]}


def _span(ratios: list[float]) -> str:
    low, high = f"{min(ratios):.2f}", f"{max(ratios):.2f}"
    return low if low == high else f"{low}–{high}"


def _serving(ours: dict, theirs: dict, connector: str, isl: tuple[int, ...], metric: str = "mean_ttft_ms") -> str:
    """Our points' `metric` over the other connector's, at the same prompt length and rate."""
    return _span([p[metric] / theirs[(connector, i, r)][metric] for (_, i, r), p in ours.items()
                  if i in isl and (connector, i, r) in theirs])


def _row(text: str) -> str:
    section = ROOT.joinpath("README.md").read_text().split("## When to choose it", 1)[1].split("\n## ", 1)[0]
    [line] = [line for line in section.splitlines() if line.startswith("|") and text in line]
    return line


def _expected() -> list[tuple[str, list[str]]]:
    first_token = {k: v for k, v in _points("gpu_serve_first_token.json").items() if k[0] == "kvpush-first-token"}
    stock = _points("gpu_serve_first_token.json")
    kvpush = _points("gpu_serve_a.json")
    nixl = _points("gpu_serve_b.json")
    ttft = json.loads((RESULTS / "ttft-20261130T020804Z.json").read_text())["phases"]
    single = {name: ttft[name]["1gbit"]["2048"]["median_disagg_ms"] for name in ("kvpush", "nixl-push", "nixl-pull")}
    return [
        ("1,024-token prompts at", [_serving(first_token, stock, "nixl-push", (1024,)),
                                 _serving(first_token, stock, "nixl-pull", (1024,))]),
        ("4,096-token prompts at", [_serving(first_token, stock, "nixl-push", (4096,)),
                                 _serving(first_token, stock, "nixl-pull", (4096,))]),
        ("8,192-token prompts", [_serving(kvpush, nixl, "nixl-push", (8192,))]),
        ("time per output token", [_serving(first_token, stock, "nixl-push", (1024, 4096), "mean_tpot_ms")]),
        ("2,048-token request", [_span([single["kvpush"] / single["nixl-push"]]),
                                 _span([single["kvpush"] / single["nixl-pull"]])]),
    ]


@pytest.mark.parametrize("row, figures", _expected(), ids=[e[0] for e in _expected()])
def test_readme_figure_is_its_result_files_ratio(row, figures):
    """Each row names the figures its result files give (kvpush's over vLLM's connector's, same prompt and rate)."""
    line = _row(row)
    for figure in figures:
        assert f"| {figure} " in line or f"| **{figure}** " in line, (figure, line)


def _benchmarks_row(section: str, text: str) -> str:
    page = ROOT.joinpath("docs", "benchmarks.md").read_text()
    body = page.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    [line] = [line for line in body.splitlines() if line.startswith("|") and text in line]
    return line


def _benchmarks_expected() -> list[tuple[str, str, str]]:
    first_token = {k: v for k, v in _points("gpu_serve_first_token.json").items() if k[0] == "kvpush-first-token"}
    stock = _points("gpu_serve_first_token.json")
    kvpush = _points("gpu_serve_a.json")
    nixl = _points("gpu_serve_b.json")
    ttft = json.loads((RESULTS / "ttft-20261130T020804Z.json").read_text())["phases"]
    single = {name: ttft[name]["1gbit"]["2048"]["median_disagg_ms"] for name in ("kvpush", "nixl-push", "nixl-pull")}
    return [
        ("Serving on one H200", "÷ NixlPushConnector's, 1,024-token prompts",
         " / ".join(_serving(first_token, stock, "nixl-push", (isl,)) for isl in (1024, 4096))),
        ("Serving on one H200", "the same ÷ NixlConnector's",
         " / ".join(_serving(first_token, stock, "nixl-pull", (isl,)) for isl in (1024, 4096))),
        ("Serving on one H200", "time per output token",
         _serving(first_token, stock, "nixl-push", (1024, 4096), "mean_tpot_ms")),
        ("Serving on one H200", "first token from prefill ÷ first token off",
         _serving(first_token, {("kvpush-first-token", i, r): p for (c, i, r), p in stock.items() if c == "kvpush"},
                  "kvpush-first-token", (1024, 4096))),
        ("Serving on one H200", "8,192-token prompts", _serving(kvpush, nixl, "nixl-push", (8192,))),
        ("TTFT on CPU engines", "one 2,048-token request",
         f"{single['kvpush'] / single['nixl-push']:.2f} / {single['kvpush'] / single['nixl-pull']:.2f}"),
    ]


@pytest.mark.parametrize("section, row, figure", _benchmarks_expected(), ids=[e[1] for e in _benchmarks_expected()])
def test_benchmarks_figure_is_its_result_files_ratio(section, row, figure):
    """docs/benchmarks.md's serving and single-request rows give the same ratios as their result files."""
    line = _benchmarks_row(section, row)
    assert f"| {figure} " in line or f"| **{figure}** " in line or f"| **{figure}** (" in line \
        or f"| {figure} (" in line, (figure, line)
