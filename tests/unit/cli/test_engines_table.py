"""`kvpush engines`: each worker's row shows the layout fields planning pairs engines by (TP size, layers, block
size in tokens, dtype, the compatibility hash's first 8 characters) beside the columns it always had."""

from __future__ import annotations

from kvpush.cli.main import engines_table
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import make_layout


def _worker(engine_id: str, role: tpb.EngineRole, tp_rank: int, tp_size: int, layout: tpb.KVLayout) -> tpb.EngineWorker:
    worker = tpb.EngineWorker(engine_id=engine_id, role=role, tp_rank=tp_rank, tp_size=tp_size,
                              agent_name=f"{engine_id}-agent-{tp_rank}", layout=layout, model="llama",
                              endpoint=f"http://{engine_id}:8000")
    worker.lease_expire_time.FromSeconds(0)
    return worker


def _rows(table: str) -> tuple[list[str], list[dict[str, str]]]:
    header, *lines = table.splitlines()
    columns = header.split()
    return columns, [dict(zip(columns, line.split(), strict=True)) for line in lines]


def test_a_mismatched_pair_shows_its_block_sizes_tp_sizes_and_hashes():
    prefill = _worker("p0", tpb.ENGINE_ROLE_PREFILL, 0, 1,
                      make_layout(compatibility_hash="0123456789abcdef"))
    decodes = [_worker("d0", tpb.ENGINE_ROLE_DECODE, rank, 2,
                       make_layout(layer_count=8, block_size_tokens=128, dtype="float16",
                                   compatibility_hash="fedcba9876543210")) for rank in (0, 1)]
    decodes[1].load.CopyFrom(tpb.EngineLoad(free_block_count=7, running_request_count=2, waiting_request_count=1))
    columns, rows = _rows(engines_table([prefill, *decodes]))
    assert columns == ["ENGINE", "ROLE", "RANK", "TP", "KV_HEADS", "AGENT", "MODEL", "LAYERS", "BLOCK_TOKENS",
                       "BLOCKS", "DTYPE", "HASH", "FREE", "RUN/WAIT", "ACTIVE", "FIRST_TOKEN", "LEASE_UNTIL",
                       "ENDPOINT"]
    layout_columns = ("ENGINE", "RANK", "TP", "LAYERS", "BLOCK_TOKENS", "DTYPE", "HASH")
    assert [tuple(row[c] for c in layout_columns) for row in rows] == [
        ("p0", "0/1", "1", "4", "16", "bfloat16", "01234567"),
        ("d0", "0/2", "2", "8", "128", "float16", "fedcba98"),
        ("d0", "1/2", "2", "8", "128", "float16", "fedcba98"),
    ]
    # The columns it always had keep their values.
    assert [(row["ROLE"], row["BLOCKS"], row["FREE"], row["RUN/WAIT"], row["FIRST_TOKEN"], row["ENDPOINT"])
            for row in rows] == [("prefill", "64", "-", "-", "-", "http://p0:8000"),
                                 ("decode", "64", "-", "-", "no", "http://d0:8000"),
                                 ("decode", "64", "7", "2/1", "no", "http://d0:8000")]


def test_an_engine_without_a_hash_shows_a_dash():
    _, rows = _rows(engines_table([_worker("p0", tpb.ENGINE_ROLE_PREFILL, 0, 1, make_layout())]))
    assert rows[0]["HASH"] == "-"


def test_kv_heads_show_held_over_the_models_and_a_dash_when_not_registered():
    with_heads = make_layout()
    with_heads.kv_head_count, with_heads.model_kv_head_count = 1, 2
    _, rows = _rows(engines_table([_worker("d0", tpb.ENGINE_ROLE_DECODE, 0, 2, with_heads),
                                   _worker("p0", tpb.ENGINE_ROLE_PREFILL, 0, 1, make_layout())]))
    assert [row["KV_HEADS"] for row in rows] == ["1/2", "-"]
