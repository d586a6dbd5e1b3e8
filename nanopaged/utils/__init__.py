"""Helpers below every layer: child-process plumbing (proc.py), where nanopaged keeps
its files (paths.py) and the value checks every layer repeats (checks.py: an int that is
not a bool, a finite number, the ValueError naming the field). They import nothing else
of nanopaged."""
