"""bench/hops_bench.py's pure part: one request's hops from its spans and its directory record."""

from __future__ import annotations

from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.bench_scripts import load_bench
from tests.fixtures.otlp import ReceivedSpan


def _span(name: str, start_s: float, end_s: float) -> ReceivedSpan:
    return ReceivedSpan("svc", name, "t", "s", "", {}, [], 0, int(start_s * 1e9), int(end_s * 1e9))


def _stamp(target, seconds: float) -> None:
    target.FromNanoseconds(int(seconds * 1e9))


def test_hops_are_the_differences_of_span_and_record_times():
    hops = load_bench("hops_bench")
    base = 1_800_000_000.0
    transfer = tpb.Transfer()
    for field, offset in (("allocate_time", 0.012), ("first_ready_time", 0.010), ("dispatch_time", 0.0125),
                          ("end_time", 0.020)):
        _stamp(getattr(transfer, field), base + offset)
    timing = transfer.rank_timings.add(tp_rank=0).timing
    _stamp(timing.first_write_start_time, base + 0.013)
    _stamp(timing.last_write_end_time, base + 0.016)
    _stamp(timing.prefill_end_time, base + 0.015)
    spans = [_span("gateway.request", base + 0.001, base + 0.05), _span("gateway.plan", base + 0.0012, base + 0.003),
             _span("gateway.prefill_leg", base + 0.0032, base + 0.025), _span("kvpush.receive", base + 0.012,
                                                                                base + 0.021)]
    got = hops.hops_of(base, 0.026, transfer, spans, request_finished=base + 0.017)
    assert got == {"gateway_in": 1.0, "before_plan": 0.2, "request_to_leg": 2.2, "plan": 1.8, "legs_sent": 0.2,
                   "decode_allocated": 8.8, "first_ready": 6.8, "instruction": 0.5, "writes": 3.0,
                   "prefill_compute": 11.8, "completion": 4.0, "decode_notified": 1.0, "prefill_answer": 10.0,
                   "prefill_finished": 2.0, "answer_http": 8.0, "to_client": 1.0}
    assert set(got) == set(hops.HOPS)


def test_a_second_gateway_is_compared_round_by_round():
    """kvpush_b against kvpush: the median, p10 and p90 of the per-round differences and how often b was slower."""
    hops = load_bench("hops_bench")
    kinds = hops.KINDS
    pairs = [{**{f"{k}_ttft_ms": 10.0 for k in kinds}, "kvpush_b_ttft_ms": 10.0 + d} for d in range(-3, 7)]
    split = hops.split_of(pairs)
    assert (split["kvpush_b_minus_kvpush"], split["kvpush_b_minus_kvpush_p10"], split["kvpush_b_minus_kvpush_p90"],
            split["kvpush_b_slower_rounds"]) == (1.5, -2.0, 6.0, 6)
    assert "kvpush_b_ttft" not in hops.split_of([{k: v for k, v in p.items() if k != "kvpush_b_ttft_ms"}
                                                 for p in pairs])


def test_the_engine_stages_split_the_connector_cost_round_by_round():
    """With --engine-stages each kind carries the prefill engine's stages; split_of gives p_leg − p_alone per stage."""
    hops = load_bench("hops_bench")
    kinds = hops.KINDS

    def stages(prefill: float, queue: float | None = 0.1) -> dict:
        return {"engine_ttft": prefill + 1.0, "queue": queue, "prefill": prefill}

    pairs = [{**{f"{k}_ttft_ms": 10.0 for k in kinds}, **{f"{k}_engine_ms": stages(5.0) for k in kinds},
              "p_leg_engine_ms": stages(5.0 + extra, queue=None if extra == 3 else 0.1)} for extra in (1, 2, 3)]
    split = hops.split_of(pairs)
    assert split["engine_connector_on_prefill_prefill"] == 2.0
    assert split["engine_connector_on_prefill_engine_ttft"] == 2.0
    assert split["engine_connector_on_prefill_queue"] == 0.0  # the round without a queue figure is left out
    assert (split["engine_p_leg_prefill"], split["engine_p_alone_prefill"]) == (7.0, 5.0)
    assert "engine_kvpush_b_prefill" not in split
    assert "engine_p_leg_prefill" not in hops.split_of([{k: v for k, v in p.items() if not k.endswith("_engine_ms")}
                                                        for p in pairs])


def test_each_difference_has_a_bootstrap_interval_around_its_median():
    """The headline and its split carry a 95 % interval of the median that holds the median and widens with spread."""
    hops = load_bench("hops_bench")
    kinds = hops.KINDS
    narrow = [{**{f"{k}_ttft_ms": 20.0 for k in kinds}, "kvpush_ttft_ms": 25.0 + (i % 3 - 1) * 0.1} for i in range(30)]
    wide = [{**p, "kvpush_ttft_ms": 25.0 + (i % 7 - 3) * 4.0} for i, p in enumerate(narrow)]
    narrow_split, wide_split = hops.split_of(narrow), hops.split_of(wide)
    low, high = narrow_split["kvpush_minus_p_alone_ci95"]
    assert low <= narrow_split["kvpush_minus_p_alone"] == 5.0 <= high and high - low <= 0.2
    wide_low, wide_high = wide_split["kvpush_minus_p_alone_ci95"]
    assert wide_low <= wide_split["kvpush_minus_p_alone"] <= wide_high and wide_high - wide_low >= 4.0
    assert narrow_split["gateway_ci95"] == [0.0, 0.0]
    assert hops.split_of(narrow[:1])["kvpush_minus_p_alone_ci95"] is None
