"""The images `make images` builds, started with podman: directory, a prefill and a decode CPU engine (the tiny model
mounted read-only) and the gateway as SageMaker runs it (`serve`, configured by environment variables), one
completion, chat and stream through the stack, every transfer pushed and complete.

Needs root, podman and mmdebstrap (scripts/setup.sh installs them); `make images` keeps podman's layers, so a run
without changes rebuilds nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvpush.client import ChannelConfig, SyncDirectoryClient
from kvpush.localstack.client import call, stream_completion
from kvpush.localstack.model import TinyModelSpec, ensure_tiny_model
from kvpush.localstack.processes import (
    EngineSpec,
    ManagedProcess,
    free_port,
    http_ok,
    model_dtype,
    tcp_open,
)
from kvpush.localstack.stack import (
    DECODE_ENGINE_ARGS,
    DIRECTORY_ARGS,
    kv_transfer_config,
)
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import settled_transfer

ROOT = Path(__file__).resolve().parents[3]
IMAGES_SH = str(ROOT / "scripts" / "images.sh")
MODEL_IN_IMAGE = Path("/model")
TOKEN = "image-test-token"
API_KEY = "image-test-api-key"
BUILD_TIMEOUT_S = 1800.0
ENGINE_READY_TIMEOUT_S = 600.0

_missing = [tool for tool in ("podman", "mmdebstrap", "runc") if shutil.which(tool) is None]
pytestmark = [
    pytest.mark.engines,
    pytest.mark.skipif(bool(_missing), reason=f"needs {', '.join(_missing)} (scripts/setup.sh installs them as root)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="podman builds and runs the images as root here"),
]


@dataclass
class Container:
    """One `podman run --rm --network host` in the foreground, its output in a log file; stop() removes it."""

    name: str
    image: str
    args: Sequence[str]
    log_dir: Path
    env: Mapping[str, str] = field(default_factory=dict)
    volumes: Sequence[str] = ()
    process: ManagedProcess | None = None

    @property
    def container_name(self) -> str:
        return f"kvpush-test-{self.name}-{os.getpid()}"

    def start(self) -> Container:
        argv = [IMAGES_SH, "podman", "run", "--rm", "--name", self.container_name, "--network", "host",
                "--shm-size", "1g"]
        for key, value in self.env.items():
            argv += ["-e", f"{key}={value}"]
        for volume in self.volumes:
            argv += ["-v", volume]
        self.process = ManagedProcess(self.name, [*argv, self.image, *self.args], self.log_dir / f"{self.name}.log")
        self.process.start()
        return self

    def stop(self) -> None:
        # podman stop reaches the container even where the foreground `podman run` is already gone.
        subprocess.run([IMAGES_SH, "podman", "rm", "--force", "--time", "10", self.container_name],
                       check=False, capture_output=True, timeout=60)
        if self.process is not None:
            self.process.stop(grace_s=10.0)


def _built_images() -> dict[str, str]:
    """`make images` (cached layers) and the tag of each image it built."""
    # --no-print-directory: inside `make test` a sub-make would print "Leaving directory" after the last tag.
    done = subprocess.run(["make", "--no-print-directory", "images"], check=False, cwd=ROOT, capture_output=True,
                          text=True,
                          timeout=BUILD_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    version = Path(done.stdout.strip().splitlines()[-1]).name.split("-")[1]
    return {name: f"localhost/kvpush/{name}:{version}" for name in ("directory", "gateway", "engine-cpu")}


def _engine(role: str, image: str, port: int, directory_address: str, model_dir: Path, log_dir: Path) -> Container:
    """A CPU engine container with KVPushConnector: the command line and environment the local stack gives its
    engines (EngineSpec), less the interpreter (the image's entry point runs the OpenAI server)."""
    extra = {"directory_token": TOKEN}
    spec = EngineSpec(name=role, model_dir=MODEL_IN_IMAGE, port=port, kv_transfer_config=kv_transfer_config(
        "kvpush", role, engine_id=f"image-{role}", directory_address=directory_address,
        engine_endpoint=f"http://127.0.0.1:{port}", extra=extra),
        extra_args=("--dtype", model_dtype(model_dir) or "auto",
                    *(DECODE_ENGINE_ARGS if role == "decode" else ())),
        env={"UCX_NET_DEVICES": "lo"})
    argv = spec.argv()
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"], argv[:3]
    return Container(role, image, argv[3:], log_dir, env=spec.environment(),
                     volumes=[f"{model_dir}:{MODEL_IN_IMAGE}:ro"])


def _readable_copy(model_dir: Path, target: Path) -> Path:
    """The model folder, readable by the images' unprivileged user (the cache keeps its files private to root)."""
    shutil.copytree(model_dir, target)
    target.chmod(0o755)
    for path in target.iterdir():
        path.chmod(0o644)
    return target


@dataclass
class ImageStack:
    """The running containers and where they answer."""

    directory_address: str
    gateway_url: str
    ping_before_engines: int
    engines: dict[str, str]

    def transfer(self, transfer_id: str) -> tpb.Transfer:
        client = SyncDirectoryClient(ChannelConfig(address=self.directory_address, token=TOKEN, timeout_s=5.0))
        try:
            return settled_transfer(client.get_transfer, transfer_id)
        finally:
            client.close()


@pytest.fixture(scope="module")
def image_stack(tmp_path_factory) -> Iterator[ImageStack]:
    """Directory, gateway (`serve`), prefill and decode containers; /ping is read before the engines start."""
    images = _built_images()
    log_dir = tmp_path_factory.mktemp("images")
    model_dir = _readable_copy(ensure_tiny_model(TinyModelSpec()), log_dir / "model")
    directory_port, gateway_port, prefill_port, decode_port = (free_port() for _ in range(4))
    directory_address = f"127.0.0.1:{directory_port}"
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    containers: list[Container] = []
    try:
        directory = Container("directory", images["directory"],
                              ["--host", "127.0.0.1", "--port", str(directory_port), "--token", TOKEN,
                               *DIRECTORY_ARGS], log_dir).start()
        containers.append(directory)
        assert directory.process is not None  # a directory that dies at start shows its log here, not as a gateway's
        directory.process.wait_ready(lambda: tcp_open("127.0.0.1", directory_port), 60.0)
        # As SageMaker runs it: `docker run IMAGE serve`, settings in the container's environment.
        gateway = Container("gateway", images["gateway"], ["serve"], log_dir, env={
            "SAGEMAKER_BIND_TO_PORT": str(gateway_port), "KVPUSH_DIRECTORY_ADDRESS": directory_address,
            "KVPUSH_DIRECTORY_TOKEN": TOKEN, "KVPUSH_GATEWAY_API_KEY": API_KEY}).start()
        containers.append(gateway)
        assert gateway.process is not None
        gateway.process.wait_ready(lambda: http_ok(gateway_url + "/health"), 60.0)
        ping_before = call("GET", gateway_url + "/ping").status
        engines = {"prefill": prefill_port, "decode": decode_port}
        for role, port in engines.items():
            containers.append(_engine(role, images["engine-cpu"], port, directory_address, model_dir, log_dir).start())
        for container in containers[2:]:
            port = engines[container.name]
            assert container.process is not None
            container.process.wait_ready(lambda port=port: http_ok(f"http://127.0.0.1:{port}/health"),
                                         ENGINE_READY_TIMEOUT_S, poll_s=1.0)
        # The connectors register as their engines start; /ping says when both roles are routable.
        gateway.process.wait_ready(lambda: http_ok(gateway_url + "/ping"), 60.0)
        yield ImageStack(directory_address, gateway_url, ping_before,
                         {role: f"http://127.0.0.1:{port}" for role, port in engines.items()})
    finally:
        for container in reversed(containers):
            container.stop()


def _ids(count: int) -> list[int]:
    return [3 + (i * 37) % 1000 for i in range(count)]


def test_ping_is_503_until_both_roles_register_then_200(image_stack):
    """SageMaker's health check: 503 while no engine is registered, 200 once a prefill and a decode engine are."""
    assert image_stack.ping_before_engines == 503
    assert call("GET", image_stack.gateway_url + "/ping").status == 200


def test_invocations_completion_is_pushed_from_the_prefill_container(image_stack):
    """/invocations with a completions body answers the requested tokens; its KV went prefill → decode, complete."""
    body = {"model": "tiny", "prompt": _ids(40), "max_tokens": 4, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    answer = call("POST", image_stack.gateway_url + "/invocations", body, timeout_s=180)
    assert answer.status == 200, answer.text
    assert len(answer.body["choices"][0]["token_ids"]) == 4
    transfer = image_stack.transfer(answer.headers["x-kvpush-transfer-id"])
    assert transfer.state == tpb.TRANSFER_STATE_COMPLETE, transfer.failure_reason
    assert (transfer.prefill_engine_id, transfer.decode_engine_id) == ("image-prefill", "image-decode")


def test_invocations_chat_and_stream(image_stack):
    """/invocations takes a chat body (messages) and a streaming one; both answer through a complete transfer."""
    chat = call("POST", image_stack.gateway_url + "/invocations",
                {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3,
                 "temperature": 0.0}, timeout_s=180)
    assert chat.status == 200, chat.text
    assert chat.body["object"] == "chat.completion" and chat.body["usage"]["completion_tokens"] > 0
    assert image_stack.transfer(chat.headers["x-kvpush-transfer-id"]).state == tpb.TRANSFER_STATE_COMPLETE
    streamed = stream_completion(image_stack.gateway_url + "/invocations",
                                 {"model": "tiny", "prompt": _ids(24), "max_tokens": 5, "temperature": 0.0,
                                  "ignore_eos": True}, timeout_s=180)
    assert streamed.status == 200 and not streamed.error, streamed.error
    assert streamed.text
    assert image_stack.transfer(streamed.headers["x-kvpush-transfer-id"]).state == tpb.TRANSFER_STATE_COMPLETE


def test_gateway_api_key_from_the_environment_guards_v1_but_not_invocations(image_stack):
    """KVPUSH_GATEWAY_API_KEY, set in the container's environment, closes /v1/* to callers without it."""
    body = {"model": "tiny", "prompt": _ids(8), "max_tokens": 1}
    refused = call("POST", image_stack.gateway_url + "/v1/completions", body, timeout_s=60)
    assert refused.status == 401, refused.text
    allowed = call("POST", image_stack.gateway_url + "/v1/completions", body,
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout_s=180)
    assert allowed.status == 200, allowed.text
