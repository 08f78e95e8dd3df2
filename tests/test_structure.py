"""The package's structure: its layers (model/ at the bottom, cli/ at the top, sampling/ beside training/), no
import cycles between its modules (lazy imports inside functions count), the command modules answer --help
without torch, and nothing refers to files outside the repository."""

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "moh_dit"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
EXPERIMENTS = {module_name(p): p for p in (ROOT / "experiments").glob("*.py")}


def module_imports(path: Path, type_hints: bool = False) -> set[str]:
    """moh_dit modules imported anywhere in ``path`` (lazy imports inside functions count), except under ``if
    TYPE_CHECKING`` (which never runs). ``from moh_dit.sampling import pipeline`` imports the module
    ``moh_dit.sampling.pipeline``; ``from moh_dit.files import sibling`` the module ``moh_dit.files``."""
    found: set[str] = set()
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            if "TYPE_CHECKING" in ast.unparse(node.test) and not type_hints:
                self.generic_visit(ast.Module(body=node.orelse, type_ignores=[]))
                return
            self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            found.update(a.name for a in node.names if a.name.split(".")[0] == "moh_dit")

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            if module.split(".")[0] != "moh_dit":
                return
            for alias in node.names:
                found.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in MODULES else module)

    Visitor().visit(ast.parse(path.read_text()))
    return found & set(MODULES)


GRAPH = {name: module_imports(path) - {name} for name, path in MODULES.items()}
# with the imports made for type hints only: a circle there is still two modules that each need the other
TYPED_GRAPH = {name: module_imports(path, type_hints=True) - {name} for name, path in MODULES.items()}


def imports_of(prefix: str) -> dict[str, set[str]]:
    """What each module in the subpackage ``prefix`` imports from the rest of the package."""
    return {
        name: {dep for dep in deps if not dep.startswith(prefix + ".")}
        for name, deps in GRAPH.items()
        if name == prefix or name.startswith(prefix + ".")
    }


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles = []

    def walk(node, path):
        for dep in graph[node]:
            if dep in path:
                cycles.append(path[path.index(dep) :] + [dep])
            elif len(path) < len(graph):
                walk(dep, path + [dep])

    for name in graph:
        walk(name, [name])
    return cycles


def test_no_module_of_the_package_or_the_experiments_is_over_400_lines():
    sources = {**MODULES, **EXPERIMENTS}
    long = {name: n for name, path in sources.items() if (n := len(path.read_text().splitlines())) > 400}
    assert not long, f"split these by concept: {long}"


def test_no_import_cycles():
    assert not find_cycles(GRAPH), find_cycles(GRAPH)[:3]


def test_no_import_cycles_even_through_type_hints():
    assert not find_cycles(TYPED_GRAPH), find_cycles(TYPED_GRAPH)[:3]


def test_the_model_imports_nothing_of_the_package_but_its_errors():
    outside = {name: deps - {"moh_dit", "moh_dit.errors"} for name, deps in imports_of("moh_dit.model").items()}
    assert not any(outside.values()), outside


def test_the_objectives_stand_below_training_sampling_and_the_command_line():
    above = ("moh_dit.training", "moh_dit.sampling", "moh_dit.cli", "moh_dit.evaluation", "moh_dit.interop")
    found = {n: {d for d in deps if d.startswith(above)} for n, deps in imports_of("moh_dit.objectives").items()}
    assert not any(found.values()), found


def _named_in_tables() -> dict[str, tuple[set[str], str]]:
    """The names each table gives its entries, and the package (or module) that owns the table: objectives, guidance
    rules, sampling caches and block options (``none``, a value of many things, left out)."""
    from moh_dit.model.block import MLPS, NORMS, QK_NORMS
    from moh_dit.model.execution import PROCESSORS
    from moh_dit.objectives.registry import OBJECTIVES
    from moh_dit.sampling.caches import CACHES
    from moh_dit.sampling.rules import RULES

    return {
        "objective": (set(OBJECTIVES), "moh_dit.objectives"),
        "guidance rule": (set(RULES), "moh_dit.sampling.rules"),
        "sampling cache": (set(CACHES), "moh_dit.sampling.caches"),
        "block option": ({*NORMS, *MLPS, *QK_NORMS} - {"none"}, "moh_dit.model.block"),
        "attention execution": (set(PROCESSORS), "moh_dit.model.execution"),
    }


def branches_on(names: set[str]) -> re.Pattern:
    """A comparison with one of ``names`` as a string: ``x == "flow"``, ``"apg" != rule``, ``rule in ("cfg", ...)``."""
    name = "(" + "|".join(sorted(map(re.escape, names), key=len, reverse=True)) + ")"
    return re.compile(rf"""(==|!=|\bin\b|\bis\b)\s*\(?\s*["']{name}["']|["']{name}["']\s*(==|!=)""")


def test_no_module_branches_on_a_name_outside_the_table_that_owns_it():
    """The trainer, the pipeline, generation, evaluation and the command line ask the objective, the rule, the cache
    or the block's options (one interface each); adding one is a module or a class and a table entry, not a branch in
    each of them. The names come from the tables themselves."""
    found = {}
    for what, (names, home) in _named_in_tables().items():
        pattern = branches_on(names)
        for n, p in MODULES.items():
            if n == home or n.startswith(home + "."):
                continue
            lines = [ln.strip() for ln in p.read_text().splitlines() if pattern.search(ln)]
            if lines:
                found[f"{n} ({what})"] = lines
    assert not found, found


def test_the_branch_check_sees_each_tables_names():
    """The check above would find a branch on a name of each table (``meanflow`` included, which a fixed pattern of
    the first two objectives missed)."""
    for names, _ in _named_in_tables().values():
        pattern = branches_on(names)
        assert all(pattern.search(f'if x == "{name}":') and pattern.search(f'x in ("{name}",)') for name in names)
    assert not branches_on({"flow"}).search('if x == "flowers":')


def test_the_data_layer_imports_nothing_above_it_not_even_for_type_hints():
    above = ("moh_dit.training", "moh_dit.sampling", "moh_dit.cli", "moh_dit.evaluation", "moh_dit.interop")
    found = {
        n: {d for d in deps if d.startswith(above)} for n, deps in TYPED_GRAPH.items() if n.startswith("moh_dit.data")
    }
    assert not any(found.values()), found


def test_sampling_does_not_import_training():
    found = {
        n: {d for d in deps if d.startswith("moh_dit.training")} for n, deps in imports_of("moh_dit.sampling").items()
    }
    assert not any(found.values()), found


def test_nothing_below_the_command_line_parses_arguments_or_imports_it():
    below = {n: p for n, p in MODULES.items() if not n.startswith("moh_dit.cli") and n != "moh_dit.__main__"}
    offenders = {n for n in below if any(d.startswith("moh_dit.cli") for d in GRAPH[n])}
    offenders |= {n for n, p in below.items() if re.search(r"ArgumentParser\(|\.parse_(known_)?args\(", p.read_text())}
    assert not offenders, offenders


def test_no_library_module_runs_as_a_script():
    """One entry path per command: ``moh-dit <command>`` (``python -m moh_dit``) and the top-level scripts."""
    offenders = [
        n for n, p in MODULES.items() if n != "moh_dit.__main__" and re.search(r"^if __name__ ==", p.read_text(), re.M)
    ]
    assert not offenders, offenders


def test_help_answers_without_importing_torch():
    code = (
        "import sys, moh_dit.cli as c, importlib\n"
        "for name in c.COMMANDS: importlib.import_module('moh_dit.cli.' + name).build_parser().format_help()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_no_reference_to_files_outside_the_repository():
    texts = [p for p in ROOT.rglob("*") if p.suffix in (".py", ".md", ".yaml", ".toml") and ".venv" not in p.parts]
    offenders = [str(p.relative_to(ROOT)) for p in texts if "REFERENCE.md" in p.read_text(errors="ignore")]
    assert offenders == [p for p in offenders if p == "tests/test_structure.py"]


def experiments_imports(type_hints: bool = False) -> dict[str, set[str]]:
    """What each module of experiments/ imports of experiments/ (lazy imports count)."""
    found = {}
    for name, path in EXPERIMENTS.items():
        tree = ast.parse(path.read_text())
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("experiments"):
                module = node.module
                deps |= {f"{module}.{a.name}" if f"{module}.{a.name}" in EXPERIMENTS else module for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("experiments.")}
        found[name] = (deps & set(EXPERIMENTS)) - {name}
    return found


# what the studies share; every other module of experiments/ is a study (X) or a study's report (X_report)
SHARED_EXPERIMENTS = {f"experiments.{n}" for n in ("common", "arms", "report", "fmnist_classifier", "fmnist_encoder")}


def study_of(name: str) -> str | None:
    """The study a module of experiments/ belongs to: a study is a module with a ``main``; its parts (its report, its
    arms) are the modules named after it (``distill_report``, ``distill_dmd2``) that are no study themselves."""
    studies = {n for n, p in EXPERIMENTS.items() if re.search(r"^def main\(", p.read_text(), re.M)}
    if name in studies:
        return name
    owners = [s for s in studies if name.startswith(f"{s}_")]
    return max(owners, key=len) if owners else None


def test_no_study_imports_another_and_the_shared_modules_import_no_study():
    """experiments/: studies import the shared modules (and a study its own parts: its report, its arms), never
    another study; the shared modules import no study; no circle."""
    graph = experiments_imports()
    wrong = {}
    for name, deps in graph.items():
        allowed = SHARED_EXPERIMENTS | {"experiments"}  # the package itself: ``from experiments import x``
        study = study_of(name) if name not in SHARED_EXPERIMENTS else None
        if study is not None:  # its own parts
            allowed = allowed | {n for n in EXPERIMENTS if study_of(n) == study and n != study}
        bad = deps - allowed
        if bad:
            wrong[name] = sorted(bad)
    assert not wrong, wrong
    assert not find_cycles(graph), find_cycles(graph)[:3]


def test_the_experiments_run_as_modules_without_a_path_shim():
    """``python -m experiments.X`` from the repository root: no module of experiments/ edits sys.path."""
    offenders = [n for n, p in EXPERIMENTS.items() if "sys.path" in p.read_text()]
    assert not offenders, offenders


def test_the_guide_model_flag_reaches_its_use_through_five_modules():
    """``--guide-model`` to where the guide acts: options.py (the flag, the spec), spec_parts.py (``GuideSpec``),
    pipeline.py (``guide_for`` loads it once, the loop hands it on), guides.py (loads and checks it), guidance.py (its
    prediction). No command, loader or trainer module handles the guide itself."""
    readers = {n for n, p in MODULES.items() if "guide_model" in p.read_text()}
    assert readers <= {"moh_dit.sampling.options", "moh_dit.cli.demo"}, readers
    loaders = {n for n, p in MODULES.items() if re.search(r"\bload_guide\(", p.read_text())}
    # the definition, sampling's one call, and a distillation teacher's own guide
    assert loaders == {"moh_dit.sampling.pipeline", "moh_dit.sampling.guides", "moh_dit.training.distill.teacher"}, (
        loaders
    )
    path = ["options", "spec_parts", "pipeline", "guides", "guidance"]
    assert len(path) <= 5 and all(f"moh_dit.sampling.{m}" in MODULES for m in path)
    assert "moh_dit.sampling.guides" in GRAPH["moh_dit.sampling.pipeline"]
    assert "moh_dit.sampling.guidance" in GRAPH["moh_dit.sampling.pipeline"]
    others = ("cli.sample", "cli.evaluate", "sampling.loading", "sampling.generation", "training.outputs")
    handling = [m for m in others if re.search(r"\bguide\w*\(|attach", MODULES[f"moh_dit.{m}"].read_text())]
    assert not handling, handling


FOLDERS = ("moh_dit.objectives.distill", "moh_dit.training.distill")  # a concept's folder: its public names
# the registry stands below every objective: it reads the method table module itself (the package's classes import it)
THROUGH_THEIR_MODULE = {("moh_dit.objectives.registry", "moh_dit.objectives.distill.methods")}


def test_imports_from_outside_a_concepts_folder_go_through_its_public_names():
    """Outside moh_dit/objectives/distill and moh_dit/training/distill, code imports the folder's names from the
    package (``from moh_dit.objectives.distill import MeanFlowDistill``), not from its modules."""
    found = {}
    for name, deps in GRAPH.items():
        for folder in FOLDERS:
            if name == folder or name.startswith(folder + "."):
                continue
            inner = {d for d in deps if d.startswith(folder + ".") and (name, d) not in THROUGH_THEIR_MODULE}
            if inner:
                found[name] = sorted(inner)
    experiments = {n: p for n, p in EXPERIMENTS.items()}
    for name, path in experiments.items():
        inner = [
            ln.strip()
            for ln in path.read_text().splitlines()
            if re.search(r"moh_dit\.(objectives|training)\.distill\.\w+ import", ln)
        ]
        if inner:
            found[name] = inner
    assert not found, found


def test_each_concept_folder_says_what_it_holds_and_the_order_to_read_it():
    for folder in FOLDERS:
        path = MODULES[folder]
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        holds = {p.name for p in path.parent.glob("*.py") if p.name != "__init__.py"}
        assert "Read it in this order" in doc and all(name in doc for name in holds), (folder, holds)
