"""Connector configuration and kv_transfer_params parsing: good input accepted, bad input refused precisely."""

from __future__ import annotations

import sys

import pytest

from kvpush.api.params import Leg, TransferParams, TransferParamsError, first_token_id_of, parse, write_first_token_id
from kvpush.connector.config import ConnectorConfig, ConnectorConfigError

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class _KVTransferConfig:
    def __init__(self, kv_role, extra, engine_id="engine-a"):
        self.kv_role = kv_role
        self.engine_id = engine_id
        self.kv_connector_extra_config = extra


def test_producer_and_consumer_roles_parse_with_defaults():
    """kv_producer is prefill, kv_consumer decode; unspecified keys take their documented defaults."""
    prefill = ConnectorConfig.from_kv_transfer_config(_KVTransferConfig("kv_producer", {"directory_address": "h:1"}))
    decode = ConnectorConfig.from_kv_transfer_config(_KVTransferConfig("kv_consumer", {"directory_address": "h:1"}))
    assert prefill.is_prefill and decode.is_decode
    assert prefill.nixl_backends == ("UCX",) and prefill.nixl_enable_prog_thread is False
    assert decode.transfer_timeout_s == 60.0 and decode.fault_stall_after_writes is None
    assert decode.message_queue_poll_s == 0.0001 and decode.idle_step_wait_s == 0.004
    assert prefill.batch_layer_posts is True


def test_data_plane_polling_reaches_the_nixl_config():
    """nixl_poll_max_s / nixl_notif_poll_s become the data plane's poll_max_s / notif_poll_s."""
    from kvpush.connector.worker.transport import nixl_config_from

    config = ConnectorConfig.from_extra_config(
        {"directory_address": "h:1", "nixl_poll_max_s": 0.0002, "nixl_notif_poll_s": 0.0001}, role="prefill",
        engine_id="p")
    nixl = nixl_config_from(config)
    assert (nixl.poll_max_s, nixl.notif_poll_s) == (0.0002, 0.0001)


def test_completion_checks_trace_and_switch_interval_reach_their_owners():
    """Defaults: checks in post order, no trace, Python's own switch interval; each key reaches the data plane."""
    from kvpush.connector.worker.transport import nixl_config_from

    default = ConnectorConfig.from_extra_config({"directory_address": "h:1"}, role="prefill", engine_id="p")
    assert (default.nixl_check_in_post_order, default.nixl_io_trace_path, default.gil_switch_interval_s) == \
        (True, "", None)
    assert nixl_config_from(default).check_in_post_order is True
    config = ConnectorConfig.from_extra_config(
        {"directory_address": "h:1", "nixl_check_in_post_order": False, "nixl_io_trace_path": "/tmp/t-{pid}.jsonl",
         "gil_switch_interval_s": 0.0002}, role="prefill", engine_id="p")
    nixl = nixl_config_from(config)
    assert (nixl.check_in_post_order, nixl.io_trace_path) == (False, "/tmp/t-{pid}.jsonl")
    assert config.gil_switch_interval_s == 0.0002
    with pytest.raises(ConnectorConfigError, match="gil_switch_interval_s"):
        ConnectorConfig.from_extra_config({"directory_address": "h:1", "gil_switch_interval_s": 0}, role="prefill",
                                          engine_id="p")


def test_cuda_sync_mode_is_one_of_cudas_scheduling_modes():
    """Unset by default (CUDA's own wait); a mode CUDA has no flag for is refused at start-up, naming the key."""
    assert ConnectorConfig.from_extra_config({"directory_address": "h:1"}, role="prefill",
                                             engine_id="p").cuda_sync_mode is None
    for mode in ("auto", "spin", "yield", "blocking"):
        config = ConnectorConfig.from_extra_config({"directory_address": "h:1", "cuda_sync_mode": mode},
                                                   role="prefill", engine_id="p")
        assert config.cuda_sync_mode == mode
    for bad in ("sleep", 4, True):
        with pytest.raises(ConnectorConfigError, match="cuda_sync_mode"):
            ConnectorConfig.from_extra_config({"directory_address": "h:1", "cuda_sync_mode": bad}, role="prefill",
                                              engine_id="p")


def test_cuda_sync_mode_without_a_cuda_driver_is_a_precise_error():
    """On a machine without the driver (this one) setting a mode says so; an unknown mode is refused first."""
    from kvpush.dataplane.cuda_sched import CudaSchedError, set_sync_mode

    with pytest.raises(ValueError, match="cuda_sync_mode must be one of"):
        set_sync_mode("sleep")
    with pytest.raises(CudaSchedError, match=r"CUDA driver|no CUDA context|CUresult"):
        set_sync_mode("blocking")


def test_message_queue_pacing_can_be_turned_off():
    """null keeps vLLM's own spin."""
    config = ConnectorConfig.from_extra_config({"directory_address": "h:1", "message_queue_poll_s": None},
                                               role="decode", engine_id="d")
    assert config.message_queue_poll_s is None


def test_directory_settings_reach_the_channel_config():
    """directory_* keys travel to the client library's ChannelConfig untouched."""
    config = ConnectorConfig.from_extra_config(
        {"directory_address": "10.0.0.1:50051", "directory_token": "secret", "directory_timeout_s": 2},
        role="decode", engine_id="d")
    assert config.channel_config_dict() == {"directory_address": "10.0.0.1:50051", "directory_token": "secret",
                                            "directory_timeout_s": 2}


@pytest.mark.parametrize("extra, match", [
    ({}, "directory_address"),
    ({"directory_address": "nohost"}, "host:port"),
    ({"directory_address": "h:99999"}, "host:port"),
    ({"directory_address": "h:1", "typo_key": 1}, "unknown key"),
    ({"directory_address": "h:1", "nixl_backends": "UCX"}, "nixl_backends"),
    ({"directory_address": "h:1", "nixl_backends": ["QUIC"]}, "unknown backend"),
    ({"directory_address": "h:1", "transfer_timeout_s": 0}, "transfer_timeout_s"),
    ({"directory_address": "h:1", "nixl_enable_prog_thread": "yes"}, "nixl_enable_prog_thread"),
    ({"directory_address": "h:1", "message_queue_poll_s": 0}, "message_queue_poll_s"),
    ({"directory_address": "h:1", "nixl_poll_max_s": 0}, "nixl_poll_max_s"),
    ({"directory_address": "h:1", "idle_step_wait_s": -1}, "idle_step_wait_s"),
    ({"directory_address": "h:1", "batch_layer_posts": 1}, "batch_layer_posts"),
    ({"directory_address": "h:1", "message_queue_poll_s": 1}, "message_queue_poll_s"),
    ({"directory_address": "h:1", "directory_tls_client_cert": "c.pem"}, "directory settings refused"),
])
def test_bad_extra_config_is_refused_naming_the_key(extra, match):
    """Every bad value raises ConnectorConfigError whose message names what is wrong."""
    with pytest.raises(ConnectorConfigError, match=match):
        ConnectorConfig.from_extra_config(extra, role="prefill", engine_id="p")


def test_kv_both_is_refused():
    """kvpush engines are either prefill or decode."""
    with pytest.raises(ConnectorConfigError, match="kv_producer"):
        ConnectorConfig.from_kv_transfer_config(_KVTransferConfig("kv_both", {"directory_address": "h:1"}))


def test_transfer_params_of_both_legs():
    """The prefill and decode legs parse to their side, with the trace context kept."""
    p_leg = parse({"transfer_id": "t1", "do_remote_decode": True, "traceparent": TRACEPARENT})
    d_leg = parse({"transfer_id": "t1", "do_remote_prefill": True})
    assert p_leg.is_prefill_leg and p_leg.traceparent == TRACEPARENT
    assert not d_leg.is_prefill_leg and d_leg.transfer_id == "t1"
    assert parse(None) is None and parse({"other": 1}) is None


@pytest.mark.parametrize("params, match", [
    ({"do_remote_decode": True}, "transfer_id"),
    ({"transfer_id": "", "do_remote_prefill": True}, "transfer_id"),
    ({"transfer_id": "x" * 200, "do_remote_prefill": True}, "transfer_id"),
    ({"transfer_id": "t", "do_remote_prefill": True, "do_remote_decode": True}, "both"),
])
def test_malformed_transfer_params_are_refused(params, match):
    """A leg without a usable transfer id, or claiming both sides, raises TransferParamsError."""
    with pytest.raises(TransferParamsError, match=match):
        parse(params)


def test_a_bad_traceparent_only_drops_tracing():
    """A malformed traceparent never fails the request: it is ignored."""
    assert parse({"transfer_id": "t", "do_remote_prefill": True, "traceparent": "junk"}).traceparent == ""


def test_package_imports_without_vllm_and_exposes_the_class_lazily():
    """`import kvpush.connector` does not import vLLM; KVPushConnector resolves on first attribute access."""
    import importlib

    for name in [m for m in sys.modules if m == "kvpush.connector" or m.startswith("kvpush.connector.connector")]:
        sys.modules.pop(name)
    module = importlib.import_module("kvpush.connector")
    assert "kvpush.connector.connector" not in sys.modules
    assert module.KVPushConnector.__name__ == "KVPushConnector"
    with pytest.raises(AttributeError):
        module.NoSuchThing  # noqa: B018


def test_decode_leg_first_token_id_is_parsed_strictly():
    """first_token_id is read on the decode leg, refused on the prefill leg and when not a token id."""
    assert parse({"transfer_id": "t", "do_remote_prefill": True, "first_token_id": 17}).first_token_id == 17
    assert parse({"transfer_id": "t", "do_remote_prefill": True}).first_token_id is None
    for bad in ({"transfer_id": "t", "do_remote_decode": True, "first_token_id": 1},
                {"transfer_id": "t", "do_remote_prefill": True, "first_token_id": -1},
                {"transfer_id": "t", "do_remote_prefill": True, "first_token_id": True},
                {"transfer_id": "t", "do_remote_prefill": True, "first_token_id": "7"}):
        with pytest.raises(TransferParamsError, match="first_token_id"):
            parse(bad)


def test_first_token_from_prefill_is_a_boolean_on_either_leg():
    """first_token_from_prefill is read on both legs and refused when not a boolean."""
    for leg in ("do_remote_prefill", "do_remote_decode"):
        assert parse({"transfer_id": "t", leg: True, "first_token_from_prefill": True}) \
            .first_token_from_prefill
        assert not parse({"transfer_id": "t", leg: True}).first_token_from_prefill
        with pytest.raises(TransferParamsError, match="first_token_from_prefill"):
            parse({"transfer_id": "t", leg: True, "first_token_from_prefill": "yes"})


def test_plan_in_flight_is_a_boolean_of_the_prefill_leg():
    """plan_in_flight (the leg left before its PlanTransfer returned) is read on the prefill leg only."""
    assert parse({"transfer_id": "t", "do_remote_decode": True, "plan_in_flight": True}).plan_in_flight
    assert not parse({"transfer_id": "t", "do_remote_decode": True}).plan_in_flight
    for bad in ({"transfer_id": "t", "do_remote_decode": True, "plan_in_flight": 1},
                {"transfer_id": "t", "do_remote_prefill": True, "plan_in_flight": True}):
        with pytest.raises(TransferParamsError, match="plan_in_flight"):
            parse(bad)


@pytest.mark.parametrize("leg", [
    TransferParams.prefill("t1", TRACEPARENT),
    TransferParams.prefill("t1", plan_in_flight=True).replace(first_token_from_prefill=True),
    TransferParams.decode("t1", TRACEPARENT).replace(first_token_from_prefill=True),
    TransferParams.decode("t1").replace(first_token_id=17),
])
def test_every_leg_the_gateway_sends_parses_back_to_itself(leg):
    """What the gateway sends (`to_dict`) is what the connector reads (`parse`), field for field, through JSON."""
    import json

    wire = json.loads(json.dumps(leg.to_dict()))
    assert parse(wire) == leg
    assert wire["do_remote_decode"] is (leg.leg is Leg.PREFILL) and wire["do_remote_prefill"] is (leg.leg is Leg.DECODE)


def test_first_token_id_is_read_and_written_in_place():
    """The logits processor reads the decode request's token, the scheduler writes it into the same dict."""
    params = TransferParams.decode("t").to_dict()
    assert first_token_id_of(params) is None and first_token_id_of(None) is None
    write_first_token_id(params, 5)
    assert first_token_id_of(params) == 5 and parse(params).first_token_id == 5
    with pytest.raises(TransferParamsError, match="first_token_id"):
        first_token_id_of({"first_token_id": -3})
