"""Helpers below every layer: child-process plumbing (proc.py) and where nanopaged keeps
its files (paths.py). They import nothing else of nanopaged."""
