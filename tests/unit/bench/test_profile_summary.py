"""bench/profile_summary.py: py-spy raw lines to per-thread samples and kvpush frames."""

from __future__ import annotations

from tests.fixtures.bench_scripts import load_bench

LINES = [
    # --subprocesses: the parent's and the child's process frames come before the thread frame.
    'process 7:"python3 -m vllm.entrypoints.openai.api_server --kv-transfer-config {\\"kv_connector_module_path\\": '
    '\\"kvpush.connector\\"}";process 9:"VLLM::EngineCore";thread (9): MainThread;run (core.py:1);'
    "KVPushConnector.save_kv_layer (kvpush/connector/connector.py:187);Event.record (torch/cuda/streams.py:209) 5\n",
    'process 7:"python3 -m vllm";process 9:"VLLM::EngineCore";thread (9): MainThread;run (core.py:1);'
    "forward (llama.py:400) 20\n",
    'process 7:"python3 -m vllm";process 9:"VLLM::EngineCore";thread (11): kvpush-nixl-io;'
    "TransferAgent._loop (kvpush/connector/dataplane/agent.py:272) 8\n",
    "not a raw line\n",
]


def test_samples_and_kvpush_frames_per_thread():
    summary = load_bench("profile_summary").summarise(LINES)
    threads = {(t["process"], t["thread"]): t for t in summary["threads"]}
    main = threads[("9 VLLM::EngineCore", "MainThread")]
    assert (main["samples"], main["samples_in_kvpush"]) == (25, 5)
    assert main["outermost_kvpush_frames"] == [("KVPushConnector.save_kv_layer (kvpush/connector/connector.py:187)", 5)]
    assert main["leaves_under_kvpush"][0][0] == "Event.record (torch/cuda/streams.py:209)"
    io = threads[("9 VLLM::EngineCore", "kvpush-nixl-io")]
    assert (io["samples"], io["samples_in_kvpush"]) == (8, 8)
    # The command line's "kvpush.connector" is not a frame: the first thread's kvpush count is 5, not 25.
    assert next(iter(threads)) == ("9 VLLM::EngineCore", "MainThread")


def test_markers_name_the_files_of_a_checkout_installed_in_place():
    """With the repository's own folders as markers, its frames count (here: none says kvpush/)."""
    lines = ['process 9:"VLLM::EngineCore";thread (11): kvpush-nixl-io;'
             "TransferAgent._loop (/repo/connector/dataplane/agent.py:272) 8\n"]
    summarise = load_bench("profile_summary").summarise
    assert summarise(lines)["threads"][0]["samples_in_kvpush"] == 0
    assert summarise(lines, markers=("/repo/connector/",))["threads"][0]["samples_in_kvpush"] == 8
