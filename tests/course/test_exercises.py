"""The course's exercises (python -m nanopaged.exercise; nanopaged/exercises/): every
checker can fail and can pass. For each exercise the untouched stub fails its check
and the reference solution (the engine's own code) passes it, in this process, the way
`check` runs them. Plus the command line, once, as a student meets it."""
import os
import subprocess
import sys

import pytest

from nanopaged.exercises.runner import exercise_file, reference_source, run_checks, stub_source
from nanopaged.exercises import SWAPS, all_exercises

EXERCISES = all_exercises()


def test_there_is_an_exercise_per_chapter():
    from pathlib import Path
    chapters = sorted(p.name for p in (Path(__file__).resolve().parents[2] / "chapters").glob("[0-9][0-9]-*.md"))
    assert sorted(ex.CHAPTER for ex in EXERCISES.values()) == chapters


def test_the_targets_of_an_exercise_have_distinct_names():
    # the student's file defines each target by its bare name (Class.forward -> forward)
    for number, ex in EXERCISES.items():
        names = [t.rsplit(".", 1)[-1].split(":")[-1] for t in ex.TARGETS]
        assert len(set(names)) == len(names), f"exercise {number}: two targets named alike in {ex.TARGETS}"


@pytest.mark.parametrize("number", list(EXERCISES))
def test_the_stub_fails_and_the_reference_passes(number, tmp_path):
    ex = EXERCISES[number]
    path = exercise_file(ex, tmp_path)
    path.write_text(stub_source(ex))
    stub = run_checks(ex, path)
    assert stub and all(why is not None for _, why in stub), f"the stub passes {[w for w, y in stub if y is None]}"
    assert not SWAPS                                    # the engine's own functions are back
    if ex.TARGETS:
        path.write_text(reference_source(ex))
    else:                                               # a prediction: the engine's own answers
        path.write_text("\n".join(f"{k}: {v}" for k, v in ex.run_engine().items()))
    reference = run_checks(ex, path)
    assert all(why is None for _, why in reference), [(w, y) for w, y in reference if y is not None]
    assert not SWAPS


def test_the_command_line_start_check_hint_reset(tmp_path, capsys):
    """The commands that run checks or print a list go through `python -m` (exit status,
    what comes first, logging, a pipe); the ones that only move files call main() in
    this process (the same code; a process each cost ~5 s of imports)."""
    from nanopaged.exercises.runner import main
    scratch = tmp_path / "tmp"                  # the checks' TMPDIR: their tiny model goes there
    scratch.mkdir()

    def run(*args, process=True):
        if not process:
            code = main([*args, "--dir", str(tmp_path)])
            captured = capsys.readouterr()
            return code, captured.out + captured.err
        proc = subprocess.run([sys.executable, "-m", "nanopaged.exercise", *args, "--dir", str(tmp_path)],
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "TMPDIR": str(scratch)})
        return proc.returncode, proc.stdout + proc.stderr

    code, out = run("list")
    assert code == 0 and "BlockTable" in out and "not started" in out
    columns = {line.index("chapters/") for line in out.splitlines()}
    assert len(columns) == 1, "the chapters column is not aligned: " + out
    code, out = run("start", "1", process=False)
    assert code == 0 and (tmp_path / "ex01_block_table.py").exists()
    # every command it suggests names the folder the files are in
    assert f"`python -m nanopaged.exercise --dir {tmp_path} check 1`" in out, out
    assert f"python -m nanopaged.exercise --dir {tmp_path} check 1" in (tmp_path / "ex01_block_table.py").read_text()
    code, out = run("check", "1")
    assert code == 1 and out.startswith("FAIL"), out                     # nothing printed before it
    assert "not written yet" in out and "0 of 4 checks pass" in out
    (tmp_path / "ex01_block_table.py").write_text(reference_source(EXERCISES[1]).replace(
        "return [ids[p // bs] * bs + p % bs for p in range(start, end)]",
        "return [ids[p // bs] * bs + p % bs for p in range(start, end + 1)]"))       # one too many
    code, out = run("check", "1")
    assert code == 1 and "3 of 4 checks pass" in out and "positions 0..10" in out
    code, out = run("hint", "1")
    assert code == 0 and "block_size" in out
    assert "INFO" not in out, out                   # the checks' engines start quietly
    code, out = run("reset", "1", process=False)
    assert code == 0 and (tmp_path / "ex01_block_table.py.bak").exists()
    assert "NotImplementedError" in (tmp_path / "ex01_block_table.py").read_text()
    (tmp_path / "ex01_block_table.py.bak").unlink()
    code, out = run("reset", "1", process=False)   # an untouched stub: nothing worth a .bak
    assert code == 0 and not (tmp_path / "ex01_block_table.py.bak").exists(), out
    code, out = run("start", process=False)
    assert code == 1 and "`start` needs an exercise number (0 to 22)" in out, out
    piped = subprocess.run(f"{sys.executable} -m nanopaged.exercise list | head -1", shell=True,
                           capture_output=True, text=True, timeout=120)
    assert piped.stdout.count("\n") == 1 and "Traceback" not in piped.stderr, piped.stderr
    code, out = run("check", "2")
    assert code == 1 and f"run `python -m nanopaged.exercise --dir {tmp_path} start 2` first" in out
    assert list(scratch.glob("nanopaged-*")) == [], "a check left its tiny model folder behind"
    code, out = run("check", "99", process=False)
    assert code == 1 and "exercise number must be one of" in out


def test_list_says_passed_for_the_file_whose_check_passed(tmp_path, capsys):
    """`list` says `passed` once `check` passes, for as long as the file is that version:
    an edit makes it `started` until the next check, and a failing check forgets it."""
    import logging
    import re
    from nanopaged.exercises.runner import main

    def command(*args):
        code = main([*args, "--dir", str(tmp_path)])
        return code, capsys.readouterr().out

    def listed(number):
        code, out = command("list")
        rows = dict(re.match(r"\s*(\d+)  (not started|started|passed)  ", line).groups()
                    for line in out.splitlines())     # "  1  not started  BlockTable: ..."
        return rows[str(number)]

    level = logging.getLogger("nanopaged").level          # main quiets the checks' engines
    try:
        assert listed(1) == "not started"
        assert command("start", "1")[0] == 0 and listed(1) == "started"
        path = tmp_path / "ex01_block_table.py"
        path.write_text(reference_source(EXERCISES[1]))
        code, out = command("check", "1")
        assert code == 0 and "4 of 4 checks pass: done!" in out, out
        assert listed(1) == "passed" and listed(2) == "not started"
        path.write_text(path.read_text() + "# an edit\n")
        assert listed(1) == "started"
        assert command("check", "1")[0] == 0 and listed(1) == "passed"
        path.write_text(path.read_text().replace("range(start, end)", "range(start, end + 1)"))
        assert command("check", "1")[0] == 1
        path.write_text(path.read_text().replace("range(start, end + 1)", "range(start, end)"))
        assert listed(1) == "started"             # the failing check forgot the pass
    finally:
        logging.getLogger("nanopaged").setLevel(level)


def test_main_leaves_the_logging_level_as_it_found_it(tmp_path, capsys):
    """The CLI quiets nanopaged's logger while it runs; called in a process that goes on
    (a test worker), it puts the level back (a later test's caplog once saw no INFO)."""
    import logging
    from nanopaged.exercises.runner import main
    logger = logging.getLogger("nanopaged")
    before = logger.level
    try:
        logger.setLevel(logging.INFO)
        assert main(["list", "--dir", str(tmp_path)]) == 0
        assert logger.level == logging.INFO
    finally:
        logger.setLevel(before)


@pytest.mark.parametrize("slip,replace,says", [
    ("nibbles interleaved", ("q = torch.cat((nibbles & 0xF, nibbles >> 4), dim=-1)",
                             "q = torch.stack((nibbles & 0xF, nibbles >> 4), dim=-1).reshape(n, -1, 32)"),
     "weight i + 16 in its HIGH nibble"),
    ("nibble halves swapped", ("q = torch.cat((nibbles & 0xF, nibbles >> 4), dim=-1)",
                               "q = torch.cat((nibbles >> 4, nibbles & 0xF), dim=-1)"),
     "The halves are swapped"),
    ("m forgotten", ("return (q.float() * d + m).reshape(n, -1)", "return (q.float() * d).reshape(n, -1)"),
     "without the block's minimum: add m"),
])
def test_q4_1_dequantizer_slips_fail_every_check_and_say_why(slip, replace, says, tmp_path):
    """Exercise 21: the two usual slips of a Q4_1 dequantizer fail the bit-for-bit checks
    with a message naming the slip, and the engine check with the tokens it produced."""
    ex = EXERCISES[21]
    path = exercise_file(ex, tmp_path)
    wrong = reference_source(ex).replace(*replace)
    assert wrong != reference_source(ex)
    path.write_text(wrong)
    results = run_checks(ex, path)
    assert all(why is not None for _, why in results), (slip, results)
    *unit, (_, engine) = results
    assert all(says in why for _, why in unit), (slip, unit)
    assert "with your dequantizer the model says" in engine and "with the engine's ' Paris" in engine, engine
