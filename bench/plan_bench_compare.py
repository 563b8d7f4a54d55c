"""bench/plan_bench.py against two commits of the package, alternately, in one run: the ratios of their figures.

This checkout's plan_bench.py drives both: for the other commit it runs with that commit's
`kvpush.*` packages imported from a temporary git worktree (its src/, or for older trees the package-dir
mapping of their pyproject), so both sides run the same measurement code on the same machine, rounds
interleaved (old, new, old, new, ...) so that machine load falls on both.

Usage:  python bench/plan_bench_compare.py --old REF [--rounds 3] [--reps 30]
Prints JSON and writes bench/results/plan_bench_compare.json (medians over rounds; ratio = new / old,
below 1 is faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
sys.path.insert(0, str(REPO / "bench"))
from bench_io import write_result  # bench/, this script's folder

# Runs plan_bench.main with the kvpush packages of the tree at argv[1] (src/ on the path).
_RUNNER = """
import importlib.util, runpy, sys, tomllib
from pathlib import Path
tree, bench, out = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
src = tree / "src"
if (src / "kvpush").is_dir():  # src layout: the folders are the import names
    sys.path.insert(0, str(src))
    import kvpush
    assert Path(kvpush.__file__).resolve().parent == (src / "kvpush").resolve(), kvpush.__file__
else:  # older trees mapped kvpush.services and kvpush.connector onto top-level folders (pyproject's package-dir)
    sys.path.insert(0, str(tree))
    import kvpush
    assert Path(kvpush.__file__).resolve().parent == (tree / "kvpush").resolve(), kvpush.__file__
    package_dirs = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for name, folder in package_dirs.items():
        if name == "kvpush":
            continue
        spec = importlib.util.spec_from_file_location(name, tree / folder / "__init__.py",
                                                      submodule_search_locations=[str(tree / folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        setattr(kvpush, name.rsplit(".", 1)[1], module)
sys.path.insert(0, str(Path(bench).parent))  # the script's own bench_io
sys.argv = [bench] + sys.argv[4:] + ["--out", out]
runpy.run_path(bench, run_name="__main__")
"""


def _run(tree: Path, out: Path, reps: int) -> dict:
    # This checkout's plan_bench.py drives both trees: its stand-ins fit the worker's ports of both (an older tree's
    # own script may not fit the worker it shipped with), so both sides run the same measurement code.
    subprocess.run([sys.executable, "-c", _RUNNER, str(tree), str(REPO / "bench" / "plan_bench.py"), str(out),
                    "--reps", str(reps)], check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def _figures(result: dict) -> dict[str, float]:
    figures = {f"{c['case']}.cached_us_per_write": c["cached_us_per_write"] for c in result["cases"]}
    figures |= {f"{c['case']}.full_plan_us_per_write": c["full_plan_us_per_write"] for c in result["cases"]}
    hook = result["hook"]
    figures[f"{hook['case']}.forward_us_per_layer"] = hook["forward_us_per_layer"]
    figures[f"{hook['case']}.until_submitted_ms"] = hook["until_submitted_ms"]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="the commit to compare this checkout with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    old_sha = subprocess.run(["git", "rev-parse", args.old], cwd=REPO, check=True, capture_output=True,
                             text=True).stdout.strip()
    new_sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, check=True, capture_output=True,
                             text=True).stdout.strip()
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        old_tree = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "--detach", str(old_tree), old_sha], cwd=REPO, check=True,
                       capture_output=True)
        try:
            for round_ in range(args.rounds):
                for side, tree in (("old", old_tree), ("new", REPO)):
                    runs[side].append(_figures(_run(tree, Path(tmp) / f"{side}{round_}.json", args.reps)))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old_tree)], cwd=REPO, check=True)
    figures = {}
    for key in runs["new"][0]:
        old = statistics.median(r[key] for r in runs["old"])
        new = statistics.median(r[key] for r in runs["new"])
        figures[key] = {"old": old, "new": new, "ratio_new_over_old": round(new / old, 3) if old else None}
    result = {"bench": "plan_compare", "old": old_sha, "new": new_sha,
              "rounds": args.rounds, "reps": args.reps, "figures": figures}
    write_result(RESULTS / "plan_bench_compare.json", result)


if __name__ == "__main__":
    main()
