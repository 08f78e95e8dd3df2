"""The docs keep up with the code: docs/architecture.md names every module of the package and no other, the
README stays a front door, and every relative link in the docs leads to a file that exists."""

import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC_PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]  # the pages linked


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


def test_the_readme_says_once_where_a_newcomer_starts_that_the_commands_run_in_the_set_ups_environment():
    """With the system's python, `python sample.py ...` failed with "No module named 'PIL'" and `moh-dit` was not
    found: the set-up section says to activate .venv (or call its programs by path) before any other command."""
    text = (ROOT / "README.md").read_text()
    setup = text[text.index("## Set-up") : text.index("## ImageNet 256")]
    assert "source .venv/bin/activate" in setup and ".venv/bin/moh-dit" in setup


def test_the_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    command = next(ln for ln in readme.splitlines() if ln.startswith("bash scripts/setup.sh && .venv/bin/ruff"))
    assert command in (ROOT / ".ci" / "run").read_text()


def test_relative_links_in_the_docs_lead_somewhere():
    broken = []
    for page in DOC_PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith(("http://", "https://", "mailto:")) and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


@functools.cache  # read once per page, not once per link to it
def heading_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives ``page``'s headings (lower case, punctuation dropped, spaces to hyphens, a repeated
    heading numbered from -1), code blocks left out."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    seen, found = {}, set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        base = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return found


def test_heading_anchors_follow_githubs_rule():
    page = ROOT / "docs" / "results.md"
    assert (
        "the-gan-term-switched-on-late-with-the-real-score-unguided-the-flow-twin-at-seed-0-the-default-at-seeds-1-and-2"
        in heading_anchors(page)
    )
    assert "what-is-left" not in heading_anchors(page) and "at-a-glance" in heading_anchors(page)


def test_links_to_a_section_name_a_heading_there():
    """A section renamed leaves links to its old anchor leading to the top of the page: each is named here."""
    broken = []
    for page in DOC_PAGES:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", page.read_text()):
            dest = page if not target else page.parent / target
            if dest.suffix == ".md" and dest.exists() and anchor not in heading_anchors(dest):
                broken.append(f"{page.relative_to(ROOT)} -> {target}#{anchor}")
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


# the extension points docs/development.md walks through, and what each must name
EXTENSION_POINTS = {
    "Add an objective": ["moh_dit/objectives/registry.py", "OBJECTIVES"],
    "Add a block option": ["moh_dit/model/block.py", "NORMS"],
    "Add a guidance rule": ["moh_dit/sampling/rules.py", "RULES", "GuidanceRule"],
    "Add a cache": ["moh_dit/sampling/caches.py", "CACHES", "SamplingCache"],
    "Add an attention execution": ["moh_dit/model/execution.py", "PROCESSORS"],
    "Add a model beside the student": [
        "moh_dit/training/frozen.py",
        "moh_dit/training/frozen_roles.py",
        "FROZEN_MODELS",
    ],
    "Add a sampler option": ["moh_dit/sampling/spec_parts.py", "FIELDS", "CONFIG_KEYS"],
}


def test_the_development_guide_walks_every_extension_point_through_files_that_exist():
    """Each extension point has its section; every file, class, table and function a section names in backticks
    exists where it says (a guide that describes code that moved fails here)."""
    guide = (ROOT / "docs" / "development.md").read_text()
    sections = dict(re.findall(r"^## (.+?)\n(.*?)(?=^## |\Z)", guide, re.M | re.S))
    missing = [point for point in EXTENSION_POINTS if point not in sections]
    assert not missing, f"docs/development.md has no section {missing}"
    wrong = []
    for point, named in EXTENSION_POINTS.items():
        text = sections[point]
        wrong += [f"{point}: does not name {n}" for n in named if f"`{n}`" not in text and n not in text]
    for title, text in sections.items():
        files = re.findall(r"`((?:moh_dit|tests|benchmarks|experiments)/[\w/]+\.py)`", text)
        wrong += [f"{title}: {f} does not exist" for f in files if not (ROOT / f).is_file()]
        if title not in EXTENSION_POINTS:
            continue
        # classes, tables and functions it names (`GuidanceRule`, `RULES`, `check_sampling`, `MoHDiTPipeline.denoise`)
        names = re.findall(r"`(?:\w+\.)?([A-Z]\w*[a-z]\w*|[A-Z][A-Z_]+|[a-z]+_[a-z_]+)(?:\([^`]*\))?`", text)
        names = [n for n in dict.fromkeys(names) if n not in ("None", "True", "False")]
        wrong += [f"{title}: {name} is defined nowhere" for name in names if not _defined_anywhere(name)]
    assert not wrong, wrong


def _defined_anywhere(name: str) -> bool:
    """Whether ``name`` is defined (a def, a class or an assignment) in the package or the tests."""
    pattern = re.compile(rf"^\s*(def|class)\s+{name}\b|^\s*{name}\s*[:=]", re.M)
    return any(pattern.search(p.read_text()) for d in ("moh_dit", "tests") for p in (ROOT / d).rglob("*.py"))


def test_the_python_examples_sample_their_model_with_a_sampler_of_its_objective():
    """A Python block that loads `runs/fmnist` (these docs' name for the embedded default, DDPM) names one of DDPM's
    samplers (it showed "euler", a flow sampler: a ConfigError traceback for a reader who ran it)."""
    from moh_dit.objectives.registry import OBJECTIVES

    for page in sorted((ROOT / "docs").rglob("*.md")):
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S):
            if 'load_pipeline("runs/fmnist")' in block:
                for sampler in re.findall(r'SamplingSpec\.create\("([\w-]+)"', block):
                    assert sampler in OBJECTIVES["ddpm"].samplers, (page.name, sampler)


def test_the_commands_page_lists_every_command():
    from moh_dit.cli import COMMANDS

    lines = (ROOT / "docs" / "commands.md").read_text().splitlines()
    listed = {line.split("`")[1].removeprefix("moh-dit ") for line in lines if line.startswith("| `moh-dit ")}
    assert listed == set(COMMANDS)


def test_the_distill_keys_documented_with_their_defaults_have_the_codes_defaults():
    """docs/objective.md's tables of distill keys give a key's default as the config section has it (the rows of one
    key and one value; ``distill.head`` said ``teacher`` where the code says ``velocity``)."""
    import dataclasses
    import re

    from moh_dit.training.config_sections import DistillSection

    defaults = {f.name: f.default for f in dataclasses.fields(DistillSection)}
    words = {None: "null", True: "true", False: "false"}
    text = (ROOT / "docs" / "objective.md").read_text()
    rows = re.findall(r"^\| `distill\.(\w+)` \| `?([^|`,]+?)`? \|", text, flags=re.M)
    checked = 0
    for key, shown in rows:
        value = defaults[key]
        if shown.startswith("(") or isinstance(value, tuple):
            continue
        expected = words[value] if value is None or isinstance(value, bool) else value
        assert shown == str(expected) or (isinstance(value, float) and float(shown) == value), (key, shown, value)
        checked += 1
    assert checked >= 10 and ("head", "velocity") in rows
