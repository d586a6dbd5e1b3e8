"""`python -m nanopaged.serve`: the code is in nanopaged/entrypoints/openai/api_server.py.
Here its main is wrapped so that `--help | head` ends quietly (utils/cli.py)."""
import sys

from .entrypoints.openai.api_server import main as _main
from .utils.cli import quiet_broken_pipe

main = quiet_broken_pipe(_main)

if __name__ == "__main__":
    sys.exit(main())
