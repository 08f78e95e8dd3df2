"""Every command that a help text, the README, docs/, a config's comments or a script's own usage lines show exists
and parses: a `moh-dit` subcommand (or train.py / sample.py / evaluate_fid.py, under any launcher) parses the arguments
shown with its own parser; a module or script (`python -m experiments.recipes`, `python benchmarks/main_job.py`)
answers `--help` with its usage line, run as written in a fresh process from the repository root (where only what
that form of the command imports is importable). Placeholders (`...`, `[--step N]`, `<run>`) reduce a command to its
`--help` check."""

import ast
import contextlib
import functools
import importlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from moh_dit.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = {"train.py": "train", "sample.py": "sample", "evaluate_fid.py": "evaluate"}
# where a command starts: the moh-dit command, a launcher, or python running a module or a script
START = re.compile(
    r"(?:accelerate launch|torchrun|(?:\.venv/bin/)?python3?|moh-dit)(?=\s)"
    r"|(?<![\w/.-])(?:train|sample|evaluate_fid)\.py(?=\s|$)"
)
END = re.compile(r"`|\s\|\s?|\s#\s|\s&&\s|\s\|\|\s|\)\s|;\s|\s\s\s")


def _documents() -> dict[str, str]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    texts = {str(p.relative_to(ROOT)): p.read_text() for p in pages}
    for page in sorted((ROOT / "configs").rglob("*.yaml")):  # the comments, as text
        comments = [ln.split("#", 1)[1] for ln in page.read_text().splitlines() if ln.lstrip().startswith("#")]
        texts[str(page.relative_to(ROOT))] = "\n".join(comments)
    for script in sorted([*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "experiments").glob("*.py")]):  # usage lines
        texts[str(script.relative_to(ROOT))] = ast.get_docstring(ast.parse(script.read_text())) or ""
    for name in COMMANDS:
        parser = importlib.import_module(f"moh_dit.cli.{name}").build_parser(f"moh-dit {name}")
        texts[f"moh-dit {name} --help"] = "\n".join(filter(None, (parser.description, parser.epilog)))
    texts["moh-dit --help"] = importlib.import_module("moh_dit.cli").__doc__
    return texts


def _code(text: str) -> list[tuple[str, bool]]:
    """The pieces of ``text`` that are code: lines of fenced or indented blocks (whole commands: parsed in full),
    and inline code spans (often a command's name and one flag: checked by name only)."""
    text = re.sub(r"[ \t]*\\\n\s*(?:#\s*)?", " ", text)  # continuation lines joined
    pieces, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or re.match(r"(?: {4}|\t)", line):
            pieces.append((line.strip(), True))
        else:
            pieces += [(span, False) for span in re.findall(r"`([^`]+)`", line)]
    return pieces


def documented_commands(text: str) -> list[tuple[str, bool]]:
    """The command lines in ``text`` (see :func:`_code`), each cut where a comment or the next command starts."""
    found = []
    for piece, whole in _code(text):
        taken = 0
        for start in START.finditer(piece):
            if start.start() < taken or (start.start() and piece[start.start() - 1] not in " ("):
                continue
            rest = piece[start.start() :]
            cut = END.search(rest)
            command = re.sub(r"(?<!\.)[.,:;]$", "", (rest[: cut.start()] if cut else rest).strip())  # not "..."
            taken = start.start() + len(command)
            found.append((command, whole))
    return found


def target(command: str) -> tuple[str, str, list[str]] | None:
    """``("cli", subcommand, args)``, ``("module", name, [])``, ``("script", path, [])`` or ``None`` (not ours)."""
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    for i, word in enumerate(words):
        if (word == "moh-dit" or (word == "moh_dit" and words[i - 1] == "-m")) and not (
            i + 1 < len(words) and not re.fullmatch(r"[a-z]+|-.*", words[i + 1])
        ):
            sub = words[i + 1] if i + 1 < len(words) else "--help"
            return ("cli", sub, words[i + 2 :]) if not sub.startswith("-") else ("cli", "", words[i + 1 :])
        if Path(word).name in SCRIPTS and not word.startswith(("benchmarks", "experiments")):
            return "cli", SCRIPTS[Path(word).name], words[i + 1 :]
        if word == "-m" and i + 1 < len(words) and words[i - 1].endswith(("python", "python3", "launch", "torchrun")):
            name = words[i + 1]
            return (
                None
                if name.split(".")[0] in ("pytest", "pip", "torch", "accelerate", "venv")
                else ("module", name, [])
            )
        if word.endswith(".py") and words[0].split("/")[-1].startswith("python") and i == 1:
            return "script", word, []
    return None


PLACEHOLDER = re.compile(r"\.\.\.|\[|<|\bRUN\b|\bDIR\b|\bN\b|\bREPO\b|\bPATH\b|\bFOLDER\b|\bCOMMAND\b|\{")


def _help(run) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
        run()
    assert stop.value.code in (0, None), out.getvalue()
    return out.getvalue()


def _all_commands() -> list[tuple[str, str, bool]]:
    seen, cases = set(), []
    for where, text in _documents().items():
        for command, whole in documented_commands(text):
            found = target(command)
            key = (found[0], found[1], tuple(found[2]) if whole else None) if found else None
            if found and key not in seen:
                seen.add(key)
                cases.append((where, command, whole))
    return cases


CASES = _all_commands()


def test_the_documents_show_commands_of_every_kind():
    kinds = {target(c)[0] for _, c, _ in CASES}
    subcommands = {target(c)[1] for _, c, _ in CASES if target(c)[0] == "cli"}
    assert kinds == {"cli", "module", "script"} and set(COMMANDS) <= subcommands, (kinds, subcommands)


def test_the_extraction_of_commands_from_prose():
    text = (
        "moh-dit does this. Run `moh-dit sample RUN --num-samples 8` | or\n"
        "    accelerate launch --num_processes 8 train.py --config x.yaml \\\n        a.b=1   # note"
    )
    assert documented_commands(text) == [
        ("moh-dit sample RUN --num-samples 8", False),
        ("accelerate launch --num_processes 8 train.py --config x.yaml a.b=1", True),
    ]
    assert target("accelerate launch --num_processes 8 train.py --config x.yaml a.b=1") == (
        "cli",
        "train",
        ["--config", "x.yaml", "a.b=1"],
    )
    assert target("python -m experiments.recipes --part train") == ("module", "experiments.recipes", [])
    assert target("python -m pytest -q") is None


@pytest.mark.parametrize("where, command, whole", CASES, ids=[f"{w}: {c[:60]}" for w, c, _ in CASES])
def test_a_documented_command_exists_and_parses(where, command, whole, monkeypatch):
    kind, name, args = target(command)
    if kind == "cli":
        assert name in COMMANDS, f"{where} shows `{command}`: moh-dit has no command {name!r}"
        module = importlib.import_module(f"moh_dit.cli.{name}")
        parser = module.build_parser(f"moh-dit {name}")
        if not whole or PLACEHOLDER.search(" ".join(args)):
            assert _help(lambda: parser.parse_args(["--help"])).startswith(f"usage: moh-dit {name}")
            return
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                parser.parse_args(args)
            except SystemExit:
                pytest.fail(f"{where} shows `{command}`, which does not parse: {err.getvalue().strip()}")
        return
    if kind == "script":
        assert (ROOT / name).is_file(), f"{where} shows `{command}`: {name} does not exist"
    code, shown = answers_help()[(kind, name)]
    assert code == 0 and "usage:" in shown, f"{where} shows `{command}`, but as written it answers:\n{shown[-1500:]}"


# Each documented module or script answers --help as `python -m NAME` or `python PATH` would, in a fresh interpreter
# that starts from the repository root without the test's import path. Running each in its own interpreter cost two
# minutes of the suite (torch and torch-fidelity imported 28 times); an interpreter runs a share of them in turn, with
# the import path each form of the command has (`-m`: the working directory; a script: its own folder) and the
# repository's own packages (benchmarks, experiments) forgotten before each, so that a script that cannot import
# them from its own path still fails as a user's would (test below). moh_dit is installed and imports from anywhere.
RUNNER = r"""
import contextlib, io, json, os, runpy, sys, traceback
base = [p for p in sys.path if p not in ("", os.getcwd())]
answers = []
for kind, name in json.loads(sys.argv[1]):
    for module in [m for m in sys.modules if m.split(".")[0] in ("benchmarks", "experiments", "__mp_main__")]:
        del sys.modules[module]
    sys.path[:] = [os.getcwd() if kind == "module" else os.path.dirname(os.path.abspath(name)), *base]
    sys.argv = [name, "--help"]
    shown, code = io.StringIO(), 0
    with contextlib.redirect_stdout(shown), contextlib.redirect_stderr(shown):
        try:
            if kind == "module":
                runpy.run_module(name, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(name, run_name="__main__")
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
    answers.append([kind, name, code, shown.getvalue()])
print(json.dumps(answers))
"""


def run_help(commands: list[tuple[str, str]]) -> dict[tuple[str, str], tuple[int, str]]:
    """``--help`` of each ``(kind, name)`` (``module`` or ``script``), answered in one fresh interpreter (see above)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(commands)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return {(kind, name): (code, shown) for kind, name, code, shown in json.loads(done.stdout.splitlines()[-1])}


@functools.cache
def answers_help() -> dict[tuple[str, str], tuple[int, str]]:
    """Each documented module and script's ``--help``, answered as written from the repository root: one interpreter
    per core, each taking every other command."""
    wanted = sorted({target(c)[:2] for _, c, _ in CASES if target(c)[0] != "cli"})
    with ThreadPoolExecutor(max_workers=2) as pool:
        shares = pool.map(run_help, [wanted[0::2], wanted[1::2]])
    return {key: answer for share in shares for key, answer in share.items()}


def test_a_script_run_from_its_path_sees_no_more_than_a_fresh_process_does(tmp_path):
    """The check above runs each command as a user would: a script that imports the benchmarks package without
    putting the repository root on its path fails there, as it did for a user (moh-dit 0.5's benchmarks/attention.py),
    even right after a script that did put it there."""
    script = tmp_path / "bench.py"
    script.write_text("import benchmarks.timing\n")
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})  # fmt: skip
    assert done.returncode != 0 and "No module named 'benchmarks'" in done.stderr
    answers = run_help([("script", "benchmarks/cli_startup.py"), ("script", str(script)), ("module", "moh_dit")])
    assert answers[("script", "benchmarks/cli_startup.py")][0] == 0
    code, shown = answers[("script", str(script))]
    assert code != 0 and "No module named 'benchmarks'" in shown
    assert answers[("module", "moh_dit")][0] == 0 and "usage:" in answers[("module", "moh_dit")][1]


DRY_RUNS = [
    (where, command)
    for where, command, whole in CASES
    if whole and target(command)[0] in ("module", "script") and not PLACEHOLDER.search(command)
]
# the GPU proof's dry run is the whole proof on the CPU (tests/test_gpu_proof.py runs it and reads its report): as
# written here only on demand
ON_DEMAND = ("benchmarks/gpu_proof.py",)
DRY_RUN_CASES = [
    pytest.param(where, command, marks=[pytest.mark.slow] if target(command)[1] in ON_DEMAND else [])
    for where, command in DRY_RUNS
]


@pytest.mark.parametrize("where, command", DRY_RUN_CASES, ids=[f"{w}: {c[:60]}" for w, c in DRY_RUNS])
def test_a_documented_usage_example_runs_as_written_where_its_script_has_a_dry_run(where, command):
    """``--help`` shows a usage line exists; a script that offers ``--dry-run`` also reads the example's own
    arguments (its configs, its overrides) as written, in a fresh process: benchmarks/config_throughput.py's depth
    example was refused while its --help answered."""
    kind, name, _ = target(command)
    code, shown = answers_help()[(kind, name)]
    if "--dry-run" not in shown:
        pytest.skip(f"{name} has no --dry-run: its --help is the check")
    words = shlex.split(command)
    start = next(i for i, w in enumerate(words) if Path(w).name.startswith("python"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, *words[start + 1 :], "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, (
        f"{where} shows `{command}`, which as written fails:\n{(done.stdout + done.stderr)[-1500:]}"
    )
