"""`python -m nanopaged.trace`: the code is in nanopaged/entrypoints/trace.py."""
import sys

from .entrypoints.trace import main

if __name__ == "__main__":
    sys.exit(main())
