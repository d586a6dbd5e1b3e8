"""One flag vocabulary for every door: chat, serve and trace take the engine's options
under the same names (vLLM's), declared once in engine/arg_utils.py."""
from __future__ import annotations

import dataclasses
import json

import pytest

from nanopaged.config import EngineConfig
from nanopaged.engine.arg_utils import ENGINE_FLAGS, engine_kwargs
from nanopaged.entrypoints.chat import make_arg_parser as chat_parser
from nanopaged.entrypoints.openai.cli_args import make_arg_parser as serve_parser
from nanopaged.trace.cli import make_arg_parser as trace_parser

DOORS = {"chat": chat_parser, "serve": serve_parser, "trace": trace_parser}
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 2})


def _engine_flags(parser) -> set[str]:
    group = next(g for g in parser._action_groups if g.title == "engine")
    return {s for a in group._group_actions for s in a.option_strings}


def test_every_engine_config_field_has_one_flag_with_its_own_help():
    assert list(ENGINE_FLAGS) == [f.name for f in EngineConfig.flat_fields()]
    assert all(len(text) > 20 for _, _, text in ENGINE_FLAGS.values())


def test_chat_serve_and_trace_take_the_same_engine_flags():
    flags = {door: _engine_flags(make()) for door, make in DOORS.items()}
    assert flags["chat"] == flags["serve"] == flags["trace"]
    assert {"--model", "--dtype", "--block-size", "--max-model-len", "--num-gpu-blocks", "--speculative-config",
            "--tensor-parallel-size", "--async-scheduling", "--no-enable-prefix-caching"} <= flags["serve"]


@pytest.mark.parametrize("door", DOORS)
def test_each_door_reads_the_engine_flags_alike(door):
    argv = ["--model", "m", "--block-size", "4", "--num-gpu-blocks", "9", "--dtype", "float32",
            "--speculative-config", SPEC, "--async-scheduling", "--no-enable-prefix-caching", "--swap-space", "0.5"]
    assert engine_kwargs(DOORS[door]().parse_args(argv)) == dict(
        model="m", block_size=4, num_gpu_blocks=9, dtype="float32", speculative_config=SPEC,
        async_scheduling=True, enable_prefix_caching=False, swap_space=0.5)
    assert engine_kwargs(DOORS[door]().parse_args([])) == {"model": None}     # the rest: the door's defaults


@pytest.mark.parametrize("door", DOORS)
def test_the_old_trace_spelling_is_gone(door, capsys):
    with pytest.raises(SystemExit):
        DOORS[door]().parse_args(["--speculative-method", "ngram"])
    assert "unrecognized arguments: --speculative-method" in capsys.readouterr().err
