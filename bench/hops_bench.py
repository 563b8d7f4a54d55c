"""kvpush's fixed cost per request: its TTFT broken into hops from the traces and the transfer's record.

What runs: the local stack (tiny model, loopback, first token from prefill on: the gateway's default), every
process exporting its spans over OTLP to a real receiver in this process (tests/fixtures/otlp.py). Requests go
one at a time (low load), alternating two kinds on the same random token-id prompt of `--prompt-tokens`:
  * kvpush     streamed through the gateway (greedy, `--max-tokens`);
  * p_alone    the same prompt straight to the prefill engine, streamed, max_tokens=1, no kv_transfer_params:
               the P leg alone, on the same engine in the same conditions;
  * p_alone_json  the same, not streamed (TTFT = the whole answer): what vLLM's non-streamed answer path costs
               against its streamed one (the gateway's prefill leg used the non-streamed path until it streamed).
  * p_leg      the same prompt straight to the prefill engine as a prefill leg (kv_transfer_params of a transfer
               this bench planned, first token from prefill), no decode leg, the transfer cancelled afterwards:
               what the connector costs the prefill engine's request (readiness, spans; no writes);
  * kvpush_one_token  through the gateway with max_tokens=1: the gateway plans and answers from the prefill leg
               alone (the transfer is cancelled), so against p_leg it is what the gateway adds, and kvpush against
               it is what the concurrent decode leg and the push add.
  * kvpush_b   (with --gateway-b-args) kvpush through a second gateway started with those flags against the same
               directory and engines: a gateway change against the default, side by side in one run; with
               --gateway-b-hosted through the gateway hosted in the prefill engine's API server instead.
With --engine-stages the prefill engine's /metrics is scraped before and after every request (outside its TTFT),
so each kind also gets vLLM's own stages on the prefill engine (ENGINE_STAGES: engine TTFT, queue, prefill =
scheduled -> first token), and connector_on_prefill is split by them (`engine_connector_on_prefill_<stage>`).
TTFT = request sent -> first SSE event at the client. Per kvpush request the hops come from its trace (gateway
spans, the engines' kvpush.push / kvpush.receive) and its directory record (plan, allocation, first readiness,
instruction, end; prefill's write and prefill-end times), all wall clock on one machine:

  gateway_in        client sent -> gateway.request starts
  before_plan       gateway.request start -> gateway.plan starts (validation, prompt count)
  request_to_leg    gateway.request start -> gateway.prefill_leg starts (the gateway's own time before the leg)
  plan              gateway.plan (PlanTransfer round trip)
  legs_sent         gateway.plan end -> gateway.prefill_leg starts
  decode_allocated  prefill leg sent -> the directory has decode's allocation (decode's HTTP, scheduling, report)
  first_ready       prefill leg sent -> the directory has prefill's first ready layer
  instruction       max(allocation, first ready) -> push instruction dispatched
  writes            first WRITE posted -> last WRITE landed (prefill's timing)
  prefill_compute   prefill leg sent -> prefill's forward of the last layer ended
  completion        last WRITE landed -> the directory ends the transfer (DONE, which waits for the token)
  decode_notified   transfer end -> decode's kvpush.receive ends (COMPLETE event to decode's worker)
  prefill_answer    prefill's forward ended -> gateway.prefill_leg ends (sampling, vLLM's HTTP answer), split in
    prefill_finished  prefill's forward ended -> its scheduler finished the request (sampling, output processing)
    answer_http       the request finished -> gateway.prefill_leg ends (vLLM's API server, HTTP)
                      (these two need the push timeline's request_finished_time from X-KVPush-Prefill-Params, which
                      a streamed prefill leg does not carry: None since the gateway streams that leg)
  to_client         gateway.prefill_leg end -> first event at the client
Figures: each hop's median, TTFT medians of every kind and the headline "kvpush TTFT - P leg alone" (median of the
per-pair differences), split by the kinds above into connector_on_prefill (p_leg - p_alone), gateway
(kvpush_one_token - p_leg) and decode_leg (kvpush - kvpush_one_token), each a median of per-round differences.
JSON to bench/results/hops-<UTC time>.json.

    python bench/hops_bench.py [--iterations 30] [--prompt-tokens 512] [--max-tokens 8] [--engine-stages]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shlex
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_io import emit

from kvpush.localstack.client import call, stream_completion

if TYPE_CHECKING:  # annotations only: the receiver itself is imported where the bench runs (main)
    from tests.fixtures.otlp import ReceivedSpan

# Every kind of request of one round (module docstring); the order rotates from round to round.
KINDS = ("kvpush", "p_alone", "p_alone_json", "p_leg", "kvpush_one_token")

# vLLM's per-request histograms on the prefill engine (seconds), by the name the benches report them under: engine
# TTFT = arrival at the API server's engine client -> first token; queue = arrival in the engine core -> first
# scheduled; prefill = first scheduled -> first token.
ENGINE_STAGES = {"engine_ttft": "vllm:time_to_first_token_seconds", "queue": "vllm:request_queue_time_seconds",
                 "prefill": "vllm:request_prefill_time_seconds"}

HOPS = ("gateway_in", "before_plan", "request_to_leg", "plan", "legs_sent", "decode_allocated", "first_ready",
        "instruction", "writes", "prefill_compute", "completion", "decode_notified", "prefill_answer",
        "prefill_finished", "answer_http", "to_client")


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(length)]


def _s(timestamp) -> float | None:
    """Seconds since the epoch of a protobuf Timestamp; None when unset."""
    nanos = timestamp.ToNanoseconds()
    return nanos / 1e9 if nanos else None


def _ms(later: float | None, earlier: float | None) -> float | None:
    return None if later is None or earlier is None else round((later - earlier) * 1000, 3)


def _span(spans: list[ReceivedSpan], name: str) -> ReceivedSpan | None:
    found = [s for s in spans if s.name == name]
    return min(found, key=lambda s: s.start_time_unix_nano) if found else None


def hops_of(sent_wall: float, ttft_s: float, transfer, spans: list[ReceivedSpan],
            request_finished: float | None = None) -> dict[str, float | None]:
    """One request's hops (module docstring) from its spans and directory record."""
    def start(name):
        span = _span(spans, name)
        return span.start_time_unix_nano / 1e9 if span else None

    def end(name):
        span = _span(spans, name)
        return span.end_time_unix_nano / 1e9 if span else None

    timing = transfer.rank_timings[0].timing if transfer.rank_timings else None
    first_write = _s(timing.first_write_start_time) if timing else None
    last_write = _s(timing.last_write_end_time) if timing else None
    prefill_end = _s(timing.prefill_end_time) if timing else None
    allocated, first_ready = _s(transfer.allocate_time), _s(transfer.first_ready_time)
    legs = start("gateway.prefill_leg")
    return {
        "gateway_in": _ms(start("gateway.request"), sent_wall),
        "before_plan": _ms(start("gateway.plan"), start("gateway.request")),
        "request_to_leg": _ms(legs, start("gateway.request")),
        "plan": _ms(end("gateway.plan"), start("gateway.plan")),
        "legs_sent": _ms(legs, end("gateway.plan")),
        "decode_allocated": _ms(allocated, legs),
        "first_ready": _ms(first_ready, legs),
        "instruction": _ms(_s(transfer.dispatch_time), max(allocated or 0, first_ready or 0) or None),
        "writes": _ms(last_write, first_write),
        "prefill_compute": _ms(prefill_end, legs),
        "completion": _ms(_s(transfer.end_time), last_write),
        "decode_notified": _ms(end("kvpush.receive"), _s(transfer.end_time)),
        "prefill_answer": _ms(end("gateway.prefill_leg"), prefill_end),
        "prefill_finished": _ms(request_finished, prefill_end),
        "answer_http": _ms(end("gateway.prefill_leg"), request_finished),
        "to_client": _ms(sent_wall + ttft_s, end("gateway.prefill_leg")),
    }


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


def _median_ci95(values, resamples: int = 2000) -> list[float] | None:
    """A 95 % bootstrap interval of the median (percentiles of `resamples` medians of resampled values, seeded, so
    a file's figures can be recomputed). On the H200 one round's difference spans -9..+19 ms around a 5 ms median:
    the interval says how far a median of this many rounds can be trusted."""
    values = [v for v in values if v is not None]
    if len(values) < 2:
        return None
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return [round(medians[int(resamples * 0.025)], 3), round(medians[int(resamples * 0.975) - 1], 3)]


def _decile(values, which: int) -> float | None:
    """The `which`-th decile (1: p10, 9: p90) of the values, by the nearest rank below."""
    values = sorted(values)
    return round(values[len(values) * which // 10], 3) if values else None


def stage_totals(metrics_text: str) -> dict[str, tuple[float, float]]:
    """(sum seconds, count) of each ENGINE_STAGES histogram in a Prometheus text page (summed over label sets)."""
    totals = {}
    for stage, name in ENGINE_STAGES.items():
        found = []
        for suffix in ("_sum", "_count"):
            pattern = rf"^{re.escape(name)}{suffix}(?:\{{[^}}]*\}})? (\S+)$"
            found.append(sum(float(m.group(1)) for m in re.finditer(pattern, metrics_text, re.M)))
        totals[stage] = (found[0], found[1])
    return totals


def stage_means(before: dict[str, tuple[float, float]],
                after: dict[str, tuple[float, float]]) -> dict[str, float | None]:
    """Each stage's mean over the requests that finished between two scrapes (ms; None when none did)."""
    means = {}
    for stage in ENGINE_STAGES:
        count = after[stage][1] - before[stage][1]
        means[stage] = round((after[stage][0] - before[stage][0]) / count * 1e3, 3) if count else None
    return means


def scrape_stages(url: str) -> dict[str, tuple[float, float]]:
    """stage_totals of the engine at `url` (its API server's /metrics)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        return stage_totals(response.read().decode())


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--gap-s", type=float, default=0.3, help="pause between requests (low load)")
    parser.add_argument("--gateway-b-args", default=None,
                        help="start a second gateway with these flags (e.g. \"--uvloop\") and add kind kvpush_b")
    parser.add_argument("--gateway-b-hosted", action="store_true",
                        help="kind kvpush_b through the gateway hosted in the prefill engine's API server "
                             "(kvpush.gateway.hosted) instead of a second standalone one")
    parser.add_argument("--engine-stages", action="store_true",
                        help="scrape the prefill engine's /metrics around every request: its stages per kind")
    parser.add_argument("--connector-extra", type=json.loads, default={},
                        help="more kv_connector_extra_config for both engines, JSON "
                             "(e.g. '{\"nixl_notif_poll_s\": 0.01}')")
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    if args.gateway_b_hosted and args.gateway_b_args is not None:
        parser.error("--gateway-b-hosted and --gateway-b-args both name kind kvpush_b's gateway: give one")
    return args


def measure_round(index: int, prompt: list[int], body: dict, gateway_url: str, prefill_url: str, client,
                  prefill_engine_id: str, decode_engine_id: str, gap_s: float, gateway_b_url: str = "",
                  stages_url: str = "") -> dict:
    """One round: every kind of KINDS (and kvpush_b with `gateway_b_url`) on `prompt`, one at a time, in the
    order rotated by `index`.

    Returns each kind's TTFT (`<kind>_ttft_ms`), and for the kvpush request its transfer id, send time and
    the prefill push timeline's request-finished time (when the answer carried it). With `stages_url` (the
    prefill engine's API server) each kind's request also gets the prefill engine's stages (`<kind>_engine_ms`:
    ENGINE_STAGES from its /metrics scraped before and after that request alone).
    """
    kinds = KINDS + (("kvpush_b",) if gateway_b_url else ())
    order = kinds[index % len(kinds):] + kinds[:index % len(kinds)]  # each kind in each place equally often
    pair: dict = {}
    for kind in order:
        time.sleep(gap_s)
        before = scrape_stages(stages_url) if stages_url else None
        _send(kind, pair, prompt, body, gateway_url, prefill_url, client, prefill_engine_id, decode_engine_id,
              gateway_b_url)
        if before is not None:
            time.sleep(0.05)  # vLLM records a finished request's stats as it answers it: let that land
            pair[f"{kind}_engine_ms"] = stage_means(before, scrape_stages(stages_url))
    return pair


def _send(kind: str, pair: dict, prompt: list[int], body: dict, gateway_url: str, prefill_url: str, client,
          prefill_engine_id: str, decode_engine_id: str, gateway_b_url: str) -> None:
    """One request of `kind` (module docstring); its TTFT and the kvpush request's transfer go into `pair`."""
    sent_wall = time.time()
    if kind == "kvpush_b":
        result = stream_completion(gateway_b_url + "/v1/completions", {**body, "prompt": prompt}, timeout_s=120)
    elif kind == "kvpush":
        result = stream_completion(gateway_url + "/v1/completions", {**body, "prompt": prompt}, timeout_s=120)
        pair["transfer_id"] = result.headers.get("x-kvpush-transfer-id", "")
        pair["sent_wall"] = sent_wall
        params = json.loads(result.headers.get("x-kvpush-prefill-params") or "{}")
        pair["request_finished_wall"] = (params.get("push_timeline") or {}).get("request_finished_time")
    elif kind == "kvpush_one_token":
        result = stream_completion(gateway_url + "/v1/completions", {**body, "prompt": prompt, "max_tokens": 1},
                                   timeout_s=120)
    elif kind == "p_leg":
        planned = client.plan_transfer(prompt_token_count=len(prompt), prefill_engine_id=prefill_engine_id,
                                       decode_engine_id=decode_engine_id)
        transfer_id = planned.transfer.transfer_id
        result = stream_completion(prefill_url + "/v1/completions", {
            **body, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {
                "transfer_id": transfer_id, "do_remote_decode": True, "first_token_from_prefill": True}},
            timeout_s=120)
        client.cancel_transfer(transfer_id, "hops bench: a prefill leg without decode")
    elif kind == "p_alone":
        result = stream_completion(prefill_url + "/v1/completions", {**body, "prompt": prompt, "max_tokens": 1},
                                   timeout_s=120)
    else:
        answer = call("POST", prefill_url + "/v1/completions", {**body, "prompt": prompt, "max_tokens": 1},
                      timeout_s=120)
        if answer.status != 200:
            raise RuntimeError(f"{kind} request failed: {answer.status} {answer.text[:200]}")
        pair[f"{kind}_ttft_ms"] = round(answer.elapsed_s * 1000, 3)
        return
    if result.status != 200 or result.error:
        raise RuntimeError(f"{kind} request failed: {result.status} {result.error}")
    pair[f"{kind}_ttft_ms"] = round(result.ttft_s * 1000, 3)


# The headline and its split: (name, minuend kind, subtrahend kind), each a median of per-round differences.
DIFFERENCES = (("kvpush_minus_p_alone", "kvpush", "p_alone"), ("connector_on_prefill", "p_leg", "p_alone"),
               ("gateway", "kvpush_one_token", "p_leg"), ("decode_leg", "kvpush", "kvpush_one_token"))


def split_of(pairs: list[dict]) -> dict[str, float | list[float] | None]:
    """Each kind's median TTFT and the headline split (module docstring), medians of per-round differences, each
    with its 95 % bootstrap interval (`<name>_ci95`)."""
    differences = {name: [p[f"{a}_ttft_ms"] - p[f"{b}_ttft_ms"] for p in pairs] for name, a, b in DIFFERENCES}
    return {
        "kvpush_ttft": _median(p["kvpush_ttft_ms"] for p in pairs),
        "p_alone_ttft": _median(p["p_alone_ttft_ms"] for p in pairs),
        "p_alone_json_ttft": _median(p["p_alone_json_ttft_ms"] for p in pairs),
        "p_leg_ttft": _median(p["p_leg_ttft_ms"] for p in pairs),
        "kvpush_one_token_ttft": _median(p["kvpush_one_token_ttft_ms"] for p in pairs),
        "p_alone_json_minus_p_alone": _median(p["p_alone_json_ttft_ms"] - p["p_alone_ttft_ms"] for p in pairs),
        **{name: _median(values) for name, values in differences.items()},
        **{f"{name}_ci95": _median_ci95(values) for name, values in differences.items()},
        **(_b_against_a(pairs) if pairs and "kvpush_b_ttft_ms" in pairs[0] else {}),
        **(_engine_split(pairs) if pairs and "p_leg_engine_ms" in pairs[0] else {}),
    }


def _engine_split(pairs: list[dict]) -> dict[str, float | None]:
    """The prefill engine's stages per kind (`engine_<kind>_<stage>`, medians) and the connector's cost on prefill
    split by them (`engine_connector_on_prefill_<stage>`: p_leg − p_alone per round): what of p_leg's extra time is
    inside vLLM's engine (scheduled -> first token, the queue) and what is outside (API server, HTTP)."""
    split: dict[str, float | None] = {}
    kinds = [kind for kind in KINDS + ("kvpush_b",) if f"{kind}_engine_ms" in pairs[0]]  # every kind reaches prefill
    for stage in ENGINE_STAGES:
        for kind in kinds:
            split[f"engine_{kind}_{stage}"] = _median(p[f"{kind}_engine_ms"][stage] for p in pairs)
        split[f"engine_connector_on_prefill_{stage}"] = _median(
            None if p["p_leg_engine_ms"][stage] is None or p["p_alone_engine_ms"][stage] is None
            else p["p_leg_engine_ms"][stage] - p["p_alone_engine_ms"][stage] for p in pairs)
    return split


def _b_against_a(pairs: list[dict]) -> dict[str, float | int | None]:
    """The second gateway (kvpush_b) against the first, per round: median, p10 and p90 of b − a, rounds b was slower."""
    differences = [p["kvpush_b_ttft_ms"] - p["kvpush_ttft_ms"] for p in pairs]
    return {"kvpush_b_ttft": _median(p["kvpush_b_ttft_ms"] for p in pairs),
            "kvpush_b_minus_kvpush": _median(differences),
            "kvpush_b_minus_kvpush_ci95": _median_ci95(differences),
            "kvpush_b_minus_kvpush_p10": _decile(differences, 1),
            "kvpush_b_minus_kvpush_p90": _decile(differences, 9),
            "kvpush_b_slower_rounds": sum(d > 0 for d in differences)}


def attach_span_hops(pairs: list[dict], receiver, get_transfer, timeout_s: float = 60.0) -> None:
    """Give each round's kvpush request its hops (`hops_ms`, HOPS) from its trace and its directory record
    (`get_transfer(transfer_id)`: the Transfer message), and its first token against the transfer's end."""
    # Spans leave in batches, per process; wait (bounded) until every measured request's spans arrived.
    wanted = {p["transfer_id"] for p in pairs}

    def arrived(spans) -> bool:
        return all(wanted <= {s.attributes.get("kvpush.transfer_id") for s in spans if s.name == name}
                   for name in ("gateway.request", "kvpush.receive", "kvpush.push"))

    receiver.wait_for(arrived, timeout_s=timeout_s)
    spans = receiver.spans()
    for pair in pairs:
        transfer = get_transfer(pair["transfer_id"])
        pair["first_token_in_record"] = transfer.HasField("first_token_id")
        # The client's first event against the transfer's end in the directory's record (one machine's clock).
        pair["first_token_before_transfer_end_ms"] = _ms(_s(transfer.end_time),
                                                         pair["sent_wall"] + pair["kvpush_ttft_ms"] / 1000)
        pair["excess_ms"] = round(pair["kvpush_ttft_ms"] - pair["p_alone_ttft_ms"], 3)
        request_spans = [s for s in spans if s.name == "gateway.request"
                         and s.attributes.get("kvpush.transfer_id") == pair["transfer_id"]]
        if len(request_spans) != 1:  # its spans did not all arrive within the bound: no hops for this round
            pair["hops_ms"] = dict.fromkeys(HOPS)
            continue
        trace = [s for s in spans if s.trace_id == request_spans[0].trace_id]
        pair["hops_ms"] = hops_of(pair["sent_wall"], pair["kvpush_ttft_ms"] / 1000, transfer, trace,
                                  pair.get("request_finished_wall"))


def main(argv=None) -> int:
    # Here, not at the top: gpu_e2e.py imports this module's measurement on a machine with the installed package.
    from kvpush.client import SyncDirectoryClient
    from kvpush.localstack.model import TinyModelSpec
    from kvpush.localstack.processes import start_gateway
    from kvpush.localstack.stack import DECODE_ENGINE_ID, PREFILL_ENGINE_ID, LocalStack
    from tests.fixtures.otlp import OTLPReceiver

    args = parse_args(argv)
    receiver = OTLPReceiver().start()
    log_dir = args.log_dir or Path("/tmp") / f"kvpush-hops-{int(time.time())}"
    stack = LocalStack(spec=TinyModelSpec(), log_dir=log_dir, progress=lambda m: print(m, file=sys.stderr),
                       engine_env={"UCX_NET_DEVICES": "lo", **receiver.env("kvpush-engine")},
                       service_env=receiver.env("kvpush-service"), with_colocated=False,
                       connector_extra=args.connector_extra, hosted_gateway=args.gateway_b_hosted)
    stack.start()
    pairs: list[dict] = []
    gateway_b = None
    try:
        if args.gateway_b_args is not None:
            gateway_b = start_gateway(log_dir, directory_address=stack.directory.address, name="gateway-b",
                                      extra_args=shlex.split(args.gateway_b_args), env=receiver.env("kvpush-service"))
        gateway_b_url = stack.hosted_gateway_url if args.gateway_b_hosted else gateway_b.url if gateway_b else ""
        client = SyncDirectoryClient(stack.directory_channel(timeout_s=5.0, max_attempts=2))
        body = {"model": "tiny", "max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True}
        for i in range(args.warmup + args.iterations):
            pair = measure_round(i, _prompt(args.prompt_tokens, seed=1000 + i), body, stack.gateway_url,
                                 stack.prefill.url, client, PREFILL_ENGINE_ID, DECODE_ENGINE_ID, args.gap_s,
                                 gateway_b_url, stack.prefill.url if args.engine_stages else "")
            if i >= args.warmup:
                pairs.append(pair)
        attach_span_hops(pairs, receiver, client.get_transfer)
        client.close()
    finally:
        if gateway_b is not None:
            gateway_b.process.stop(grace_s=5.0)
        stack.stop()
        receiver.stop()
    result = {
        "bench": "hops", "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": {"model": "tiny (localstack TinyModelSpec)", "link": "loopback", "prompt_tokens": args.prompt_tokens,
                   "max_tokens": args.max_tokens, "iterations": args.iterations, "first_token_from_prefill": True,
                   "load": "one request at a time", "machine": "2 cores shared with other work",
                   "gateway_b_args": args.gateway_b_args, "gateway_b_hosted": args.gateway_b_hosted,
                   "connector_extra": args.connector_extra,
                   "engine_stages": args.engine_stages},
        "median_ms": {**split_of(pairs), **{hop: _median(p["hops_ms"][hop] for p in pairs) for hop in HOPS}},
        "first_token_in_record": sum(p["first_token_in_record"] for p in pairs),
        # How many clients had their first token before the transfer ended, and by how much (median ms; < 0: after).
        "first_token_before_transfer_end": sum((p["first_token_before_transfer_end_ms"] or 0) > 0 for p in pairs),
        "first_token_before_transfer_end_median_ms": _median(p["first_token_before_transfer_end_ms"] for p in pairs),
        "pairs": pairs,
    }
    print(f"wrote {emit(result, args.out, 'hops')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
