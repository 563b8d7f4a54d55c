"""Real NIXL pushes between two processes: byte-exact arrival, block-size mapping, failures within bounds."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from kvpush.connector.worker.layout_wire import layout_from_proto
from kvpush.dataplane import (
    KVLayoutSpec,
    NixlConfig,
    PushWriter,
    TransferAgent,
    WriteOutcome,
    WriteRequest,
    WriteRequestError,
)
from kvpush.v1 import types_pb2
from tests.integration.dataplane.kvbuffers import block_bytes, make_kv, token_bytes
from tests.integration.dataplane.peer_process import PeerSpec, decode_peer_main

pytestmark = pytest.mark.nixl
# Generous waits: the suite shares 2 cores with vLLM engines (load averages above 30 were seen).
BOUND_S = 30.0
PEER_START_S = 240.0


class Peer:
    """The test's handle on a decode peer process."""

    def __init__(self, process, conn, metadata: bytes, layout: KVLayoutSpec, spec: PeerSpec) -> None:
        self.process, self.conn, self.metadata, self.layout, self.spec = process, conn, metadata, layout, spec

    def dump(self) -> list[np.ndarray]:
        self.conn.send(("dump", None))
        return self.conn.recv()

    def notifs(self, count: int, timeout_s: float = BOUND_S) -> list[tuple[str, bytes]]:
        self.conn.send(("notifs", (count, timeout_s)))
        return self.conn.recv()


@contextmanager
def decode_peer(spec: PeerSpec) -> Iterator[Peer]:
    """Spawn a decode peer process; stop it (or reap it if killed) afterwards."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=decode_peer_main, args=(child, spec), daemon=True)
    process.start()
    if not parent.poll(PEER_START_S):
        process.kill()
        raise AssertionError("decode peer did not start")
    metadata, layout_bytes = parent.recv()
    layout = layout_from_proto(types_pb2.KVLayout.FromString(layout_bytes))
    try:
        yield Peer(process, parent, metadata, layout, spec)
    finally:
        if process.is_alive():
            try:
                parent.send(("exit", None))
                parent.poll(10) and parent.recv()
            except (BrokenPipeError, EOFError, OSError):
                pass
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join(5)


class Outcomes:
    """Collects writer callbacks; waits with a bound."""

    def __init__(self) -> None:
        self.requests: list[WriteOutcome] = []
        self.transfers: list[WriteOutcome] = []
        self._cond = threading.Condition()

    def on_request(self, outcome: WriteOutcome) -> None:
        with self._cond:
            self.requests.append(outcome)
            self._cond.notify_all()

    def on_transfer(self, outcome: WriteOutcome) -> None:
        with self._cond:
            self.transfers.append(outcome)
            self._cond.notify_all()

    def wait(self, predicate, timeout: float = BOUND_S) -> bool:
        with self._cond:
            return self._cond.wait_for(predicate, timeout)


class GateEvent:
    """A ready_event the test opens by hand (query() is polled by the writer)."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def query(self) -> bool:
        return self._event.is_set()


@contextmanager
def prefill_agent(layers, blocks, block_size, heads, head_size, hint, config: NixlConfig | None = None, seed=1):
    """A started prefill TransferAgent over random KV, with a PushWriter collecting outcomes."""
    layout, arrays, caches = make_kv(layers, blocks, block_size, heads, head_size, hint, seed=seed)
    agent = TransferAgent(f"prefill-{os.getpid()}-{time.monotonic_ns()}", config or NixlConfig())
    agent.register(caches, block_size, heads, head_size, hint)
    agent.start()
    outcomes = Outcomes()
    writer = PushWriter(agent, outcomes.on_request, outcomes.on_transfer)
    try:
        yield agent, writer, outcomes, layout, arrays
    finally:
        agent.stop()


def _assert_tokens(src, sa, dst, da, layers, src_ids, dst_ids, start, end) -> None:
    for layer in layers:
        for t in range(start, end):
            assert token_bytes(dst, da, layer, dst_ids[t // dst.block_size_tokens], t % dst.block_size_tokens) == \
                token_bytes(src, sa, layer, src_ids[t // src.block_size_tokens], t % src.block_size_tokens), (layer, t)


def test_scattered_blocks_across_layers_arrive_byte_exact():
    """vLLM CPU layout, scattered source and destination blocks, per-layer writes: D's blocks equal P's, notif last."""
    spec = PeerSpec("decode-scatter", 4, 48, 32, 2, 32, "cpu_attn")
    with decode_peer(spec) as peer, prefill_agent(4, 40, 32, 2, 32, "cpu_attn") as (agent, writer, out, layout, arrays):
        agent.add_peer(spec.name, peer.metadata, peer.layout).result(BOUND_S)
        rng = np.random.default_rng(3)
        tokens = 300  # 10 blocks, the last one partial
        src_ids = [int(x) for x in rng.permutation(40)[:10]]
        dst_ids = [int(x) for x in rng.permutation(48)[:10]]
        for layer in range(4):
            writer.submit(WriteRequest("t-scatter", spec.name, range(layer, layer + 1), src_ids, dst_ids, 0, tokens,
                                       notify=b"t-scatter:done" if layer == 3 else None))
        assert out.wait(lambda: out.transfers), "transfer did not finish"
        final = out.transfers[0]
        assert final.ok and final.write_count == 4 and final.notified
        assert final.bytes == 4 * 10 * layout.block_bytes_per_layer
        assert all(o.ok for o in out.requests) and len(out.requests) == 4
        assert peer.notifs(1) == [(agent.agent_name, b"t-scatter:done")]
        dumped = peer.dump()
        for layer in range(4):
            for s, d in zip(src_ids, dst_ids, strict=True):
                assert block_bytes(peer.layout, dumped, layer, d) == block_bytes(layout, arrays, layer, s)
        untouched = set(range(48)) - set(dst_ids)
        assert all(not dumped[0][b].any() for b in untouched)


@pytest.mark.parametrize("hint,src_bs,dst_bs", [("kv_first", 16, 128), ("fused_kv", 16, 128), ("kv_first", 64, 16)])
def test_mismatched_block_sizes_arrive_byte_exact(hint, src_bs, dst_bs):
    """Prefill and decode with different block sizes: every token of the range lands at its place, nothing else."""
    tokens, layers = 437, 3
    spec = PeerSpec(f"decode-mismatch-{hint}-{src_bs}-{dst_bs}", layers, -(-tokens // dst_bs) + 4, dst_bs, 4, 32, hint)
    src_blocks = -(-tokens // src_bs) + 4
    with decode_peer(spec) as peer, prefill_agent(layers, src_blocks, src_bs, 4, 32, hint) as (agent, writer, out,
                                                                                                   layout, arrays):
        agent.add_peer(spec.name, peer.metadata, peer.layout).result(BOUND_S)
        rng = np.random.default_rng(4)
        src_ids = [int(x) for x in rng.permutation(src_blocks)[: -(-tokens // src_bs)]]
        dst_ids = [int(x) for x in rng.permutation(spec.blocks)[: -(-tokens // dst_bs)]]
        # Two chunks (as chunked prefill would send them), the second ending mid-block, notify on the last.
        writer.submit(WriteRequest("t-mm", spec.name, range(layers), src_ids, dst_ids, 0, 200))
        writer.submit(WriteRequest("t-mm", spec.name, range(layers), src_ids, dst_ids, 200, tokens, notify=b"mm"))
        assert out.wait(lambda: out.transfers)
        assert out.transfers[0].ok, out.transfers[0].error
        assert out.transfers[0].bytes == layers * tokens * layout.bytes_per_token_per_layer
        assert peer.notifs(1) == [(agent.agent_name, b"mm")]
        dumped = peer.dump()
        _assert_tokens(layout, arrays, peer.layout, dumped, range(layers), src_ids, dst_ids, 0, tokens)
        last = dst_ids[-1]
        after = token_bytes(peer.layout, dumped, 0, last, tokens % dst_bs) if tokens % dst_bs else b""
        assert after == bytes(len(after)), "a token past the range was written"


def test_out_of_range_writes_are_refused_before_posting():
    """Bad layers, block ids or list lengths raise at submit; nothing reaches the peer and no outcome fires."""
    spec = PeerSpec("decode-refuse", 2, 8, 32, 2, 32, "cpu_attn")
    with decode_peer(spec) as peer, prefill_agent(2, 8, 32, 2, 32, "cpu_attn") as (agent, writer, out, _, _):
        agent.add_peer(spec.name, peer.metadata, peer.layout).result(BOUND_S)
        bad = [
            dict(layers=range(2, 3), src_block_ids=[0], dst_block_ids=[0]),
            dict(layers=range(1), src_block_ids=[8], dst_block_ids=[0]),
            dict(layers=range(1), src_block_ids=[0], dst_block_ids=[9]),
            dict(layers=range(1), src_block_ids=[0], dst_block_ids=[]),
        ]
        for fields in bad:
            with pytest.raises(WriteRequestError):
                writer.submit(WriteRequest("t-bad", spec.name, token_start=0, token_end=32, **fields))
        with pytest.raises(WriteRequestError, match="unknown peer"):
            writer.submit(WriteRequest("t-bad", "nobody", range(1), [0], [0], 0, 32))
        time.sleep(0.2)
        assert out.requests == [] and out.transfers == []
        assert not any(a.any() for a in peer.dump())


def test_killed_peer_fails_within_bound():
    """The decode process is SIGKILLed mid-transfer: the following writes fail and the transfer ends failed,
    in bound."""
    config = NixlConfig(transfer_timeout_s=3.0, post_timeout_s=3.0)
    spec = PeerSpec("decode-killed", 4, 64, 128, 8, 64, "cpu_attn")  # 16 MiB per layer
    with decode_peer(spec) as peer, prefill_agent(4, 64, 128, 8, 64, "cpu_attn", config) as (agent, writer, out, _, _):
        agent.add_peer(spec.name, peer.metadata, peer.layout).result(BOUND_S)
        ids = list(range(64))
        gates = [GateEvent() for _ in range(4)]
        gates[0].set()
        for layer in range(4):
            writer.submit(WriteRequest("t-kill", spec.name, range(layer, layer + 1), ids, ids, 0, 64 * 128,
                                       notify=b"never" if layer == 3 else None, ready_event=gates[layer]))
        assert out.wait(lambda: len(out.requests) == 1) and out.requests[0].ok
        os.kill(peer.process.pid, signal.SIGKILL)
        peer.process.join(5)
        killed_at = time.monotonic()
        for gate in gates[1:]:
            gate.set()
        assert out.wait(lambda: out.transfers, timeout=BOUND_S), "no transfer outcome after the peer died"
        elapsed = time.monotonic() - killed_at
        final = out.transfers[0]
        assert not final.ok and final.error and not final.notified
        assert elapsed < config.transfer_timeout_s + 5.0
        assert len(out.requests) == 4 and not all(o.ok for o in out.requests[1:])


def test_remove_peer_mid_push_fails_queued_writes():
    """remove_peer while writes wait to post: they fail with the reason, the transfer ends failed, the peer is
    dropped."""
    spec = PeerSpec("decode-removed", 2, 16, 32, 2, 32, "cpu_attn")
    with decode_peer(spec) as peer, prefill_agent(2, 16, 32, 2, 32, "cpu_attn") as (agent, writer, out, _, _):
        agent.add_peer(spec.name, peer.metadata, peer.layout).result(BOUND_S)
        gate = GateEvent()
        writer.submit(WriteRequest("t-rm", spec.name, range(1), [1, 2], [3, 4], 0, 64))
        writer.submit(WriteRequest("t-rm", spec.name, range(1, 2), [1, 2], [3, 4], 0, 64, notify=b"x",
                                   ready_event=gate))
        assert out.wait(lambda: len(out.requests) == 1) and out.requests[0].ok
        agent.remove_peer(spec.name, reason="decode engine left").result(BOUND_S)
        gate.set()
        assert out.wait(lambda: out.transfers)
        assert out.transfers[0].error == "decode engine left"
        assert out.requests[1].ok is False and "decode engine left" in out.requests[1].error
        with pytest.raises(WriteRequestError, match="unknown peer"):
            writer.submit(WriteRequest("t-rm2", spec.name, range(1), [1], [3], 0, 32))
        # The same decode worker can be loaded again once it is gone, and writes flow again.
        agent.add_peer(spec.name, peer.metadata, peer.layout).result(BOUND_S)
        writer.submit(WriteRequest("t-rm3", spec.name, range(1), [1], [3], 0, 32, notify=b"again"))
        assert out.wait(lambda: len(out.transfers) == 2) and out.transfers[1].ok
        assert peer.notifs(1) == [(agent.agent_name, b"again")]


def test_cancel_drops_queued_writes_and_refuses_later_ones():
    """cancel() drops waiting writes, resolves once nothing is in flight, and later writes of it fail."""
    spec = PeerSpec("decode-cancel", 2, 16, 32, 2, 32, "cpu_attn")
    with decode_peer(spec) as peer, prefill_agent(2, 16, 32, 2, 32, "cpu_attn") as (agent, writer, out, _, _):
        agent.add_peer(spec.name, peer.metadata, peer.layout).result(BOUND_S)
        writer.submit(WriteRequest("t-c", spec.name, range(1), [1], [3], 0, 32, ready_event=GateEvent()))
        result = writer.cancel("t-c").result(BOUND_S)
        assert not result.ok and result.error == "cancelled" and result.write_count == 1
        assert out.transfers == [result]
        never = writer.cancel("t-never").result(BOUND_S)
        assert never.write_count == 0 and never.error == "cancelled"
        writer.submit(WriteRequest("t-c", spec.name, range(1), [1], [3], 0, 32))
        assert out.wait(lambda: len(out.requests) == 2)
        assert [o.ok for o in out.requests] == [False, False]
        assert "cancelled" in out.requests[1].error
        assert not any(a.any() for a in peer.dump())


def test_ready_event_timeout_fails_the_write():
    """A ready_event that never completes fails its write after post_timeout_s instead of hanging."""
    spec = PeerSpec("decode-event", 1, 8, 32, 2, 32, "cpu_attn")
    config = NixlConfig(post_timeout_s=0.3)
    with decode_peer(spec) as peer, prefill_agent(1, 8, 32, 2, 32, "cpu_attn", config) as (agent, writer, out, _, _):
        agent.add_peer(spec.name, peer.metadata, peer.layout).result(BOUND_S)
        writer.submit(WriteRequest("t-ev", spec.name, range(1), [1], [3], 0, 32, notify=b"n", ready_event=GateEvent()))
        assert out.wait(lambda: out.transfers, timeout=5.0)
        assert "ready_event not complete" in out.transfers[0].error


class _CompletesBetweenQueries(GateEvent):
    """Once set, answers False one more time: the event completes between the watcher's look and the write's."""

    def __init__(self) -> None:
        super().__init__()
        self._answers: list[bool] = []

    def set(self) -> None:
        self._answers = [False]
        super().set()

    def query(self) -> bool:
        return self._answers.pop() if self._answers else super().query()


def test_event_completion_is_stamped_before_writes_waiting_on_it_report():
    """when_complete (a GPU worker's prefill end): stamped once the event completes, before its writes report.

    The event completes between the watcher's look and the write's; where a write finishes within the loop
    iteration that posts it (GPU, many descriptors: the H200 run lost one chunked request's prefill end that
    way) the stamp must still come first. Here UCX reports the write a loop later, so the order is checked,
    not that race."""
    spec = PeerSpec("decode-stamp", 1, 8, 32, 2, 32, "cpu_attn")
    config = NixlConfig(post_timeout_s=0.5)
    with decode_peer(spec) as peer, prefill_agent(1, 8, 32, 2, 32, "cpu_attn", config) as (agent, writer, out, _, _):
        agent.add_peer(spec.name, peer.metadata, peer.layout).result(BOUND_S)
        gate, never = _CompletesBetweenQueries(), GateEvent()
        stamps: list[tuple[float, int]] = []
        writer.when_complete(gate, lambda t: stamps.append((t, len(out.requests))))
        writer.when_complete(never, lambda t: stamps.append((t, -1)))
        writer.submit(WriteRequest("t-stamp", spec.name, range(1), [1], [3], 0, 32, notify=b"s", ready_event=gate))
        time.sleep(0.2)
        assert stamps == [] and out.requests == []
        opened = time.time()
        agent.call_soon(gate.set).result(BOUND_S)  # between two loop iterations: the next one sees the race
        assert out.wait(lambda: out.transfers) and out.transfers[0].ok
        assert len(stamps) == 1
        stamped_at, reported_before = stamps[0]
        assert opened <= stamped_at <= time.time() and reported_before == 0
        time.sleep(1.0)  # past post_timeout_s the event that never completes is dropped, never called back
        assert agent.call_soon(lambda: len(writer._watched)).result(BOUND_S) == 0 and len(stamps) == 1


def test_telemetry_reports_bytes_and_descriptors():
    """With capture_telemetry, NIXL's byte and descriptor counts come back in the outcome."""
    spec = PeerSpec("decode-telemetry", 2, 16, 32, 2, 32, "cpu_attn")
    config = NixlConfig(capture_telemetry=True)
    with decode_peer(spec) as peer, prefill_agent(2, 16, 32, 2, 32, "cpu_attn", config) as (agent, writer, out,
                                                                                               layout, _):
        agent.add_peer(spec.name, peer.metadata, peer.layout).result(BOUND_S)
        plan = writer.submit(WriteRequest("t-tel", spec.name, range(2), [0, 1, 2, 9], [5, 6, 7, 1], 0, 128,
                                          notify=b"t"))
        assert out.wait(lambda: out.transfers)
        request = out.requests[0]
        assert request.ok and request.telemetry is not None
        assert request.telemetry["bytes"] == plan.total_bytes == 2 * 4 * layout.block_bytes_per_layer
        assert request.descriptor_count == request.telemetry["descriptors"] == plan.descriptor_count == 4


def test_vllm_cpu_kernel_kv_moves_whole_blocks():
    """KV written by vLLM CPU's own cache kernel into torch tensors arrives block-exact at a decode process."""
    torch = pytest.importorskip("torch")
    ops = pytest.importorskip("vllm._custom_ops")
    blocks, heads, block_size, head = 16, 2, 32, 32
    caches = {f"layers.{i}": torch.zeros(blocks, heads, block_size, 2 * head, dtype=torch.bfloat16) for i in range(2)}
    slots = torch.tensor([3 * block_size + t for t in range(block_size)] + [7 * block_size + t for t in range(5)])
    for kv in caches.values():
        key_cache, value_cache = kv.view(blocks, heads, 2 * block_size, head).chunk(2, dim=2)
        key = torch.randn(len(slots), heads, head, dtype=torch.bfloat16)
        value = torch.randn(len(slots), heads, head, dtype=torch.bfloat16)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, "vec")
        assert kv[3].abs().sum() > 0
    spec = PeerSpec("decode-vllm-cpu", 2, 16, block_size, heads, head, "cpu_attn")
    with decode_peer(spec) as peer:
        agent = TransferAgent("prefill-vllm-cpu")
        layout = agent.register(caches, block_size, heads, head)
        assert layout.block_atomic and layout.layout_name == "cpu_attn"
        agent.start()
        out = Outcomes()
        writer = PushWriter(agent, out.on_request, out.on_transfer)
        try:
            agent.add_peer(spec.name, peer.metadata, peer.layout).result(BOUND_S)
            writer.submit(WriteRequest("t-vllm", spec.name, range(2), [3, 7], [10, 1], 0, block_size + 5, notify=b"v"))
            assert out.wait(lambda: out.transfers) and out.transfers[0].ok
            dumped = peer.dump()
            for i, kv in enumerate(caches.values()):
                raw = kv.view(torch.uint16).numpy()
                assert np.array_equal(dumped[i][10], raw[3]) and np.array_equal(dumped[i][1], raw[7])
                assert not dumped[i][0].any()
        finally:
            agent.stop()


def test_writes_ready_together_share_one_handle():
    """Per-layer writes that are all ready when the first one is go out on one handle, byte-exact, notif last."""
    spec = PeerSpec("decode-group", 4, 16, 32, 2, 32, "kv_first")
    with decode_peer(spec) as peer, prefill_agent(4, 16, 32, 2, 32, "kv_first") as (agent, writer, out, layout, arrays):
        agent.add_peer(spec.name, peer.metadata, peer.layout).result(BOUND_S)
        gate = GateEvent()
        src_ids, dst_ids = [4, 9, 1], [7, 2, 12]
        for layer in range(4):
            writer.submit(WriteRequest("t-group", spec.name, range(layer, layer + 1), src_ids, dst_ids, 0, 80,
                                       notify=b"g" if layer == 3 else None, ready_event=gate if layer == 0 else None))
        time.sleep(0.2)
        assert out.requests == []
        gate.set()
        assert out.wait(lambda: out.transfers)
        assert out.transfers[0].ok and out.transfers[0].notified and out.transfers[0].write_count == 4
        assert [o.handle_write_count for o in out.requests] == [4, 4, 4, 4]
        assert peer.notifs(1) == [(agent.agent_name, b"g")]
        _assert_tokens(layout, arrays, peer.layout, peer.dump(), range(4), src_ids, dst_ids, 0, 80)


def test_group_writes_can_be_turned_off():
    """With max_group_writes=1 every write gets its own handle."""
    spec = PeerSpec("decode-nogroup", 2, 16, 32, 2, 32, "kv_first")
    config = NixlConfig(max_group_writes=1)
    with decode_peer(spec) as peer, prefill_agent(2, 16, 32, 2, 32, "kv_first", config) as (agent, writer, out, _, _):
        agent.add_peer(spec.name, peer.metadata, peer.layout).result(BOUND_S)
        gate = GateEvent()
        writer.submit(WriteRequest("t-ng", spec.name, range(1), [1], [2], 0, 32, ready_event=gate))
        writer.submit(WriteRequest("t-ng", spec.name, range(1, 2), [1], [2], 0, 32, notify=b"n"))
        gate.set()
        assert out.wait(lambda: out.transfers) and out.transfers[0].ok
        assert [o.handle_write_count for o in out.requests] == [1, 1]


def test_paced_progress_thread_agent_pushes_byte_exact():
    """With NIXL's progress thread on (sleeping 100 us, not spinning) on both sides, writes still arrive exactly."""
    config = {"enable_prog_thread": True, "progress_thread_delay_us": 100}
    spec = PeerSpec("decode-progthread", 2, 16, 32, 2, 32, "kv_first", config)
    with decode_peer(spec) as peer, prefill_agent(2, 16, 32, 2, 32, "kv_first", NixlConfig(**config)) as (
            agent, writer, out, layout, arrays):
        agent.add_peer(spec.name, peer.metadata, peer.layout).result(BOUND_S)
        src_ids, dst_ids = [3, 8, 0], [11, 5, 9]
        writer.submit(WriteRequest("t-pt", spec.name, range(2), src_ids, dst_ids, 0, 90, notify=b"pt"))
        assert out.wait(lambda: out.transfers) and out.transfers[0].ok
        assert peer.notifs(1) == [(agent.agent_name, b"pt")]
        _assert_tokens(layout, arrays, peer.layout, peer.dump(), range(2), src_ids, dst_ids, 0, 90)


def test_group_stops_at_a_write_that_is_not_ready():
    """Ready writes behind the first share its handle; a write whose event is pending waits for its own."""
    spec = PeerSpec("decode-group-stop", 4, 16, 32, 2, 32, "kv_first")
    with decode_peer(spec) as peer, prefill_agent(4, 16, 32, 2, 32, "kv_first") as (agent, writer, out, layout, arrays):
        agent.add_peer(spec.name, peer.metadata, peer.layout).result(BOUND_S)
        first, later = GateEvent(), GateEvent()
        events = [first, None, later, None]
        for layer in range(4):
            writer.submit(WriteRequest("t-gs", spec.name, range(layer, layer + 1), [2], [5], 0, 32,
                                       notify=b"gs" if layer == 3 else None, ready_event=events[layer]))
        time.sleep(0.1)
        first.set()
        assert out.wait(lambda: len(out.requests) == 2)
        assert [o.handle_write_count for o in out.requests] == [2, 2]
        later.set()
        assert out.wait(lambda: out.transfers) and out.transfers[0].ok
        assert [o.handle_write_count for o in out.requests] == [2, 2, 2, 2]
        _assert_tokens(layout, arrays, peer.layout, peer.dump(), range(4), [2], [5], 0, 32)


def test_decode_without_listener_receives_pushes():
    """A decode agent that only registered and started (no listener, no other action) receives writes byte-exact."""
    spec = PeerSpec("decode-passive", 2, 16, 32, 2, 32, "kv_first", listener=False)
    with decode_peer(spec) as peer, prefill_agent(2, 16, 32, 2, 32, "kv_first") as (agent, writer, out, layout, arrays):
        agent.add_peer(spec.name, peer.metadata, peer.layout).result(BOUND_S)
        writer.submit(WriteRequest("t-passive", spec.name, range(2), [6, 1], [0, 13], 0, 64, ends_transfer=True))
        assert out.wait(lambda: out.transfers) and out.transfers[0].ok and not out.transfers[0].notified
        _assert_tokens(layout, arrays, peer.layout, peer.dump(), range(2), [6, 1], [0, 13], 0, 64)


def test_writes_become_spans_under_the_request_trace():
    """Each write is a kvpush.dataplane.write span, child of the request's traceparent, failures marked as errors."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    parent = f"00-{trace_id}-00f067aa0ba902b7-01"
    spec = PeerSpec("decode-spans", 2, 16, 32, 2, 32, "kv_first")
    with decode_peer(spec) as peer, prefill_agent(2, 16, 32, 2, 32, "kv_first") as (agent, _, out, layout, _):
        writer = PushWriter(agent, out.on_request, out.on_transfer, tracer=provider.get_tracer("test"))
        agent.add_peer(spec.name, peer.metadata, peer.layout).result(BOUND_S)
        writer.submit(WriteRequest("t-span", spec.name, range(2), [1, 2], [3, 4], 0, 64, notify=b"s",
                                   traceparent=parent))
        assert out.wait(lambda: out.transfers)
        writer.submit(WriteRequest("t-span", spec.name, range(1), [1], [3], 0, 32, traceparent=parent))
        assert out.wait(lambda: len(out.requests) == 2)
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["kvpush.dataplane.write"] * 2
    ok_span, failed_span = spans
    assert format(ok_span.context.trace_id, "032x") == trace_id
    assert format(ok_span.parent.span_id, "016x") == "00f067aa0ba902b7"
    assert ok_span.attributes["kvpush.transfer_id"] == "t-span"
    assert ok_span.attributes["kvpush.bytes"] == 2 * 2 * layout.block_bytes_per_layer
    assert ok_span.attributes["kvpush.layer_count"] == 2
    assert failed_span.status.status_code == StatusCode.ERROR
    assert "already ended" in failed_span.status.description


def test_ready_event_without_query_is_synchronized_before_posting():
    """An event that only has synchronize() is waited on (on the I/O thread) before its write is posted."""
    calls: list[str] = []

    class SyncOnlyEvent:
        def synchronize(self) -> None:
            calls.append("synchronize")

    spec = PeerSpec("decode-sync", 1, 8, 32, 2, 32, "kv_first")
    with decode_peer(spec) as peer, prefill_agent(1, 8, 32, 2, 32, "kv_first") as (agent, writer, out, layout, arrays):
        agent.add_peer(spec.name, peer.metadata, peer.layout).result(BOUND_S)
        writer.submit(WriteRequest("t-sync", spec.name, range(1), [2], [6], 0, 32, notify=b"y",
                                   ready_event=SyncOnlyEvent()))
        assert out.wait(lambda: out.transfers) and out.transfers[0].ok
        assert calls == ["synchronize"]
        _assert_tokens(layout, arrays, peer.layout, peer.dump(), range(1), [2], [6], 0, 32)
