"""The door to nanopaged's benchmarks: `python bench.py --help` lists the sections and
their flags. The code is in benchmarks/: driver.py parses the flags and runs the sections
asked for, each in the module of its name (benchmarks/__init__.py lists them)."""
from benchmarks.driver import main

if __name__ == "__main__":
    main()
