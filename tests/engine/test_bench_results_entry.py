"""bench.py's `--results-entry` (benchmarks/results.py): a run printed as an entry of
benchmarks/RESULTS.md, with the date, the machine, dtype and threads, the exact command,
the tables the sections printed and the rest of their output, so adding an entry is a
paste."""
from datetime import datetime, timezone

from benchmarks.results import PARAGRAPH, markdown_table, recorded_run, results_entry

OUTPUT = """quant: a 2-core CPU; 2 threads each
  | configuration | batch 1 (ms/token) |
  |---|---|
  | nanopaged gguf (as shipped) | 7.5 |
  read bandwidth: 33.9 GB/s
| section | result |
|---|---|
| prefix | 93.3% fewer tokens |
"""


def test_an_entry_has_the_date_machine_dtype_threads_command_tables_and_output():
    entry = results_entry("the default model on an AVX2 CPU", OUTPUT, machine="AMD EPYC, 2 cores",
                          flags="torch CPU capability AVX2, flags: avx2", dtype="float32", threads=2,
                          command="python bench.py --sections quant --results-entry", revision="abc1234",
                          now=datetime(2026, 12, 8, 21, 21, tzinfo=timezone.utc))
    lines = entry.splitlines()
    assert lines[0] == "## 2026-12-08: the default model on an AVX2 CPU"
    assert lines[2] == ("- **Machine:** AMD EPYC, 2 cores; torch CPU capability AVX2, flags: avx2; "
                        "dtype float32; 2 torch threads.")
    assert lines[3] == ("- **Command:** `python bench.py --sections quant --results-entry` "
                        "(21:21 UTC, commit abc1234).")
    # the two tables, unindented, a blank line between them; the other lines as printed
    table = lines.index("| configuration | batch 1 (ms/token) |")
    assert lines[table:table + 7] == ["| configuration | batch 1 (ms/token) |", "|---|---|",
                                      "| nanopaged gguf (as shipped) | 7.5 |", "",
                                      "| section | result |", "|---|---|", "| prefix | 93.3% fewer tokens |"]
    text = lines.index("```text")
    assert lines[text + 1:text + 4] == ["quant: a 2-core CPU; 2 threads each", "  read bandwidth: 33.9 GB/s", "```"]
    assert table < text and lines[-1] == PARAGRAPH


def test_markdown_table_writes_header_rule_and_rows():
    assert markdown_table(["a", "b"], [[1, "x"]]) == "| a | b |\n|---|---|\n| 1 | x |"


def test_a_recorded_run_prints_as_usual_then_the_entry(capsys):
    with recorded_run("a title", "bfloat16"):
        print("| run | tok/s |\n|---|---|\n| 1 | 9.9 |")
        print("a section's line")
    out = capsys.readouterr().out
    printed, entry = out.split("\n## ", 1)
    assert printed == "| run | tok/s |\n|---|---|\n| 1 | 9.9 |\na section's line\n"
    assert entry.split("\n", 1)[0].endswith(": a title")
    assert "dtype bfloat16;" in entry and "torch thread" in entry and "`python bench.py" in entry
    assert "| 1 | 9.9 |" in entry and "```text\na section's line\n```" in entry
