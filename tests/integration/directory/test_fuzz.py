"""A stateful fuzzer over the REAL directory: random and malformed call sequences on a grpc.aio server.

After every step: health answers, no call got UNKNOWN or INTERNAL, a terminal transfer's state never
changes, no decode block is owned by two live transfers (on the wire and in the state's own invariant
check), and no transfer produced more than one watch event; at the end of a run every ended
transfer produced exactly one.

CI runs a short campaign (tens of seconds). A longer one:
    KVPUSH_FUZZ_EXAMPLES=500 KVPUSH_FUZZ_STEPS=60 .venv/bin/python -m pytest tests/integration/directory/test_fuzz.py
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
from collections import Counter

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpush.directory.server import DirectoryConfig, create_server
from kvpush.directory.state import Limits
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import directory_pb2_grpc as dgrpc
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import DECODE, PREFILL, make_layout

EXAMPLES = int(os.environ.get("KVPUSH_FUZZ_EXAMPLES", "80"))
STEPS = int(os.environ.get("KVPUSH_FUZZ_STEPS", "40"))
FORBIDDEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
TERMINAL = {tpb.TRANSFER_STATE_COMPLETE, tpb.TRANSFER_STATE_FAILED, tpb.TRANSFER_STATE_CANCELLED,
            tpb.TRANSFER_STATE_EXPIRED}
ENGINES = {"p1": PREFILL, "p2": PREFILL, "d1": DECODE, "d2": DECODE}
METHODS = ["RegisterEngine", "DeregisterEngine", "PlanTransfer", "ReportAllocation", "CancelTransfer", "GetTransfer",
           "ListTransfers", "GetEngine", "ListEngines", "ReportEngineUnreachable"]
BLOCK_SIZE = 16
BLOCK_COUNT = 64

ids = st.one_of(st.sampled_from(["", "t", "ghost", "p1", "d1", "a\x00b", "a\nb", "x" * 200]),
                st.text(max_size=40))
int32 = st.integers(-(2**31), 2**31 - 1)
small = st.integers(-3, 80)


class Loop:
    """An event loop on a thread, running the server and the streams."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout_s: float = 20.0):
        """Run a coroutine there and wait (bounded)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        """Stop the loop and its thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


class DirectoryMachine(RuleBasedStateMachine):
    """Random and malformed calls against one fresh directory per example."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = Loop()
        self.codes: Counter[str] = Counter()
        self.bad: list[str] = []
        self.leases: dict[tuple[str, int], str] = {}
        self.transfers: list[str] = []
        self.terminal: dict[str, int] = {}
        self.events: Counter[str] = Counter()
        self.sessions: dict[str, tuple[grpc.aio.StreamStreamCall, asyncio.Task]] = {}
        self.watches: list[asyncio.Task] = []
        self.watching: set[str] = set()
        self.loop.run(self._start())

    async def _start(self) -> None:
        self.server, port = create_server(DirectoryConfig(
            host="127.0.0.1", port=0, limits=Limits(max_pending_rejections_per_session=64), reap_interval_s=0.05))
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.stub = dgrpc.KVDirectoryServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        for engine_id in ("d1", "d2"):
            self.watches.append(asyncio.create_task(self._watch(engine_id)))

    async def _watch(self, engine_id: str) -> None:
        last = 0
        while True:  # NOT_FOUND until the engine is registered; a first connection replays what was retained
            call = self.stub.WatchTransfers(dpb.WatchTransfersRequest(
                engine_id=engine_id, after_sequence_number=last, replay_retained=last == 0))
            try:
                async for response in call:
                    self.watching.add(engine_id)
                    for event in response.events:
                        if event.sequence_number > last:
                            last = event.sequence_number
                            self.events[event.transfer_id] += 1
            except grpc.aio.AioRpcError as error:
                if error.code() in FORBIDDEN:
                    self.bad.append(f"WatchTransfers -> {error.code().name}")
            await asyncio.sleep(0.02)

    # ---------------------------------------------------------------- calling

    def call(self, method: str, request):
        """One unary call; returns the response or None; records the status code."""
        async def go():
            try:
                return await getattr(self.stub, method)(request, timeout=10), grpc.StatusCode.OK
            except grpc.aio.AioRpcError as error:
                return None, error.code()
        response, code = self.loop.run(go())
        self._record(method, code)
        return response

    def _record(self, method: str, code: grpc.StatusCode) -> None:
        self.codes[f"{method}:{code.name}"] += 1
        if code in FORBIDDEN:
            self.bad.append(f"{method} -> {code.name}")

    def _register_request(self, engine_id, rank, tp_size, agent, layout_ok, block_count):
        layout = make_layout(block_count=block_count if not layout_ok else BLOCK_COUNT, block_size_tokens=BLOCK_SIZE)
        return dpb.RegisterEngineRequest(
            engine_id=engine_id, role=ENGINES.get(engine_id, PREFILL), tp_rank=rank, tp_size=tp_size,
            agent_name=agent, agent_metadata=b"md" if ENGINES.get(engine_id) == DECODE else b"", layout=layout)

    # ---------------------------------------------------------------- rules

    @initialize()
    def register_all(self):
        """Every run starts with p1, p2, d1, d2 registered (later rules may remove or clash with them)."""
        for engine_id in sorted(ENGINES):
            response = self.call("RegisterEngine", self._register_request(engine_id, 0, 1, f"{engine_id}-agent",
                                                                          True, BLOCK_COUNT))
            self.leases[(engine_id, 0)] = response.lease_id

        async def connected():  # watches follow d1 and d2 before anything can end (the stream then stays open)
            while self.watching != {"d1", "d2"}:
                await asyncio.sleep(0.01)
        self.loop.run(connected(), timeout_s=10)

    @rule(engine_id=st.sampled_from(sorted(ENGINES)), agent=st.sampled_from(["", "a1", "a2", "a3"]),
          layout_ok=st.booleans(), block_count=int32)
    def register(self, engine_id, agent, layout_ok, block_count):
        """Register (valid or not, maybe another engine's agent name)."""
        request = self._register_request(engine_id, 0, 1, agent or f"{engine_id}-agent", layout_ok, block_count)
        response = self.call("RegisterEngine", request)
        if response is not None:
            self.leases[(engine_id, 0)] = response.lease_id

    @rule(engine_id=ids, rank=int32, tp_size=int32, agent=ids, block_count=int32)
    def register_garbage(self, engine_id, rank, tp_size, agent, block_count):
        """Register with random ids and counts."""
        self.call("RegisterEngine", self._register_request(engine_id, rank, tp_size, agent, False, block_count))

    @rule(engine_id=st.sampled_from(sorted(ENGINES)), right_lease=st.booleans())
    def deregister(self, engine_id, right_lease):
        """Deregister with the engine's lease or a wrong one."""
        lease = self.leases.get((engine_id, 0), "none") if right_lease else "wrong"
        if self.call("DeregisterEngine", dpb.DeregisterEngineRequest(engine_id=engine_id, lease_id=lease)):
            self.leases.pop((engine_id, 0), None)
            self.sessions.pop(engine_id, None)

    @rule(engine_id=st.sampled_from(sorted(ENGINES)), free=int32, running=int32)
    def renew(self, engine_id, free, running):
        """One renewal with a random load."""
        lease = self.leases.get((engine_id, 0), "none")

        async def go():
            call = self.stub.RenewLease()
            try:
                await call.write(dpb.RenewLeaseRequest(
                    lease_id=lease, load=tpb.EngineLoad(free_block_count=free, running_request_count=running)))
                await asyncio.wait_for(call.read(), 10)
                return grpc.StatusCode.OK
            except grpc.aio.AioRpcError as error:
                return error.code()
            finally:
                call.cancel()
        self._record("RenewLease", self.loop.run(go()))

    @rule(prompt=small, prefill=st.sampled_from(["", "p1", "p2", "d1", "ghost"]),
          decode=st.sampled_from(["", "d1", "d2", "p1"]), ttl_s=st.one_of(st.none(), st.floats(-1, 30)))
    def plan(self, prompt, prefill, decode, ttl_s):
        """Plan a transfer (pins and ttl random)."""
        request = dpb.PlanTransferRequest(prompt_token_count=prompt, prefill_engine_id=prefill,
                                          decode_engine_id=decode)
        if ttl_s is not None:
            request.ttl.FromNanoseconds(int(ttl_s * 1e9))
        response = self.call("PlanTransfer", request)
        if response is not None:
            self.transfers.append(response.transfer.transfer_id)

    def _transfer(self, data) -> str:
        if self.transfers and data.draw(st.booleans()):
            return data.draw(st.sampled_from(self.transfers))
        return data.draw(ids)

    @rule(data=st.data(), engine_id=st.sampled_from(["d1", "d2", "p1", "ghost"]),
          blocks=st.lists(st.integers(-2, BLOCK_COUNT + 2), max_size=8), prompt=small, prefix=small)
    def report_allocation(self, data, engine_id, blocks, prompt, prefix):
        """Report blocks (duplicates, out of range, too few: all possible)."""
        self.call("ReportAllocation", dpb.ReportAllocationRequest(
            transfer_id=self._transfer(data), engine_id=engine_id, block_ids=blocks, prompt_token_count=prompt,
            prefix_hit_token_count=prefix))

    @rule(data=st.data(), first_block=st.integers(0, BLOCK_COUNT - 4), prompt=st.integers(1, 48),
          status=st.sampled_from([dpb.WRITE_RESULT_STATUS_DONE, dpb.WRITE_RESULT_STATUS_DONE,
                                  dpb.WRITE_RESULT_STATUS_FAILED, dpb.WRITE_RESULT_STATUS_CANCELLED,
                                  dpb.WRITE_RESULT_STATUS_PROGRESS]))
    def drive(self, data, first_block, prompt, status):
        """A well-formed plan (or a known transfer), allocation, readiness and result, so transfers do end."""
        if self.transfers and data.draw(st.booleans()):
            transfer_id = data.draw(st.sampled_from(self.transfers))
        else:
            planned = self.call("PlanTransfer", dpb.PlanTransferRequest(prompt_token_count=prompt))
            if planned is None:
                return
            transfer_id = planned.transfer.transfer_id
            self.transfers.append(transfer_id)
        got = self.call("GetTransfer", dpb.GetTransferRequest(transfer_id=transfer_id))
        if got is None:
            return
        transfer = got.transfer
        blocks = list(range(first_block, first_block + math.ceil(prompt / BLOCK_SIZE)))
        self.call("ReportAllocation", dpb.ReportAllocationRequest(
            transfer_id=transfer_id, engine_id=transfer.decode_engine_id, block_ids=blocks, prompt_token_count=prompt))
        call = self._session(transfer.prefill_engine_id)
        if call is None:
            return
        self._write(call, dpb.StreamPrefillRequest(ready=dpb.LayerReadyBatch(events=[dpb.LayerReady(
            transfer_id=transfer_id, layer_start=0, layer_end=4, token_start=0, token_end=prompt,
            prompt_token_count=prompt)])))
        self._write(call, dpb.StreamPrefillRequest(result=dpb.WriteResult(
            transfer_id=transfer_id, status=status, layers_written_count=4, bytes_written=prompt * 1024)))

    @rule(data=st.data(), reason=st.text(max_size=20))
    def cancel(self, data, reason):
        """Cancel a known or unknown transfer."""
        self.call("CancelTransfer", dpb.CancelTransferRequest(transfer_id=self._transfer(data), reason=reason))

    @rule(data=st.data(), engine_id=st.one_of(st.sampled_from(sorted(ENGINES)), ids), reason=st.text(max_size=20))
    def report_unreachable(self, data, engine_id, reason):
        """Report a known or unknown engine unreachable, for a known, unknown or no transfer."""
        transfer_id = "" if data.draw(st.booleans()) else self._transfer(data)
        self.call("ReportEngineUnreachable", dpb.ReportEngineUnreachableRequest(
            engine_id=engine_id, transfer_id=transfer_id, reason=reason))

    def _session(self, engine_id: str):
        if engine_id in self.sessions and not self.sessions[engine_id][1].done():
            return self.sessions[engine_id][0]
        lease = self.leases.get((engine_id, 0))
        if lease is None:
            return None

        async def open_():
            call = self.stub.StreamPrefill()
            await call.write(dpb.StreamPrefillRequest(hello=dpb.Hello(engine_id=engine_id, lease_id=lease)))

            async def drain():
                try:
                    async for message in call:
                        if message.WhichOneof("message") == "rejection" and message.rejection.status.code in (2, 13):
                            status = message.rejection.status
                            self.bad.append(f"rejection {status.code}: {status.message}")
                except grpc.aio.AioRpcError as error:
                    self._record("StreamPrefill", error.code())
            return call, asyncio.create_task(drain())
        self.sessions[engine_id] = self.loop.run(open_())
        return self.sessions[engine_id][0]

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), engine_id=st.sampled_from(["p1", "p2"]), first=small, last=small, start=small,
          end=small, prompt=small, count=st.integers(1, 3))
    def ready(self, data, engine_id, first, last, start, end, prompt, count):
        """A readiness batch (layers and tokens random) on the engine's session."""
        call = self._session(engine_id)
        if call is None:
            return
        transfer_id = self._transfer(data)
        batch = dpb.LayerReadyBatch(events=[dpb.LayerReady(
            transfer_id=transfer_id, layer_start=first, layer_end=last, token_start=start, token_end=end,
            prompt_token_count=prompt) for _ in range(count)])
        self._write(call, dpb.StreamPrefillRequest(ready=batch))

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), engine_id=st.sampled_from(["p1", "p2"]), status=st.integers(-1, 5),
          layers=int32, written=st.integers(-1, 2**63 - 1), post_s=st.integers(-5, 5))
    def write_result(self, data, engine_id, status, layers, written, post_s):
        """A write result (status, counts, durations random)."""
        call = self._session(engine_id)
        if call is None:
            return
        result = dpb.WriteResult(transfer_id=self._transfer(data), status=status, layers_written_count=layers,
                                 bytes_written=written)
        result.timing.post_duration.seconds = post_s
        self._write(call, dpb.StreamPrefillRequest(result=result))

    def _write(self, call, message) -> None:
        async def go():
            try:
                await asyncio.wait_for(call.write(message), 5)
            except (TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError):
                pass  # the session ended (its status is recorded by the drain task)
        self.loop.run(go())

    @rule(method=st.sampled_from(METHODS), body=st.binary(max_size=64))
    def garbage(self, method, body):
        """Random bytes as the body of a random method."""
        async def go():
            call = self.channel.unary_unary(f"/kvpush.v1.KVDirectoryService/{method}", request_serializer=None,
                                            response_deserializer=None)
            try:
                await call(body, timeout=10)
                return grpc.StatusCode.OK
            except grpc.aio.AioRpcError as error:
                return error.code()
        self._record(method, self.loop.run(go()))

    @rule(token=st.text(max_size=30), size=st.integers(-2, 1002), state=st.integers(-1, 9))
    def list_pages(self, token, size, state):
        """Listings with random page tokens, sizes and filters."""
        self.call("ListTransfers", dpb.ListTransfersRequest(page_token=token, page_size=size, state=state))
        self.call("ListEngines", dpb.ListEnginesRequest(page_token=token, page_size=size))

    # ---------------------------------------------------------------- invariants

    @invariant()
    def sound(self):
        """Health answers; nothing was UNKNOWN/INTERNAL; terminal states hold; blocks have one owner."""
        async def health():
            return (await self.health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status
        assert self.loop.run(health()) == health_pb2.HealthCheckResponse.SERVING
        assert not self.bad, self.bad
        listing = self.call("ListTransfers", dpb.ListTransfersRequest(page_size=1000))
        owners: dict[tuple[str, int], str] = {}
        for transfer in listing.transfers:
            if transfer.transfer_id in self.terminal:
                assert transfer.state == self.terminal[transfer.transfer_id], transfer
            if transfer.state in TERMINAL:
                self.terminal[transfer.transfer_id] = transfer.state
                continue
            if transfer.decode_block_ids:
                written = transfer.decode_block_ids[transfer.prefix_hit_token_count // BLOCK_SIZE:
                                                    math.ceil(transfer.prompt_token_count / BLOCK_SIZE)]
                for block in written:
                    key = (transfer.decode_engine_id, block)
                    assert key not in owners, f"block {key} owned by {owners.get(key)} and {transfer.transfer_id}"
                    owners[key] = transfer.transfer_id

        async def problems():
            return self.server.state.check_invariants()
        assert self.loop.run(problems()) == []
        assert all(count == 1 for count in self.events.values()), self.events

    def teardown(self):
        """Every ended transfer produced exactly one watch event; then stop everything."""
        if os.environ.get("KVPUSH_FUZZ_VERBOSE"):
            states = Counter(tpb.TransferState.Name(v) for v in self.terminal.values())
            print(dict(states), sorted(self.codes.items()))
        try:
            async def settle():
                for _ in range(100):
                    if all(self.events[t] >= 1 for t in self.terminal):
                        return
                    await asyncio.sleep(0.05)
            self.loop.run(settle())
            missing = [t for t in self.terminal if self.events[t] != 1]
            details = [self.call("GetTransfer", dpb.GetTransferRequest(transfer_id=t)) for t in missing]
            assert not missing, (missing, details, self.events, [t.done() for t in self.watches])
        finally:
            async def stop():
                for task in self.watches:
                    task.cancel()
                for call, task in self.sessions.values():
                    call.cancel()
                    task.cancel()
                await self.channel.close()
                await self.server.stop(0.2)
            self.loop.run(stop())
            self.loop.close()


DirectoryMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_directory_fuzz = DirectoryMachine.TestCase
