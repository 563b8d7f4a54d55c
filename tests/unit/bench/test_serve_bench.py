"""bench/serve_bench.py's pure parts: variant wiring, the summary of a `vllm bench serve` result, ratios, plot."""

from __future__ import annotations

from tests.fixtures.bench_scripts import load_bench


def _point(ttft: float, tpot: float) -> dict:
    return {"completed": 4, "failed": 0, "request_throughput": 2.0, "output_throughput": 20.0, "duration": 2.0,
            "mean_ttft_ms": ttft, "median_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "mean_tpot_ms": tpot,
            "p99_tpot_ms": tpot, "mean_itl_ms": tpot, "p99_itl_ms": tpot, "unrelated": [1, 2]}


def test_variants_map_to_connectors_and_fair_env():
    """Fair variants run the stock connector with the paced progress thread; kvpush variants run kvpush."""
    bench = load_bench("serve_bench")
    assert bench.connector_of("nixl-pull-fair") == "nixl-pull" and bench.connector_of("kvpush-first-token") == "kvpush"
    env = bench.variant_env("nixl-push-fair")
    assert env["KVPUSH_BENCH_NIXL_PTHR_DELAY_US"] == "100" and str(bench.PACED_SITE) in env["PYTHONPATH"]
    assert bench.variant_env("nixl-push") == {}


def test_summary_ratios_and_plot(tmp_path):
    """The summary keeps the latency figures, ratios divide kvpush by each baseline, the plot is a PNG."""
    bench = load_bench("serve_bench")
    summary = bench.summarise(_point(10.0, 5.0))
    assert summary["p99_ttft_ms"] == 20.0 and "unrelated" not in summary
    result = {"settings": {"rates": [4.0], "model": "tiny", "isl": 64, "osl": 4, "num_prompts": 4, "netns": False},
              "variants": {"kvpush-first-token": {"points": {"4.0": bench.summarise(_point(10.0, 5.0))}},
                           "nixl-pull-fair": {"points": {"4.0": bench.summarise(_point(40.0, 4.0))}}}}
    bench.add_ratios(result)
    assert result["ratios"]["kvpush-first-token/nixl-pull-fair"]["4.0"] == {
        "mean_ttft_ms": 0.25, "p99_ttft_ms": 0.25, "mean_tpot_ms": 1.25}
    bench.plot(result, tmp_path / "serve.png")
    assert (tmp_path / "serve.png").read_bytes()[:4] == b"\x89PNG"
