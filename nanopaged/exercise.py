"""`python -m nanopaged.exercise`: the code is in nanopaged/exercises/runner.py."""
import sys

from .exercises.runner import main

if __name__ == "__main__":
    sys.exit(main())
