"""The docs keep up with the code: docs/architecture.md names every module of the package and no other, the
README stays a front door, and every relative link in the docs leads to a file that exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_architecture_table_names_every_module_and_no_other():
    table = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"^\| `([\w/]+\.py)` \|", table, re.M))
    package = ROOT / "moh_dit"
    present = {p.relative_to(package).as_posix() for p in package.rglob("*.py") if "__pycache__" not in p.parts}
    assert not named - present, f"docs/architecture.md names modules that do not exist: {sorted(named - present)}"
    assert not present - named, f"docs/architecture.md misses modules: {sorted(present - named)}"


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 180, f"README.md has {len(lines)} lines; move detail into docs/"
    first = "\n".join(lines[:40])
    assert re.search(r"!\[[^\]]*\]\([^)]+\.png\)", first), "the picture belongs in the first 40 lines"
    assert "bash scripts/setup.sh && .venv/bin/python train.py" in first, "the main job's command, in the first 40"
    assert "bash scripts/setup.sh && .venv/bin/ruff check ." in first, "the test command, in the first 40"


def test_the_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    command = next(ln for ln in readme.splitlines() if ln.startswith("bash scripts/setup.sh && .venv/bin/ruff"))
    assert command in (ROOT / ".ci" / "run").read_text()


def test_relative_links_in_the_docs_lead_somewhere():
    broken = []
    for page in [ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith(("http://", "https://", "mailto:")) and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken
