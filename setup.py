"""The package list, found rather than kept by hand (the rest is in pyproject.toml).

find_packages sees every package under nanopaged/; nanopaged._kernels is the
repository's kernels/ folder mapped into the package (pyproject.toml's package-dir), so
a wheel carries the kernel sources, and no search can find a mapped folder.
"""
from setuptools import find_packages, setup

setup(packages=find_packages(include=["nanopaged", "nanopaged.*"]) + ["nanopaged._kernels"])
