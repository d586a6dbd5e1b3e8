"""The tracer: `python -m nanopaged.trace` runs the real engine and draws every step's
decisions and block tables (cli.py: the command line; view.py: the drawing, with rich;
scenarios.py: the paper's figures as real runs). Chapter 13.
"""


def main(argv: list[str] | None = None) -> int:
    """`python -m nanopaged.trace` (and the `nanopaged-trace` script): see cli.py."""
    from .cli import main as cli_main
    return cli_main(argv)
