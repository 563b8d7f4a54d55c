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


def test_the_alloc_at_once_variant_turns_the_wait_off_and_is_compared_with_kvpush():
    """kvpush-alloc-at-once runs kvpush with decode_allocation_wait_s null; the ratios divide kvpush's TTFT and
    decode block hold by its."""
    bench = load_bench("serve_bench")
    assert bench.connector_of("kvpush-alloc-at-once") == "kvpush"
    assert bench.VARIANT_CONNECTOR_EXTRA["kvpush-alloc-at-once"] == {"decode_allocation_wait_s": None}
    held = {"allocated_to_end_ms": {"p50": 100.0, "p99": 400.0}}
    waiting = {**bench.summarise(_point(12.0, 5.0)), "decode_blocks": {"allocated_to_end_ms": {"p50": 25.0,
                                                                                              "p99": 50.0}}}
    result = {"settings": {"rates": [4.0]},
              "variants": {"kvpush": {"points": {"4.0": waiting}},
                           "kvpush-alloc-at-once": {"points": {"4.0": {**bench.summarise(_point(10.0, 5.0)),
                                                                       "decode_blocks": held}}}}}
    bench.add_ratios(result)
    assert result["ratios"]["kvpush/kvpush-alloc-at-once"]["4.0"] == {
        "mean_ttft_ms": 1.2, "p99_ttft_ms": 1.2, "mean_tpot_ms": 1.0, "allocated_to_end_p50": 0.25,
        "allocated_to_end_p99": 0.125}


def test_decode_block_hold_reads_the_points_transfers_from_the_directory():
    """One transfer allocated after its first readiness, then done: its figures; one planned before the point is
    left out."""
    import time

    from kvpush.client.config import ChannelConfig
    from kvpush.client.sync import SyncDirectoryClient
    from kvpush.v1 import directory_pb2 as dpb
    from tests.fixtures.directory import DECODE, PREFILL, directory_on_loopback, ready, register_request, result

    bench = load_bench("serve_bench")
    with directory_on_loopback() as address, SyncDirectoryClient(ChannelConfig(address=address)) as client:
        registration = client.start_registration(register_request("p", PREFILL))
        client.register_engine(register_request("d", DECODE))
        session = client.open_prefill_session(registration)
        client.plan_transfer(prompt_token_count=40)  # before the point: not counted
        since = time.time()
        transfer_id = client.plan_transfer(prompt_token_count=40).transfer.transfer_id
        session.send_ready([ready(transfer_id, 0, 4)])
        deadline = time.monotonic() + 10
        while not client.get_transfer(transfer_id).HasField("first_ready_time"):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        client.report_allocation(transfer_id, "d", [1, 2, 3], prompt_token_count=40)
        session.send_result(result(transfer_id, dpb.WRITE_RESULT_STATUS_DONE, layers=4, bytes_written=1))
        while not client.get_transfer(transfer_id).HasField("end_time"):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        hold = bench.decode_block_hold(address, since)
    assert hold["transfers"] == 1 and hold["allocated_before_first_ready"] == 0
    assert 0 <= hold["plan_to_first_ready_ms"]["p50"] <= hold["plan_to_allocated_ms"]["p50"]
    assert hold["allocated_to_end_ms"]["p50"] >= 0
