"""Summarise a py-spy raw profile (`py-spy record -f raw --threads [--subprocesses]`) of a kvpush engine.

Per process and thread: samples (py-spy records only non-idle ones by default), and how many have a kvpush frame;
for each thread, the outermost kvpush frame and the leaf frames under kvpush, most sampled first. JSON to stdout
(and to --out).

    python bench/profile_summary.py prefill_prof.txt [--top 12] [--out bench/results/NAME.json]
                                    [--marker kvpush/ --marker /work/main/src/kvpush/ ...]

A frame is kvpush's when its file path holds a marker: `kvpush/` for an installed wheel (the GPU machine); a
checkout installed in place (this repository's venv) needs its folders, e.g. `--marker /work/main/src/kvpush/`.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_io import write_result  # bench/, this script's folder

_PROCESS = re.compile(r'^process (\d+):"([^"]*)')
_THREAD = re.compile(r"^thread \((\d+)\): (.*)$")


def parse_line(line: str) -> tuple[str, str, list[str], int] | None:
    """(process, thread, frames, samples) of one raw line; None when it has no thread frame."""
    stack, _, count = line.rstrip("\n").rpartition(" ")
    if not stack or not count.isdigit():
        return None
    process, frames = "", stack.split(";")
    for index, frame in enumerate(frames):
        match = _PROCESS.match(frame)
        if match:
            process = f"{match.group(1)} {match.group(2).split()[0]}"
            continue
        thread = _THREAD.match(frame)
        if thread:
            return process, thread.group(2), frames[index + 1:], int(count)
    return None


def summarise(lines, top: int = 12, markers: tuple[str, ...] = ("kvpush/",)) -> dict:
    samples: collections.Counter = collections.Counter()
    in_kvpush: collections.Counter = collections.Counter()
    outer: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    leaves: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    for line in lines:
        parsed = parse_line(line)
        if parsed is None:
            continue
        process, thread, frames, count = parsed
        key = (process, thread)
        samples[key] += count
        kvpush = [i for i, frame in enumerate(frames) if any(marker in frame for marker in markers)]
        if kvpush:
            in_kvpush[key] += count
            outer[key][frames[kvpush[0]]] += count
            leaves[key][frames[-1]] += count
    return {"threads": [
        {"process": process, "thread": thread, "samples": n, "samples_in_kvpush": in_kvpush[(process, thread)],
         "outermost_kvpush_frames": outer[(process, thread)].most_common(top),
         "leaves_under_kvpush": leaves[(process, thread)].most_common(top)}
        for (process, thread), n in samples.most_common()]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--marker", action="append", default=None,
                        help="a path fragment of kvpush's files (repeatable; default kvpush/)")
    args = parser.parse_args(argv)
    markers = tuple(args.marker or ("kvpush/",))
    with args.profile.open() as lines:
        summary = {"profile": args.profile.name, "markers": list(markers), **summarise(lines, args.top, markers)}
    if args.out:
        write_result(args.out, summary, indent=1)
    else:
        print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
