"""Per-engine identities on a real directory: an engine acts only as itself, lease ids stay secret.

Both identity sources run the same checks: per-engine tokens (a tokens file) and mutual TLS with the
engine id in the client certificate's URI SAN. The impostor holds VALID credentials, of engine x1.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import grpc
import pytest
from structlog.testing import capture_logs

from kvpush.client import ChannelConfig
from kvpush.directory import server as server_module
from kvpush.directory.server import DirectoryConfig
from kvpush.localstack.pki import HAVE_OPENSSL, make_pki
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import directory_pb2_grpc as dgrpc
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import DECODE, PREFILL, allocation, ready, register_request, result, running_directory
from tests.integration.directory.helpers import code_of, read, run, send_ready

PD = grpc.StatusCode.PERMISSION_DENIED
PRINCIPALS = {"p1": "engine/p1", "d1": "engine/d1", "x1": "engine/x1", "operator": "operator"}


class Caller:
    """A raw stub with one principal's credentials (token metadata or a client certificate)."""

    def __init__(self, config: ChannelConfig) -> None:
        self.config = config
        self.channel = config.create_channel()
        self.stub = dgrpc.KVDirectoryServiceStub(self.channel)
        self.md = config.metadata

    def __getattr__(self, method: str):
        call = getattr(self.stub, method)
        return lambda *args, **kwargs: call(*args, metadata=self.md, timeout=10, **kwargs) \
            if args else call(metadata=self.md, **kwargs)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path | None:
    """A CA, the server's certificate and one client certificate per principal (None without openssl)."""
    if not HAVE_OPENSSL:
        return None
    return make_pki(tmp_path_factory.mktemp("pki-auth"), {**PRINCIPALS, "nobody": None})


@contextlib.asynccontextmanager
async def identities_directory(source: str, pki: Path | None, tmp_path: Path):
    """A directory with identities from `source` ("tokens" or "mtls") and a Caller per principal."""
    if source == "tokens":
        tokens = {name: f"token-of-{name}-0123456789abcdef" for name in PRINCIPALS}
        tokens_file = tmp_path / "tokens"
        tokens_file.write_text("# principal token\n" + "".join(f"{PRINCIPALS[n]} {t}\n" for n, t in tokens.items()))
        async with running_directory(tokens_file=str(tokens_file)) as directory:
            callers = {n: Caller(ChannelConfig(address=directory.address, token=t)) for n, t in tokens.items()}
            callers["nobody"] = Caller(ChannelConfig(address=directory.address, token="not-a-known-token-at-all"))
            yield directory, callers
    else:
        if pki is None:
            pytest.skip("needs the openssl CLI")
        async with running_directory(tls_cert_file=str(pki / "server.pem"), tls_key_file=str(pki / "server.key"),
                                     tls_client_ca_file=str(pki / "ca.pem")) as directory:
            callers = {n: Caller(ChannelConfig(address=directory.address, root_cert_file=str(pki / "ca.pem"),
                                               client_cert_file=str(pki / f"{n}.pem"),
                                               client_key_file=str(pki / f"{n}.key")))
                       for n in (*PRINCIPALS, "nobody")}
            yield directory, callers
    for caller in callers.values():
        await caller.channel.close()


@pytest.mark.parametrize("source", ["tokens", "mtls"])
def test_an_impostor_with_valid_credentials_is_refused_every_call(source, pki, tmp_path):
    """Engine x1, holding the victims' lease ids, is PERMISSION_DENIED on every call for p1/d1; nothing changes."""
    async def body():
        async with identities_directory(source, pki, tmp_path) as (_, c):
            p_lease = (await c["p1"].RegisterEngine(register_request("p1", PREFILL))).lease_id
            d_lease = (await c["d1"].RegisterEngine(register_request("d1", DECODE))).lease_id
            await c["x1"].RegisterEngine(register_request("x1", PREFILL))  # registering as itself is fine
            tid = (await c["operator"].PlanTransfer(dpb.PlanTransferRequest(
                prefill_engine_id="p1", decode_engine_id="d1"))).transfer.transfer_id
            x = c["x1"]
            assert await code_of(x.RegisterEngine(register_request("p1", PREFILL))) == PD
            assert await code_of(x.RegisterEngine(register_request("p1", PREFILL, tp_rank=1, tp_size=2))) == PD
            assert await code_of(x.DeregisterEngine(dpb.DeregisterEngineRequest(
                engine_id="p1", lease_id=p_lease))) == PD
            renew = x.RenewLease()
            await renew.write(dpb.RenewLeaseRequest(lease_id=p_lease, load=tpb.EngineLoad(free_block_count=0)))
            assert await code_of(read(renew)) == PD
            assert await code_of(x.ReportAllocation(allocation(tid, engine_id="d1"))) == PD
            hello = x.StreamPrefill()
            await hello.write(dpb.StreamPrefillRequest(hello=dpb.Hello(engine_id="p1", lease_id=p_lease)))
            assert await code_of(read(hello)) == PD
            assert await code_of(read(x.WatchTransfers(dpb.WatchTransfersRequest(engine_id="d1")))) == PD
            assert await code_of(x.CancelTransfer(dpb.CancelTransferRequest(transfer_id=tid))) == PD
            assert await code_of(x.GetTransfer(dpb.GetTransferRequest(transfer_id=tid))) == PD
            assert await code_of(x.ListTransfers(dpb.ListTransfersRequest(engine_id="d1"))) == PD
            assert await code_of(x.ListTransfers(dpb.ListTransfersRequest())) == PD
            assert await code_of(x.GetEngine(dpb.GetEngineRequest(engine_id="p1"))) == PD
            assert await code_of(x.ListEngines(dpb.ListEnginesRequest())) == PD
            assert await code_of(x.PlanTransfer(dpb.PlanTransferRequest())) == PD
            # Marking an engine unreachable is the operator's (a gateway's): not an engine's, not even a party's.
            for reporter, victim in ((x, "d1"), (c["d1"], "p1"), (c["p1"], "d1")):
                assert await code_of(reporter.ReportEngineUnreachable(dpb.ReportEngineUnreachableRequest(
                    engine_id=victim, transfer_id=tid))) == PD
            # A caller with no kvpush identity (an unknown token, a certificate without the SAN) is nobody.
            unauthenticated = grpc.StatusCode.UNAUTHENTICATED
            assert await code_of(c["nobody"].ListEngines(dpb.ListEnginesRequest())) == unauthenticated
            assert await code_of(c["nobody"].RegisterEngine(register_request("n1", PREFILL))) == unauthenticated

            # Nothing changed: the transfer still PLANNED, the victims' leases live, and the real engines work.
            operator = c["operator"]
            assert (await operator.GetTransfer(dpb.GetTransferRequest(transfer_id=tid))).transfer.state == \
                tpb.TRANSFER_STATE_PLANNED
            engines = (await operator.ListEngines(dpb.ListEnginesRequest())).workers
            assert {w.engine_id for w in engines} == {"p1", "d1", "x1"}
            assert all(w.lease_id == "" and w.agent_metadata == b"" for w in engines)  # secrets are never listed
            assert not any(w.HasField("load") for w in engines if w.engine_id == "p1")  # x1's renewal was refused
            assert not any(w.HasField("unreachable_time") for w in engines)  # no refused report marked anything
            watch = c["d1"].WatchTransfers(dpb.WatchTransfersRequest(engine_id="d1"))
            assert (await watch.read()).directory_incarnation_id  # the greeting names the incarnation
            prefill = c["p1"].StreamPrefill()
            await prefill.write(dpb.StreamPrefillRequest(hello=dpb.Hello(engine_id="p1", lease_id=p_lease)))
            await c["d1"].ReportAllocation(allocation(tid, engine_id="d1"))
            await send_ready(prefill, ready(tid, 0, 4))
            instruction = (await read(prefill)).instruction
            assert instruction.transfer_id == tid and instruction.decode_agent_metadata == b"nixl-md-d1-0"
            await prefill.write(dpb.StreamPrefillRequest(result=result(tid, dpb.WRITE_RESULT_STATUS_DONE, 4, 100)))
            (event,) = (await read(watch)).events
            assert (event.transfer_id, event.state) == (tid, tpb.TRANSFER_STATE_COMPLETE)
            renew = c["p1"].RenewLease()
            await renew.write(dpb.RenewLeaseRequest(lease_id=p_lease))
            assert (await read(renew)).lease_id == p_lease
            # An engine may inspect and cancel its own transfers.
            assert (await c["d1"].GetTransfer(dpb.GetTransferRequest(transfer_id=tid))).transfer.transfer_id == tid
            assert [t.transfer_id for t in (await c["p1"].ListTransfers(
                dpb.ListTransfersRequest(engine_id="p1"))).transfers] == [tid]
            watch.cancel()
            prefill.cancel()
            renew.cancel()
            assert d_lease
    run(body())


def test_re_registration_gets_a_fresh_lease_never_the_live_one(tmp_path):
    """Registering a live rank again (same agent) answers a NEW lease id; the old one stops renewing."""
    async def body():
        async with identities_directory("tokens", None, tmp_path) as (_, c):
            first = (await c["p1"].RegisterEngine(register_request("p1", PREFILL))).lease_id
            second = (await c["p1"].RegisterEngine(register_request("p1", PREFILL))).lease_id
            assert first != second
            old = c["p1"].RenewLease()
            await old.write(dpb.RenewLeaseRequest(lease_id=first))
            assert await code_of(read(old)) == grpc.StatusCode.NOT_FOUND
            new = c["p1"].RenewLease()
            await new.write(dpb.RenewLeaseRequest(lease_id=second))
            assert (await read(new)).lease_id == second
            new.cancel()
    run(body())


def test_tokens_file_rotation_takes_effect_without_a_restart(tmp_path):
    """A token added to the file works within seconds; a removed one is refused UNAUTHENTICATED."""
    async def body():
        tokens_file = tmp_path / "tokens"
        tokens_file.write_text("engine/p1 old-token-0123456789abcdef\n")
        async with running_directory(tokens_file=str(tokens_file)) as directory:
            old = Caller(ChannelConfig(address=directory.address, token="old-token-0123456789abcdef"))
            new = Caller(ChannelConfig(address=directory.address, token="new-token-0123456789abcdef"))
            assert await code_of(old.GetEngine(dpb.GetEngineRequest(engine_id="p1"))) == grpc.StatusCode.NOT_FOUND
            tokens_file.write_text("engine/p1 new-token-0123456789abcdef\n")
            os.utime(tokens_file, ns=(1, 1))  # a distinct mtime even within the file system's granularity
            for _ in range(50):
                if await code_of(new.GetEngine(dpb.GetEngineRequest(engine_id="p1"))) == grpc.StatusCode.NOT_FOUND:
                    break
                await asyncio.sleep(0.1)
            assert await code_of(new.GetEngine(dpb.GetEngineRequest(engine_id="p1"))) == grpc.StatusCode.NOT_FOUND
            assert await code_of(old.GetEngine(dpb.GetEngineRequest(engine_id="p1"))) == \
                grpc.StatusCode.UNAUTHENTICATED
            await old.channel.close()
            await new.channel.close()
    run(body())


def test_open_directory_warns_that_it_trusts_every_caller():
    """Without identities the serving log line is preceded by a loud warning."""
    async def body():
        with capture_logs() as logs:
            task = asyncio.create_task(server_module.run(DirectoryConfig(port=0)))
            for _ in range(100):
                if any(e["event"] == "directory serving" for e in logs):
                    break
                await asyncio.sleep(0.05)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        warnings = [e for e in logs if e["log_level"] == "warning" and "TRUSTS EVERY CALLER" in e["event"]]
        assert warnings, logs
    run(body())
