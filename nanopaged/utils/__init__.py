"""Helpers below every layer: child-process plumbing (proc.py), where nanopaged keeps
its files (paths.py), the value checks every layer repeats (checks.py: an int that is
not a bool, a finite number, the ValueError naming the field) and ceiling division
(math_utils.py: cdiv). They import nothing else of nanopaged."""
