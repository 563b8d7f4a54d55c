"""The prefill engine's stage means from two scrapes of vLLM's Prometheus page (bench/hops_bench.py, which
prefill_stages_bench.py and hops_bench --engine-stages use)."""

from __future__ import annotations

from tests.fixtures.bench_scripts import load_bench


def _page(ttft_sum: float, ttft_count: int, queue_sum: float, prefill_sum: float, count: int) -> str:
    # vLLM's exposition: one series per model/engine label set, buckets as well as _sum and _count.
    return "\n".join([
        "# TYPE vllm:time_to_first_token_seconds histogram",
        f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.01",model_name="tiny"}} {ttft_count}',
        f'vllm:time_to_first_token_seconds_sum{{engine="0",model_name="tiny"}} {ttft_sum}',
        f'vllm:time_to_first_token_seconds_count{{engine="0",model_name="tiny"}} {ttft_count}',
        f'vllm:request_queue_time_seconds_sum{{engine="0",model_name="tiny"}} {queue_sum}',
        f'vllm:request_queue_time_seconds_count{{engine="0",model_name="tiny"}} {count}',
        f'vllm:request_prefill_time_seconds_sum{{engine="0",model_name="tiny"}} {prefill_sum}',
        f'vllm:request_prefill_time_seconds_count{{engine="0",model_name="tiny"}} {count}',
        'vllm:request_prefill_time_seconds_created{engine="0",model_name="tiny"} 1.7e9',
    ])


def test_stage_means_are_the_differences_of_sums_over_counts():
    bench = load_bench("hops_bench")
    before = bench.stage_totals(_page(1.0, 10, 0.01, 0.5, 10))
    after = bench.stage_totals(_page(1.2, 20, 0.0105, 0.65, 20))
    means = bench.stage_means(before, after)
    assert means == {"engine_ttft": 20.0, "queue": 0.05, "prefill": 15.0}


def test_a_block_without_finished_requests_has_no_mean():
    bench = load_bench("hops_bench")
    page = bench.stage_totals(_page(1.0, 10, 0.01, 0.5, 10))
    assert bench.stage_means(page, page) == {"engine_ttft": None, "queue": None, "prefill": None}
