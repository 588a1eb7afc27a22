"""The `kvserve` command line: help on every flag, and generate end to end."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from kvserve import SamplingParams
from kvserve.entrypoints.cli import build_parser, main


def _all_parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_parsers(sub)


def test_every_flag_has_help():
    missing = [
        f"{parser.prog} {action.option_strings or action.dest}"
        for parser in _all_parsers(build_parser())
        for action in parser._actions
        if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))
        and not action.help
    ]
    assert missing == []


def test_help_shows_every_default():
    """Each flag with a value by default shows it in --help, unless its text says it in words."""
    missing = []
    for parser in _all_parsers(build_parser()):
        help_text = " ".join(parser.format_help().split())  # unwrapped
        for action in parser._actions:
            default = action.default
            if not action.option_strings or default in (None, False, argparse.SUPPRESS):
                continue
            shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
            if "default" not in (action.help or "").lower() and f"(default: {shown})" not in help_text:
                missing.append(f"{parser.prog} {action.option_strings[0]}")
    assert missing == []
    serve_help = " ".join(_subparser(build_parser(), "serve").format_help().split())
    assert "Port to listen on. (default: 8000)" in serve_help


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def test_generate_prints_the_greedy_completion(smollm2_llm):
    prompt = "The capital of France is"
    expected = smollm2_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5))[0]
    result = subprocess.run(
        [sys.executable, "-m", "kvserve.entrypoints.cli", "--log-level", "WARNING", "generate",
         prompt, "--temperature", "0", "--max-tokens", "5", "--kv-cache-memory", "64MiB",
         "--max-model-len", "1024"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == prompt + expected.outputs[0].text + "\n"


def test_bad_flag_value_is_a_clear_error_not_a_traceback(monkeypatch, capsys):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)  # main() sets it; restored after
    assert main(["generate", "Hi", "--top-p", "2"]) == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("kvserve: error: ") and "top_p" in stderr


def test_a_missing_file_is_a_clear_error_not_a_traceback(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    missing = tmp_path / "missing.txt"
    assert main(["eval", "perplexity", "--file", str(missing)]) == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("kvserve: error: ") and str(missing) in stderr


def test_chat_streams_the_same_reply_as_llm_chat_and_quits_on_exit(smollm2_llm):
    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    expected = smollm2_llm.chat(conversation, params)[0].outputs[0].text
    result = subprocess.run(
        [sys.executable, "-m", "kvserve.entrypoints.cli", "--log-level", "WARNING", "chat",
         "--temperature", "0", "--max-tokens", "6", "--kv-cache-memory", "64MiB",
         "--max-model-len", "1024"],
        input="What is the capital of France?\n/exit\nAnd of Spain?\n", capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected + "\n"  # one reply: /exit quit before the second message


# Records GOMP_SPINCOUNT at the moment torch is first imported, then runs `kvserve --help`.
_SPIN_AT_TORCH_IMPORT = """
import builtins, os, sys
import kvserve, kvserve.entrypoints.cli as cli
assert "torch" not in sys.modules
seen, real_import = [], builtins.__import__
def recording_import(name, *args, **kwargs):
    if name.partition(".")[0] == "torch" and "torch" not in sys.modules and not seen:
        seen.append(os.environ.get("GOMP_SPINCOUNT"))
    return real_import(name, *args, **kwargs)
builtins.__import__ = recording_import
try:
    cli.main(["--help"])
except SystemExit:
    pass
print(seen)
"""


def _without_spincount() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name != "GOMP_SPINCOUNT"}


# Imports kvserve's modules (the server's among them) and builds a model the way the loader
# does: no environment variable may change, and Dynamo (~1.2 s of imports) may not come with
# them: it loads only when a decode step is compiled (nn.Embedding's init of a meta tensor
# would import it).
_IMPORT_SIDE_EFFECTS = """
import os, sys
before = dict(os.environ)
import kvserve, kvserve.llm
assert "GOMP_SPINCOUNT" not in os.environ
import kvserve.entrypoints.cli, kvserve.entrypoints.openai.server
assert {k: v for k, v in os.environ.items() if k in before} == before
from kvserve.config import ModelConfig
from kvserve.model_executor.loader import _empty_model
_empty_model(ModelConfig("LlamaForCausalLM", 64, 32, 48, 1, 2, 1, 16), "cpu")
print("dynamo" if "torch._dynamo" in sys.modules else "no dynamo")
"""


def test_importing_kvserve_sets_no_environment_variable_and_loads_no_dynamo():
    result = subprocess.run([sys.executable, "-c", _IMPORT_SIDE_EFFECTS], env=_without_spincount(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "no dynamo"


def test_the_command_sets_gomp_spincount_before_torch_loads():
    """libgomp reads GOMP_SPINCOUNT when torch loads it: the `kvserve` command sets its default
    before its first import of torch, and leaves an explicit setting alone."""
    runs = [(subprocess.Popen([sys.executable, "-c", _SPIN_AT_TORCH_IMPORT], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True), expected)  # both at once: each loads torch
            for env, expected in ((_without_spincount(), "['1000000']"), ({**os.environ, "GOMP_SPINCOUNT": "7"}, "['7']"))]
    for process, expected in runs:
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr[-3000:]
        assert stdout.strip().splitlines()[-1] == expected
