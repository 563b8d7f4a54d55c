"""What one caller or client may hold of a real directory, over gRPC with per-engine identities: stream slots per
identity (renewals kept apart), a client's share of an engine's transfer cap, and cancels whatever their reason."""

from __future__ import annotations

import asyncio

import grpc

from kvpush.client import PLAN_CLIENT_ID, ChannelConfig, DirectoryCallError, DirectoryClient, client_id_of
from kvpush.directory.state import Limits
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import DECODE, PREFILL, register_request, running_directory
from tests.integration.directory.helpers import code_of, read, run

PRINCIPALS = {"p1": "engine/p1", "d1": "engine/d1", "d2": "engine/d2", "operator": "operator"}


def _tokens(tmp_path) -> tuple[str, dict[str, str]]:
    tokens = {name: f"token-of-{name}-0123456789abcdef" for name in PRINCIPALS}
    path = tmp_path / "tokens"
    path.write_text("".join(f"{PRINCIPALS[name]} {token}\n" for name, token in tokens.items()))
    return str(path), tokens


def test_one_identity_filling_its_stream_slots_leaves_other_engines_and_renewals_alone(tmp_path):
    """d1 opens watches on itself until refused (its 4 slots); its own renewal and d2's renewals and watches open."""
    tokens_file, tokens = _tokens(tmp_path)

    async def body():
        limits = Limits(max_streams_per_identity=4, max_open_streams=12, renewal_reserved_share=0.25)
        async with running_directory(limits, tokens_file=tokens_file) as directory:
            clients = {name: DirectoryClient(ChannelConfig(address=directory.address, token=token))
                       for name, token in tokens.items()}
            stubs = {name: client.stub_for(directory.address) for name, client in clients.items()}
            md = {name: (("authorization", f"Bearer {token}"),) for name, token in tokens.items()}
            leases = {name: (await stubs[name].RegisterEngine(register_request(name, DECODE), metadata=md[name]))
                      .lease_id for name in ("d1", "d2")}
            watches = []
            for _ in range(4):
                watch = stubs["d1"].WatchTransfers(dpb.WatchTransfersRequest(engine_id="d1"), metadata=md["d1"])
                assert (await watch.read()).directory_incarnation_id
                watches.append(watch)
            refused = stubs["d1"].WatchTransfers(dpb.WatchTransfersRequest(engine_id="d1"), metadata=md["d1"])
            assert await code_of(refused.read()) == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert await refused.details() == ("engine/d1 has 4 open streams other than renewals; the cap per "
                                               "caller is 4")
            streams = []
            for name in ("d1", "d2", "d2"):  # renewals: never refused because watches took the slots
                renewal = stubs[name].RenewLease(metadata=md[name])
                await renewal.write(dpb.RenewLeaseRequest(lease_id=leases[name]))
                assert (await read(renewal)).lease_id == leases[name]
                streams.append(renewal)
            for _ in range(2):
                watch = stubs["d2"].WatchTransfers(dpb.WatchTransfersRequest(engine_id="d2"), metadata=md["d2"])
                assert (await watch.read()).directory_incarnation_id
                streams.append(watch)
            servicer = directory.server.servicer
            assert servicer.limit_refusals["identity_streams"] == 1
            assert directory.server.metrics.registry.get_sample_value(
                "kvpush_directory_limit_refusals_total", {"limit": "identity_streams"}) == 1
            for call in (*watches, *streams):
                call.cancel()
            for client in clients.values():
                await client.close()
    run(body())


def test_a_client_holds_at_most_its_share_and_a_cancel_takes_any_reason(tmp_path):
    """With --max-client-share 0.25 of a cap of 8, a client plans 2 transfers on p1/d1, the third is
    RESOURCE_EXHAUSTED naming it; another client still plans. A multi-line, over-long cancel reason is cleaned and
    the cancel applies (the slot frees at once: nothing was dispatched)."""
    tokens_file, tokens = _tokens(tmp_path)

    async def body():
        limits = Limits(max_active_transfers_per_engine=8, max_client_share=0.25)
        async with running_directory(limits, tokens_file=tokens_file) as directory:
            engines = {name: DirectoryClient(ChannelConfig(address=directory.address, token=tokens[name]))
                       for name in ("p1", "d1")}
            await engines["p1"].register_engine(register_request("p1", PREFILL))
            await engines["d1"].register_engine(register_request("d1", DECODE))
            gateway = DirectoryClient(ChannelConfig(address=directory.address, token=tokens["operator"]))
            client = client_id_of(peer="ipv4:10.0.0.7")
            assert client == "addr-ipv4:10.0.0.7"
            assert client_id_of(api_key="sk-secret") == "key-" + __import__("hashlib").sha256(
                b"sk-secret").hexdigest()[:16]
            PLAN_CLIENT_ID.set(client)  # as the gateway does per request: plans name the client without saying so
            first = [(await gateway.plan_transfer()).transfer for _ in range(2)]
            assert {t.prefill_engine_id for t in first} == {"p1"}
            try:
                await gateway.plan_transfer()
                raise AssertionError("a third plan for the client was accepted")
            except DirectoryCallError as error:
                assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert f"client {client!r} holds 2 live transfers" in error.details and "0.25" in error.details
            other = (await gateway.plan_transfer(client_id="key-0123456789abcdef")).transfer
            assert other.prefill_engine_id == "p1"
            try:
                await gateway.plan_transfer(client_id="not a valid id")
                raise AssertionError("a malformed client_id was accepted")
            except DirectoryCallError as error:
                assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "client_id" in error.details
            reason = "prefill leg failed: 500\nTraceback (most recent call last):\n\x00" + "x" * 3000
            cancelled = await gateway.cancel_transfer(first[0].transfer_id, reason)
            assert cancelled.state == tpb.TRANSFER_STATE_CANCELLED
            assert cancelled.failure_reason.startswith("prefill leg failed: 500 Traceback (most recent call last):  ")
            assert len(cancelled.failure_reason) == 1024 and cancelled.failure_reason.endswith("...")
            assert (await gateway.plan_transfer()).transfer.prefill_engine_id == "p1"  # its slot came back
            assert directory.server.servicer.limit_refusals["client_share"] == 1
            assert directory.server.state.check_invariants() == []
            for each in (*engines.values(), gateway):
                await each.close()
    run(body())


def test_calls_past_a_callers_share_wait_their_turn(tmp_path):
    """Many concurrent unary calls of one caller (25 times its calls in flight) all succeed, waiting unread."""
    tokens_file, tokens = _tokens(tmp_path)

    async def body():
        async with running_directory(Limits(max_calls_in_flight_per_caller=2), tokens_file=tokens_file) as directory:
            operator = DirectoryClient(ChannelConfig(address=directory.address, token=tokens["operator"]))
            answers = await asyncio.gather(*[operator.list_engines() for _ in range(50)])
            assert answers == [[]] * 50
            assert directory.server.servicer.limit_refusals == {}
            await operator.close()
    run(body())
