"""`python -m nanopaged.exercise`: the code is in nanopaged/entrypoints/exercise.py."""
import sys

from .entrypoints.exercise import main

if __name__ == "__main__":
    sys.exit(main())
