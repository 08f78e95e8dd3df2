"""The package's structure: no import cycles between its modules (lazy imports inside functions count), the
command modules answer --help without torch, and nothing refers to files outside the repository."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "moh_dit"


def module_imports(path: Path) -> set[str]:
    """moh_dit modules imported anywhere in ``path``, except under ``if TYPE_CHECKING`` and ``if __name__ ==
    "__main__"`` (which never run on import)."""
    found: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            test = ast.unparse(node.test)
            if "TYPE_CHECKING" in test or "__name__" in test:
                self.generic_visit(ast.Module(body=node.orelse, type_ignores=[]))
                return
            self.generic_visit(node)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.level == 1:
                found.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
            elif node.module and node.module.startswith("moh_dit."):
                found.add(node.module.split(".")[1])

    Visitor().visit(ast.parse(path.read_text()))
    return found


def test_no_import_cycles():
    modules = {p.stem: p for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__")}
    graph = {name: module_imports(path) & set(modules) - {name} for name, path in modules.items()}
    cycles = []

    def walk(node, path):
        for dep in graph[node]:
            if dep in path:
                cycles.append(path[path.index(dep) :] + [dep])
            elif len(path) < len(graph):
                walk(dep, path + [dep])

    for name in graph:
        walk(name, [name])
    assert not cycles, cycles[:3]


def test_help_answers_without_importing_torch():
    code = (
        "import sys, moh_dit.commands as c, importlib\n"
        "for name in c.COMMANDS: importlib.import_module('moh_dit.commands.' + name).build_parser().format_help()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_no_reference_to_files_outside_the_repository():
    texts = [p for p in ROOT.rglob("*") if p.suffix in (".py", ".md", ".yaml", ".toml") and ".venv" not in p.parts]
    offenders = [str(p.relative_to(ROOT)) for p in texts if "REFERENCE.md" in p.read_text(errors="ignore")]
    assert offenders == [p for p in offenders if p == "tests/test_structure.py"]
