"""`python -m nanopaged.serve`: the code is in nanopaged/entrypoints/openai/api_server.py."""
import sys

from .entrypoints.openai.api_server import main

if __name__ == "__main__":
    sys.exit(main())
