"""`pip install .` (not editable) ships every package and the kernel sources: the wheel
carries each package that setup.py finds (a hand-kept list once left out
nanopaged.exercises, so `python -m nanopaged.exercise` failed after a wheel install) and
kernels/ as nanopaged/_kernels/ (pyproject.toml; every source and header, in every
folder), and the dashboard page's files
(nanopaged/dashboard/page/, package data), and the course's chapters/ as
nanopaged/_chapters/ with their figures; an installed nanopaged finds them there, runs
the course's exercise runner (whose `start` names a chapter that is on disk) and the
tracer (and its replay export) from outside the checkout.

The wheel is built from a copy of the repository in tmp_path, so no build/ or
*.egg-info lands in the checkout; without build isolation (offline, a few seconds)."""
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# every kernel source and header of the checkout, in every folder of kernels/
SOURCES = sorted(str(p.relative_to(ROOT / "kernels")) for p in (ROOT / "kernels").rglob("*")
                 if p.suffix in (".cpp", ".h", ".cu"))


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The wheel built from a copy of the checkout, installed into a scratch folder:
    (the folder to put on PYTHONPATH, the wheel's file names)."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    repo, wheels, target = tmp_path / "repo", tmp_path / "wheels", tmp_path / "site"
    repo.mkdir()
    shutil.copy(ROOT / "pyproject.toml", repo)
    shutil.copy(ROOT / "setup.py", repo)
    shutil.copy(ROOT / "README.md", repo)
    for folder in ("nanopaged", "kernels", "chapters"):
        shutil.copytree(ROOT / folder, repo / folder, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]
    subprocess.run([*pip, "wheel", ".", "--no-deps", "--no-build-isolation", "-w", str(wheels)],
                   cwd=repo, check=True, timeout=150)
    (wheel,) = wheels.glob("nanopaged-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, timeout=150)
    return target, zipfile.ZipFile(wheel).namelist()


def run_installed(target, args, cwd, timeout=150):
    """python args, importing nanopaged from the scratch install only (cwd is outside the
    checkout, so the checkout's nanopaged/ is not on the path)."""
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(target)), timeout=timeout)


def test_the_wheel_carries_every_package_of_the_checkout(installed):
    _, names = installed
    packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "nanopaged").rglob("__init__.py")}
    assert packages and all(f"{p}/__init__.py" in names for p in packages), sorted(packages - {
        n.rsplit("/", 1)[0] for n in names})
    assert len(SOURCES) > 10 and all(f"nanopaged/_kernels/{s}" in names for s in SOURCES), sorted(
        set(SOURCES) - {n.removeprefix("nanopaged/_kernels/") for n in names})
    page = {f"nanopaged/dashboard/page/{f}" for f in ("index.html", "dashboard.js", "dashboard.css")}
    assert page <= set(names), sorted(page - set(names))
    chapters = {f"nanopaged/_chapters/{p.relative_to(ROOT / 'chapters')}" for p in (ROOT / "chapters").rglob("*")
                if p.is_file()}
    assert chapters and chapters <= set(names), sorted(chapters - set(names))


@pytest.mark.timeout(180)
def test_an_installed_wheel_carries_and_finds_the_kernel_sources(installed, tmp_path):
    target, _ = installed
    check = ("import nanopaged.layers.build as k, nanopaged.quantization.kernels as q; print(k.KERNELS_DIR); "
             "print(all((k.KERNELS_DIR / s).is_file() for s in [*q.SOURCES, *(s for g in k.KERNEL_SOURCES.values() "
             "for s in g)]))")
    out = run_installed(target, ["-c", check], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    kernels_dir, found = out.stdout.split()
    assert Path(kernels_dir) == target / "nanopaged" / "_kernels" and found == "True"


@pytest.mark.timeout(180)
def test_an_installed_wheel_runs_the_exercises_and_the_tracer(installed, tmp_path, tiny_model_dir):
    target, _ = installed
    listed = run_installed(target, ["-m", "nanopaged.exercise", "list"], cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert "ex12" in listed.stdout or "12" in listed.stdout, listed.stdout
    started = run_installed(target, ["-m", "nanopaged.exercise", "start", "2"], cwd=tmp_path)
    assert started.returncode == 0, started.stderr
    [chapter] = re.findall(r"Read (\S+), fill it in", started.stdout)       # the chapter, on disk
    assert Path(chapter) == target / "nanopaged" / "_chapters" / "02-block-manager.md", started.stdout
    assert Path(chapter).read_text() == (ROOT / "chapters" / "02-block-manager.md").read_text()
    assert str(Path(chapter)) in run_installed(target, ["-m", "nanopaged.exercise", "list"], cwd=tmp_path).stdout
    where = run_installed(target, ["-c", "import nanopaged.exercises, nanopaged.trace.cli as c; print(c.__file__)"],
                          cwd=tmp_path)
    assert Path(where.stdout.strip()).is_relative_to(target), where
    traced = run_installed(target, ["-m", "nanopaged.trace", "--model", str(tiny_model_dir), "--scenario", "cow",
                                    "--no-pause"], cwd=tmp_path)
    assert traced.returncode == 0, traced.stderr
    assert "copy-on-write" in traced.stdout.lower() or "cow" in traced.stdout.lower(), traced.stdout[-2000:]
    page = tmp_path / "cow.html"                 # the replay page inlines the wheel's dashboard files
    exported = run_installed(target, ["-m", "nanopaged.trace", "--model", str(tiny_model_dir), "--scenario", "cow",
                                      "--no-pause", "--export", str(page)], cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert "window.NANOPAGED_REPLAY = [" in page.read_text()
