"""bench/ttft_bench.py on two commits of kvpush, alternately, in one run: TTFT of each, and the ratio new / old.

The older commit's packages come from a temporary git worktree (its `src/` first on PYTHONPATH, so its engines,
directory and gateway run its code); this checkout's run as installed. Rounds alternate (old, new, old, new, ...)
so that machine load falls on both; each round is one ttft_bench run of the given phases. Per phase and prompt
length: the median over rounds of the disaggregated TTFT and of its ratio to the same prompt sent straight to the
prefill engine (P alone, measured in the same run), and new / old of both.

    python -m bench ttft-ab --old 4c6ea3c --rounds 2 --phases kvpush-first-token --iterations 12
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_io import write_result  # bench/, this script's folder

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"


def _cells(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    figures: dict[str, dict[str, float]] = {}
    for phase, rates in result["phases"].items():
        if not isinstance(rates, dict) or "error" in rates:
            raise RuntimeError(f"phase {phase} failed: {rates}")
        for rate, cells in rates.items():
            if not isinstance(cells, dict):
                continue
            for tokens, cell in cells.items():
                if isinstance(cell, dict) and cell.get("median_disagg_ms"):
                    figures[f"{phase}/{rate}/{tokens}"] = {
                        "ttft_ms": cell["median_disagg_ms"], "ratio_vs_p_alone": cell.get("ratio_vs_p_direct")}
    return figures


def _run(side: str, src: Path | None, out: Path, passthrough: list[str]) -> dict[str, dict[str, float]]:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src), env.get("PYTHONPATH", "")) if p)
    subprocess.run([sys.executable, str(REPO / "bench" / "ttft_bench.py"), *passthrough, "--out", str(out)],
                   check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1800)
    return _cells(json.loads(out.read_text()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="the commit to compare this checkout with")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "ttft_ab.json"))
    # ttft_bench's own flags, passed on to every round (its --help says what each does).
    parser.add_argument("--phases", default="kvpush-first-token")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rates", default="unshaped")
    parser.add_argument("--tokens", default=None)
    parser.add_argument("--no-netns", action="store_true")
    args = parser.parse_args(argv)
    passthrough = ["--phases", args.phases, "--iterations", str(args.iterations), "--warmup", str(args.warmup),
                   "--rates", args.rates, *(["--tokens", args.tokens] if args.tokens else []),
                   *(["--no-netns"] if args.no_netns else [])]
    runs: dict[str, list[dict[str, dict[str, float]]]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory(prefix="kvpush-ab-") as tmp:
        tree = Path(tmp) / "old"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), args.old], check=True,
                       capture_output=True)
        try:
            if not (tree / "src" / "kvpush").is_dir():
                raise SystemExit(f"{args.old} has no src/kvpush: compare commits of the src layout")
            for round_ in range(args.rounds):
                for side in ("old", "new"):
                    src = tree / "src" if side == "old" else None
                    runs[side].append(_run(side, src, Path(tmp) / f"{side}{round_}.json", passthrough))
                    print(f"round {round_} {side}: {json.dumps(runs[side][-1])}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False,
                           capture_output=True)
    cells = sorted(set(runs["old"][0]) & set(runs["new"][0]))
    figures = {}
    for cell in cells:
        row: dict[str, Any] = {}
        for side in ("old", "new"):
            row[f"{side}_ttft_ms"] = [r[cell]["ttft_ms"] for r in runs[side]]
            row[f"{side}_ratio_vs_p_alone"] = [r[cell]["ratio_vs_p_alone"] for r in runs[side]]
        old_ttft, new_ttft = statistics.median(row["old_ttft_ms"]), statistics.median(row["new_ttft_ms"])
        row["ttft_new_over_old"] = round(new_ttft / old_ttft, 3)
        old_ratio = statistics.median(x for x in row["old_ratio_vs_p_alone"] if x)
        new_ratio = statistics.median(x for x in row["new_ratio_vs_p_alone"] if x)
        row["ratio_vs_p_alone_old"], row["ratio_vs_p_alone_new"] = round(old_ratio, 3), round(new_ratio, 3)
        figures[cell] = row
    result = {"benchmark": "ttft_ab", "old": args.old, "rounds": args.rounds, "ttft_bench_args": passthrough,
              "figures": figures}
    write_result(Path(args.out), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
