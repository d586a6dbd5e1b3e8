"""The package list, found rather than kept by hand (the rest is in pyproject.toml).

find_packages sees every package under nanopaged/; nanopaged._kernels and
nanopaged._chapters are the repository's kernels/ and chapters/ folders mapped into the
package (pyproject.toml's package-dir), so a wheel carries the kernel sources and the
course's chapters, and no search can find a mapped folder.
"""
from setuptools import find_packages, setup

setup(packages=find_packages(include=["nanopaged", "nanopaged.*"]) + ["nanopaged._kernels", "nanopaged._chapters"])
