"""The `kvpush` command line: every flag says what it does; `kvpush up`'s flags, API key and state file; the
inspection commands find a running `kvpush up`'s directory without flags."""

from __future__ import annotations

import argparse
import os
import stat
import subprocess
import sys

import pytest

from kvpush.cli import up as up_command
from kvpush.cli.main import _channel_config, build_parser, main
from kvpush.localstack import up


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: sub for action in actions for name, sub in action.choices.items()}


def test_every_flag_of_every_subcommand_has_help():
    """Walks the whole argparse tree: an argument (flag or positional) without help text fails, naming it."""
    parser = build_parser()
    subcommands = _subcommands(parser)
    assert {"directory", "engines", "transfers", "health", "trace", "up", "engine-args"} <= set(subcommands)
    missing = []
    for name, sub in subcommands.items():
        assert not _subcommands(sub), f"{name} has nested subcommands: walk them too"
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"kvpush {name} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, f"arguments without help: {missing}"


def test_the_help_walk_can_fail():
    """The same walk finds a flag added without help."""
    parser = build_parser()
    _subcommands(parser)["engines"].add_argument("--undocumented")
    bare = [a for a in _subcommands(parser)["engines"]._actions if not a.help]
    assert [a.option_strings for a in bare] == [["--undocumented"]]


def test_help_of_every_subcommand_prints():
    """`kvpush SUB --help` exits 0 for every subcommand (argparse formats every help string: a bad % fails here)."""
    for name in _subcommands(build_parser()):
        done = subprocess.run([sys.executable, "-c", "import sys; from kvpush.cli.main import main; "
                               "sys.exit(main())", name, "--help"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "usage: kvpush" in done.stdout, (name, done.stderr)


# ---------------------------------------------------------------- kvpush directory


def test_pair_block_sizes_reaches_the_directory_limits(monkeypatch):
    """Limits.pair_block_sizes is on by default; --no-pair-block-sizes (or KVPUSH_DIRECTORY_PAIR_BLOCK_SIZES=false)
    turns it off; the flag wins over the variable; a variable that is not a switch is refused, naming it."""
    import kvpush.directory.server as server

    served = []
    monkeypatch.setattr(server, "serve", lambda config, use_uvloop: served.append(config))
    monkeypatch.delenv("KVPUSH_DIRECTORY_PAIR_BLOCK_SIZES", raising=False)
    assert main(["directory", "--port", "0"]) == 0
    assert main(["directory", "--port", "0", "--pair-block-sizes"]) == 0
    monkeypatch.setenv("KVPUSH_DIRECTORY_PAIR_BLOCK_SIZES", "true")
    assert main(["directory", "--port", "0"]) == 0
    assert main(["directory", "--port", "0", "--no-pair-block-sizes"]) == 0
    monkeypatch.setenv("KVPUSH_DIRECTORY_PAIR_BLOCK_SIZES", "false")
    assert main(["directory", "--port", "0"]) == 0
    assert main(["directory", "--port", "0", "--pair-block-sizes"]) == 0
    assert [config.limits.pair_block_sizes for config in served] == [True, True, True, False, False, True]
    monkeypatch.setenv("KVPUSH_DIRECTORY_PAIR_BLOCK_SIZES", "maybe")
    with pytest.raises(SystemExit, match="KVPUSH_DIRECTORY_PAIR_BLOCK_SIZES='maybe' is not a switch"):
        build_parser()


# ---------------------------------------------------------------- kvpush up


def _up_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["up", *argv])


def test_up_passes_gpu_flags_to_every_engine(tmp_path):
    """--model, --device cuda, --tensor-parallel-size and --gpu-memory-utilization become vLLM flags of every engine
    (after the stack's own, so they win), with the folder's name as the served model's."""
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    args = _up_args("--model", str(model), "--device", "cuda", "--tensor-parallel-size", "2",
                    "--gpu-memory-utilization", "0.3", "--colocated")
    stack = up._build_stack(args, api_key="k")
    assert stack.model_dir == model.resolve()
    assert stack.served_model_name == "my-model"
    assert stack.engine_args == ("--max-model-len", "4096", "--no-enforce-eager", "--tensor-parallel-size", "2",
                                 "--gpu-memory-utilization", "0.3")
    tiny = up._build_stack(_up_args(), api_key="")
    assert (tiny.engine_args, tiny.served_model_name, tiny.model_dir) == (("--max-model-len", "4096"), "tiny", None)


def test_up_refuses_a_model_folder_without_config(tmp_path):
    """A --model that is not a Hugging Face folder is refused before anything starts."""
    with pytest.raises(ValueError, match=r"no config\.json"):
        up._build_stack(_up_args("--model", str(tmp_path)), api_key="k")


def test_up_gateway_gets_the_key_from_its_environment():
    """The key goes to the gateway's environment (never its command line, which `ps` shows); with --hosted-gateway
    to the prefill engine's too; --no-api-key gives none."""
    stack = up._build_stack(_up_args("--hosted-gateway"), api_key="s3cret")
    assert stack.service_env == {"KVPUSH_GATEWAY_API_KEY": "s3cret"}
    assert stack.engine_env["KVPUSH_GATEWAY_API_KEY"] == "s3cret"
    assert "s3cret" not in " ".join(stack.gateway_args + stack.engine_args)
    assert _up_args("--no-api-key").no_api_key and not _up_args().no_api_key
    assert up._build_stack(_up_args(), api_key="").service_env == {}


def _state(pid: int) -> up_command.UpState:
    return up_command.UpState(pid=pid, directory_address="127.0.0.1:45678", gateway_url="http://127.0.0.1:45679",
                      model="tiny", api_key="k3y", log_dir="/tmp/x", engines={"prefill": "http://127.0.0.1:1"})


def test_state_file_is_the_users_alone_and_read_back(tmp_path, monkeypatch):
    """Written under $XDG_RUNTIME_DIR/kvpush, mode 0600 in a 0700 folder; read back equal; a dead process's is
    ignored; removed only by the process that wrote it."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    path = up_command.state_path()
    assert path == tmp_path / "kvpush" / "up.json"
    _state(os.getpid()).write(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert up_command.read_state() == _state(os.getpid())
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    _state(gone.pid).write(path)
    assert up_command.read_state() is None
    up_command.remove_state(path)
    assert path.exists()  # another process's file stays
    _state(os.getpid()).write(path)
    up_command.remove_state(path)
    assert not path.exists()


def test_state_path_without_runtime_dir_is_in_the_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert up_command.state_path() == tmp_path / ".cache" / "kvpush" / "up.json"


@pytest.mark.parametrize("command", ["engines", "transfers", "health", "trace"])
def test_inspection_commands_default_to_the_running_up(tmp_path, monkeypatch, command):
    """Without --address or KVPUSH_DIRECTORY_ADDRESS the running `kvpush up`'s directory is used; either one wins."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("KVPUSH_DIRECTORY_ADDRESS", raising=False)
    _state(os.getpid()).write(up_command.state_path())
    argv = [command, *(["t-1"] if command == "trace" else [])]
    parser = build_parser()
    assert _channel_config(parser.parse_args(argv)).address == "127.0.0.1:45678"
    assert _channel_config(parser.parse_args([*argv, "--address", "h:1"])).address == "h:1"
    monkeypatch.setenv("KVPUSH_DIRECTORY_ADDRESS", "e:2")
    assert _channel_config(parser.parse_args(argv)).address == "e:2"


# ---------------------------------------------------------------- without the local stack's packages


def test_up_without_transformers_fails_with_one_line_naming_the_install(monkeypatch, capsys):
    """A missing transformers (None in sys.modules: its import raises ImportError) stops `kvpush up` before the stack
    is imported or started: exit 1 and one line on stderr that names the package and the install command."""
    monkeypatch.setitem(sys.modules, "transformers", None)
    started: list[argparse.Namespace] = []
    monkeypatch.setattr(up, "run", started.append)
    code = main(["up", "--no-api-key"])
    out, err = capsys.readouterr()
    assert (code, out, started) == (1, "", [])
    assert err.count("\n") == 1, err
    assert "transformers" in err and "pip install 'kvpush[dev]'" in err and err.startswith("kvpush up: ")


def test_up_with_its_packages_runs_the_local_stack(monkeypatch):
    """With transformers and tokenizers importable the same call reaches the local stack's `run`."""
    started: list[argparse.Namespace] = []
    monkeypatch.setattr(up, "run", lambda args: started.append(args) or 0)
    assert main(["up", "--no-api-key"]) == 0
    assert [args.no_api_key for args in started] == [True]


def test_help_and_inspection_commands_never_import_the_local_stack():
    """`kvpush --help` of every subcommand and an inspection command's configuration import no kvpush.localstack
    module (a fresh interpreter, so nothing the tests imported counts)."""
    probe = ("import sys, contextlib, io\n"
             "from kvpush.cli.main import build_parser, _channel_config\n"
             "parser = build_parser()\n"
             "for argv in (['--help'], ['up', '--help'], ['engine-args', '--help'], ['engines', '--help']):\n"
             "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
             "        parser.parse_args(argv)\n"
             "_channel_config(parser.parse_args(['engines']))\n"
             "print(sorted(m for m in sys.modules if m.startswith('kvpush.localstack')))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
