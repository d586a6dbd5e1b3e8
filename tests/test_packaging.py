"""`pip install .` (not editable) ships the kernel sources: the wheel carries kernels/ as
nanopaged/_kernels/ (pyproject.toml), and an installed nanopaged finds them there.

The wheel is built from a copy of the repository in tmp_path, so no build/ or
*.egg-info lands in the checkout; without build isolation (offline, a few seconds)."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["paged_attention_cpu.cpp", "paged_attention.cu", "dev/paged_attention_cpu_dev.cpp"]


@pytest.mark.timeout(180)
def test_an_installed_wheel_carries_and_finds_the_kernel_sources(tmp_path):
    repo, wheels, target = tmp_path / "repo", tmp_path / "wheels", tmp_path / "site"
    repo.mkdir()
    shutil.copy(ROOT / "pyproject.toml", repo)
    shutil.copy(ROOT / "README.md", repo)
    for folder in ("nanopaged", "kernels"):
        shutil.copytree(ROOT / folder, repo / folder, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]
    subprocess.run([*pip, "wheel", ".", "--no-deps", "--no-build-isolation", "-w", str(wheels)],
                   cwd=repo, check=True, timeout=150)
    (wheel,) = wheels.glob("nanopaged-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert all(f"nanopaged/_kernels/{s}" in names for s in SOURCES), sorted(names)

    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, timeout=150)
    check = ("import nanopaged.worker.kernels as k; "
             "print(k.KERNELS_DIR); print(all((k.KERNELS_DIR / s).is_file() for s in k.KERNEL_SOURCES.values()))")
    out = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(target)), timeout=150)
    assert out.returncode == 0, out.stderr
    kernels_dir, found = out.stdout.split()
    assert Path(kernels_dir) == target / "nanopaged" / "_kernels" and found == "True"
