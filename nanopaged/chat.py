"""`python -m nanopaged.chat`: the code is in nanopaged/entrypoints/chat.py."""
import sys

from .entrypoints.chat import main

if __name__ == "__main__":
    sys.exit(main())
