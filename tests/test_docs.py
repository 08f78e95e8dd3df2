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


DURATION = re.compile(
    r"\b\d+(?:\.\d+)?(?:\s*(?:-|to)\s*\d+(?:\.\d+)?)?\s*(?:minutes?|hours?|seconds?|days?|min)\b", re.I
)
HARDWARE = re.compile(r"\b(?:CPUs?|GPUs?|H100s?|A100s?|H200s?|cores?)\b")
BACKED = re.compile(r"measured|estimate|projected|\btook\b|benchmarks/results|\bran\b|\bwall\b", re.I)


def time_claims(text: str) -> list[str]:
    """The sentences (and table rows) of ``text`` that state a time on some hardware."""
    found = []
    for para in re.split(r"\n\s*\n", text):
        rows = [ln for ln in para.splitlines() if ln.lstrip().startswith("|")]
        prose = " ".join(ln for ln in para.splitlines() if not ln.lstrip().startswith("|"))
        for sentence in [*rows, *re.split(r"(?<=[.!?])\s+(?=[A-Z(`])", " ".join(prose.split()))]:
            if DURATION.search(sentence) and HARDWARE.search(sentence):
                found.append(sentence)
    return found


def test_every_time_on_some_hardware_says_whether_it_was_measured_or_estimated():
    """A time a reader plans by ("about 1-2 minutes on 8 H100s") says it was measured (or took, ran, is in
    benchmarks/results) or is an estimate (with how it was made)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    texts = {p: p.read_text() for p in pages}
    for config in sorted((ROOT / "configs").rglob("*.yaml")):  # the comments
        texts[config] = "\n".join(ln.split("#", 1)[1] for ln in config.read_text().splitlines() if "#" in ln)
    unbacked = [
        f"{p.relative_to(ROOT)}: {s[:160]}" for p, t in texts.items() for s in time_claims(t) if not BACKED.search(s)
    ]
    assert not unbacked, unbacked
    assert time_claims("It takes about 1-2 minutes on 8 H100s per point.") and not time_claims("Sampling: 5 minutes.")
