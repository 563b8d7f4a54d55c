"""`python -m bench <subcommand> [mode] [options]`: one entry point over the benchmark scripts of this folder.

A subcommand with modes runs the script of its mode (`python -m bench gateway latency --rounds 150`); the others run
their script with the rest of the command line (`python -m bench ttft --phases kvpush`). Each script keeps its own
options (`python -m bench gateway latency --help`). The scripts import their siblings by plain name (as when run as
`python bench/<script>.py`, which still works), so this folder goes first on sys.path.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent


@dataclass(frozen=True, slots=True)
class Script:
    """One script: its path under bench/ (without .py) and what it measures, for --help."""

    path: str
    summary: str


# subcommand -> one script, or modes -> scripts. The first mode of a group is listed first in its --help.
COMMANDS: dict[str, Script | dict[str, Script]] = {
    "ttft": Script("ttft_bench", "TTFT of one request at a time, kvpush against vLLM's NIXL connectors and a "
                                 "colocated engine (CPU engines, shaped P/D link; root for the namespaces)"),
    "ttft-ab": Script("ttft_ab", "ttft on two commits of kvpush, rounds alternating in one run: TTFT new / old"),
    "serve": Script("serve_bench", "`vllm bench serve` through the gateway for every P/D connector, side by side"),
    "gateway": {
        "latency": Script("gateway_latency_bench", "what the gateway adds to TTFT, stand-in engines (no vLLM)"),
        "cpu": Script("gateway_cpu_bench", "the standalone gateway's CPU time per request, stand-in engines"),
        "tokenize": Script("gateway_tokenize_bench", "what counting a text prompt's tokens costs TTFT (CPU stack)"),
    },
    "hops": {
        "split": Script("hops_bench", "kvpush's TTFT over the prefill alone, split into hops (traces, records)"),
        "prefill-stages": Script("prefill_stages_bench", "a prefill leg's extra time by the prefill engine's stages"),
        "decode-step": Script("decode_step_bench", "what a decode engine's settings cost per step (plain engines)"),
        "first-contact": Script("first_contact_bench", "the first requests of a fresh P/D pair, peers loaded ahead "
                                                       "or not"),
        "wakeup": Script("wakeup_probe", "what waking an idle process costs a round trip (bare server, gateway)"),
    },
    "dataplane": {
        "cpu": Script("dataplane_bench", "PushWriter WRITE throughput against memcpy, two processes (DRAM)"),
        "gpu": Script("dataplane_gpu_bench", "the same on two GPUs, and layer streaming behind a computing model"),
        "gil": Script("nixl_gil_probe", "whether NIXL's binding releases the GIL while it makes and posts a transfer"),
        "stream": Script("gpu_stream_probe", "one GPU shared with decode: when each streamed layer's write is seen "
                                             "done, behind a stand-in forward (no vLLM)"),
    },
    "plan": {
        "run": Script("plan_bench", "planning a layer's write on the forward thread: full plan against moved plan"),
        "compare": Script("plan_bench_compare", "plan_bench against another commit, rounds interleaved"),
    },
    "directory": Script("directory_bench", "the KV directory's layer events/s and dispatch latency (replicas too)"),
    "soak": Script("soak", "many transfers with faults injected; nothing may hang, leak or come back corrupt"),
    "gpu": Script("gpu_e2e", "inside CUDA vLLM on one GPU machine: e2e, serve, hops, plot, table, classify "
                             "(bench/gpu_run.sh runs it on the device)"),
    "connector": Script("connector_gpu_run", "the connector's worker halves on two GPUs, vLLM's hooks played "
                                             "in its order"),
    "netns": Script("netns", "create, reshape or remove the benchmarks' P/D network namespaces (root)"),
    "profile": {
        "summary": Script("profile_summary", "summarise a py-spy raw profile of a kvpush engine"),
        "timeline": Script("hook_timeline/summarize", "a prefill step's stages from bench/hook_timeline's records"),
    },
}


def _usage() -> str:
    lines = ["usage: python -m bench <subcommand> [mode] [options]   (`... --help` for a script's options)", ""]
    for name, entry in COMMANDS.items():
        if isinstance(entry, Script):
            lines.append(f"  {name:<24}{entry.summary}")
        else:
            lines.append(f"  {name} <{'|'.join(entry)}>")
            lines += [f"    {mode:<22}{script.summary}" for mode, script in entry.items()]
    lines += ["", "Figures of record and the command of each: docs/benchmarks.md."]
    return "\n".join(lines)


def _load(script: Script) -> ModuleType:
    if "/" not in script.path:
        return importlib.import_module(script.path)
    name = script.path.replace("/", "_")
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{script.path}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def resolve(argv: list[str]) -> tuple[Script, list[str], list[str]] | str:
    """The script `argv` names, the words that named it and the script's own arguments; or a usage message."""
    if not argv or argv[0] in ("-h", "--help", "help"):
        return _usage()
    entry = COMMANDS.get(argv[0])
    if entry is None:
        return f"unknown subcommand {argv[0]!r}\n\n{_usage()}"
    if isinstance(entry, Script):
        return entry, argv[:1], argv[1:]
    if len(argv) < 2 or argv[1] not in entry:
        modes = "\n".join(f"  {mode:<22}{script.summary}" for mode, script in entry.items())
        return f"usage: python -m bench {argv[0]} <mode> [options]\n\nmodes:\n{modes}"
    return entry[argv[1]], argv[:2], argv[2:]


def main(argv: list[str] | None = None) -> int:
    """Run the script the command line names, as if it had been started as `python bench/<script>.py`."""
    argv = sys.argv[1:] if argv is None else argv
    found = resolve(argv)
    if isinstance(found, str):
        print(found, file=sys.stdout if argv[:1] in ([], ["-h"], ["--help"], ["help"]) else sys.stderr)
        return 0 if argv[:1] in ([], ["-h"], ["--help"], ["help"]) else 2
    script, words, rest = found
    for folder in (str(BENCH), str(BENCH.parent)):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    sys.argv = [" ".join(["python -m bench", *words]), *rest]  # argparse's prog: what the user typed
    code = _load(script).main()
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
