"""The README's commands and code, checked without a server: every ```bash command names
files, scripts, modules, extras and console scripts that exist; every ```python block
compiles, and those that are self-contained (no name they use comes from outside the block)
run. Also: the README stays short, and opens with the demo and the test command."""
from __future__ import annotations

import ast
import builtins
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MAX_LINES = 260
DEMO = "bash scripts/demo.sh"
TEST = "bash scripts/test.sh     # the test suite, against real servers (what CI runs)"

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.S | re.M)
# Interpreters a command may name: the checkout's environments (made by scripts/install.sh,
# so absent on a fresh clone) or the one on the PATH.
PYTHONS = {"python", "python3", "python3.11", ".venv/bin/python", ".venv-sglang/bin/python"}
# Top-level entries of the repository that a command's argument may point into.
REPO_DIRS = {p.name for p in REPO.iterdir() if not p.name.startswith(".git")}


def blocks(text: str, lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(text) if kind == lang]


def commands(block: str) -> list[str]:
    """The block's commands: continuation lines joined, comments dropped, split at ; && || |."""
    joined = re.sub(r"\\\n\s*", " ", block)
    out = []
    for line in joined.splitlines():
        tokens = shlex.split(line, comments=True)
        if not tokens:
            continue
        command: list[str] = []
        for tok in tokens + [";"]:
            if tok in (";", "&&", "||", "|"):
                if command:
                    out.append(shlex.join(command))
                command = []
            else:
                command.append(tok)
    return out


def setup_py() -> str:
    return (REPO / "setup.py").read_text()


def extras() -> set[str]:
    tree = ast.parse(setup_py())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            return {k.value for k in node.value.keys}
    return set()


def console_scripts() -> set[str]:
    return set(re.findall(r'"([\w-]+) = [\w.]+:\w+"', setup_py()))


def module_problem(name: str) -> str | None:
    """None if `python -m name` finds the module from the repository root."""
    try:
        spec = importlib.util.find_spec(name)
    except ImportError as e:  # a parent package that does not import here
        return f"module {name}: {e}"
    return None if spec is not None else f"no module {name}"


def path_problem(arg: str) -> str | None:
    """None unless `arg` points into the repository at something that is not there."""
    if arg.startswith(("-", "/", "http")) or "=" in arg:
        return None
    first = arg.split("/")[0]
    if "/" not in arg or first not in REPO_DIRS:
        return None
    if arg.startswith((".venv/", ".venv-sglang/")):
        return None  # made by scripts/install.sh
    return None if (REPO / arg.rstrip("/")).exists() else f"missing {arg}"


def check_command(command: str) -> list[str]:
    """What is wrong with one shell command (an empty list when nothing is)."""
    problems = []
    tokens = shlex.split(command)
    while tokens and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", tokens[0]):
        var, _, value = tokens.pop(0).partition("=")
        if var == "PYTHONPATH":
            problems += [f"PYTHONPATH names missing {p}" for p in value.split(":")
                         if p and not (REPO / p).exists()]
    if not tokens or tokens[0] == "export":
        return problems
    prog, args = tokens[0], tokens[1:]
    problems += [p for p in map(path_problem, tokens) if p]
    if prog == "bash":
        script = next((a for a in args if not a.startswith("-")), None)
        if script is None or not (REPO / script).is_file():
            problems.append(f"bash script {script} does not exist")
    elif prog in PYTHONS:
        if args[:1] == ["-m"]:
            problem = module_problem(args[1])
            if problem:
                problems.append(problem)
        elif args[:1] == ["-c"]:
            try:
                tree = ast.parse(args[1])
            except SyntaxError as e:
                return problems + [f"python -c does not compile: {e}"]
            for node in ast.walk(tree):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    names = [node.module] if isinstance(node, ast.ImportFrom) else \
                        [a.name for a in node.names]
                    problems += [p for p in map(module_problem, names) if p]
        elif args and not (REPO / args[0]).is_file():
            problems.append(f"python script {args[0]} does not exist")
    elif prog in ("pip", "pip3") or prog.endswith("/pip"):
        for arg in args:
            m = re.fullmatch(r"\.\[([\w,-]+)\]", arg)
            if m:
                problems += [f"no extra {e!r} in setup.py" for e in m.group(1).split(",")
                             if e not in extras()]
    elif prog in console_scripts() or (prog.startswith(".venv/bin/")
                                        and prog.rsplit("/", 1)[1] in console_scripts()):
        pass
    else:
        problems.append(f"unknown program {prog!r}")
    return problems


def free_names(code: str) -> set[str]:
    """Names a block reads that it neither assigns, imports nor gets from builtins."""
    tree = ast.parse(code)
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
            and isinstance(n.ctx, ast.Load)} - bound


TEXT = README.read_text()
BASH = [c for b in blocks(TEXT, "bash") for c in commands(b)]
PYTHON = blocks(TEXT, "python")


def test_the_readme_is_short():
    assert len(TEXT.splitlines()) <= MAX_LINES


def test_the_first_two_commands_are_the_demo_and_the_tests():
    first = blocks(TEXT, "bash")[0].splitlines()
    assert first[0].split("#")[0].strip() == DEMO
    assert first[1] == TEST  # .ci/run runs it: kept word for word
    assert BASH[:2] == [DEMO, "bash scripts/test.sh"]


@pytest.mark.parametrize("command", BASH)
def test_every_command_names_what_exists(command):
    assert check_command(command) == []


def test_a_command_naming_a_missing_file_fails_the_check():
    assert check_command("bash scripts/no_such_script.sh")
    assert check_command(".venv/bin/python -m examples.no_such_example")
    assert check_command("PYTHONPATH=tests/nowhere python -m vllm_ext.serve")
    assert check_command('pip install ".[no-such-extra]"')
    assert check_command(".venv/bin/python -c 'import no_such_module_here'")
    assert check_command("python docs/no_such_file.py")


@pytest.mark.parametrize("index", range(len(PYTHON)))
def test_every_python_block_compiles(index):
    compile(PYTHON[index], f"README.md python block {index}", "exec")


SELF_CONTAINED = [i for i, code in enumerate(PYTHON) if not free_names(code)]


def test_some_blocks_are_self_contained():
    assert SELF_CONTAINED, "no python block runs on its own: the run check would check nothing"


@pytest.mark.parametrize("index", SELF_CONTAINED)
def test_self_contained_python_blocks_run(index):
    """A block that uses no name from outside it (imports and objects built without a
    server) runs as written, in a fresh interpreter at the repository root."""
    out = subprocess.run([sys.executable, "-c", PYTHON[index]], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


# -- the short commands, run as written ------------------------------------------------------
def readme_command(starts: str) -> str:
    [command] = [c for c in BASH if c.startswith(starts)]
    return command


def test_the_tiny_model_command_builds_a_model(tmp_path):
    """The install section's model build, as written but into a fresh directory (the README
    names /tmp/tiny, which a reader's running server may be using)."""
    command = readme_command(".venv/bin/python -c")
    assert "'/tmp/tiny'" in command
    out = subprocess.run(command.replace("'/tmp/tiny'", f"'{tmp_path / 'tiny'}'"), shell=True,
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "tiny" / "config.json").is_file()


def test_the_cli_command_answers_from_a_real_server(vllm):
    """`.venv/bin/lora-sync --server URL info` as written (the checkout's environment: no
    PATH set up), against the session's vLLM server (its URL
    and admin key in place of the README's)."""
    command = readme_command(".venv/bin/lora-sync ")
    assert "http://127.0.0.1:8000" in command
    out = subprocess.run(command.replace("http://127.0.0.1:8000", vllm.url), shell=True,
                         cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "LORA_SYNC_API_KEY": vllm.api_key})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "vllm" in out.stdout.lower(), out.stdout
