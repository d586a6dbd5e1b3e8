"""`python -m nanopaged.trace`: the code is in nanopaged/trace/cli.py."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
