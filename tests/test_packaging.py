"""What ``pip install .`` gives: the ``moh-dit`` command with every subcommand, the package data, one version
number. The package is built into a wheel and installed into an empty virtual environment; the test
environment's site-packages are shared with it through a ``.pth`` file for the dependencies only, so the
editable checkout cannot stand in for the installed package."""

import json
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import tomllib

from moh_dit.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("fresh")
    # build from a copy of the sources, so the build leaves nothing in the checkout
    skip = shutil.ignore_patterns(".venv", ".git", "build", "runs", "*.egg-info", "__pycache__", ".pytest_cache")
    shutil.copytree(ROOT, base / "src", ignore=skip)
    wheel_cmd = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w"]
    subprocess.run([*wheel_cmd, str(base / "wheel"), str(base / "src")], check=True, capture_output=True)

    (wheel,) = (base / "wheel").glob("moh_dit-*.whl")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"])
    (purelib / "shared-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--quiet",
                    "--no-deps", str(wheel)], check=True, capture_output=True)  # fmt: skip
    return venv


def run(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(cwd)})  # fmt: skip


def test_the_installed_command_and_its_subcommands(installed, tmp_path):
    version = run(installed, "moh-dit", "--version", cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.strip() == f"moh-dit {_version()}"
    listing = run(installed, "moh-dit", "--help", cwd=tmp_path)
    assert listing.returncode == 0 and all(name in listing.stdout for name in COMMANDS)
    for name in COMMANDS:
        shown = run(installed, "moh-dit", name, "--help", cwd=tmp_path)
        assert shown.returncode == 0 and f"usage: moh-dit {name}" in shown.stdout, shown.stderr
    wrong = run(installed, "moh-dit", "trian", cwd=tmp_path)
    assert wrong.returncode == 2 and "invalid choice" in wrong.stderr


def test_the_installed_package_is_complete(installed, tmp_path):
    code = (
        "import json, moh_dit, moh_dit.model.cost_model as perf\n"
        "from moh_dit import create_model\n"
        "m = create_model('MoH-DiT-Ti/4-50')\n"
        "print(json.dumps({'file': moh_dit.__file__, 'version': moh_dit.__version__,\n"
        "                  'calibrations': sorted(perf.load_calibration()), 'heads': m.head_counts()}))\n"
    )
    out = run(installed, installed / "bin" / "python", "-c", code, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert str(installed) in info["file"] and str(ROOT) not in info["file"]  # the wheel, not the checkout
    assert info["version"] == _version() and {"cpu/infer", "cpu/train"} <= set(info["calibrations"])
    assert info["heads"] == [18, 36]


def _version() -> str:
    """The one version number, and every place that shows it agrees."""
    text = (ROOT / "moh_dit" / "__init__.py").read_text()
    version = re.search(r'__version__ = "([^"]+)"', text).group(1)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"] and pyproject["tool"]["setuptools"]["dynamic"]["version"]
    assert not re.search(r"^version:", (ROOT / "CITATION.cff").read_text(), re.M)
    # the changelog's newest release is this version, or this one is the development version after it
    headings = re.findall(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.M)
    released = next(h for h in headings if h != "Unreleased")
    if headings[0] == "Unreleased":
        assert version.endswith(".dev0") and version > released, (version, released)
    else:
        assert version == released, (version, released)
    return version


def test_license_and_citation():
    assert "Apache License" in (ROOT / "LICENSE").read_text().splitlines()[0]
    assert "Version 2.0" in (ROOT / "LICENSE").read_text()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["license"]["text"] == "Apache-2.0"
    citation = (ROOT / "CITATION.cff").read_text()
    assert "arXiv:2410.11842" in citation and "arXiv:2212.09748" in citation and "license: Apache-2.0" in citation
