"""`python -m nanopaged.serve`: the code is in nanopaged/entrypoints/serve.py."""
import sys

from .entrypoints.serve import main

if __name__ == "__main__":
    sys.exit(main())
