"""The chat REPL: piped stdin, multi-turn history, /reset, /exit, Ctrl-C."""
import io
import os
import signal
import subprocess
import sys

import pytest

from nanopaged import LLM, SamplingParams
from nanopaged.entrypoints.chat import build_prompt, stream_answer


def run_chat(stdin: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanopaged.chat", *args], input=stdin,
                          capture_output=True, text=True, timeout=600)


def test_piped_session_with_reset_and_exit(tiny_model_dir):
    r = run_chat("Hello\nThe capital\n/reset\nParis\n/exit\nnever read\n",
                 "--model", str(tiny_model_dir), "--max-tokens", "5", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) >= 3           # three answers, then /exit
    assert "conversation cleared" in r.stderr


def test_bad_flag_value_is_named(tiny_model_dir):
    r = run_chat("", "--model", str(tiny_model_dir), "--top-p", "0")
    assert r.returncode == 1 and "top_p" in r.stderr


@pytest.mark.parametrize("which", ["a file", "missing"])
def test_a_bad_model_path_is_named_without_a_traceback(tmp_path, which):
    path = tmp_path / "model.gguf"
    if which == "a file":
        path.write_bytes(b"GGUF")
    r = run_chat("", "--model", str(path))
    assert r.returncode == 1 and str(path) in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("value, words", [("{enable_thinking: false}", ["--chat-template-kwargs is not JSON"]),
                                          ("[1]", ["chat_template_kwargs must be a dict"]),
                                          ('{"tokenize": true}', ["chat_template_kwargs", "'tokenize'"])])
def test_bad_chat_template_kwargs_flag_is_named(tiny_model_dir, value, words):
    r = run_chat("", "--model", str(tiny_model_dir), "--chat-template-kwargs", value)
    assert r.returncode == 1 and all(w in r.stderr for w in words), r.stderr


def test_history_is_trimmed_to_fit(tiny_model_dir):
    tok = LLM(str(tiny_model_dir), num_gpu_blocks=8).get_tokenizer()
    msgs = [{"role": "user", "content": "Hello " * 30}, {"role": "assistant", "content": "Paris " * 30},
            {"role": "user", "content": "The capital"}]
    ids = build_prompt(tok, msgs, 40)
    assert len(ids) <= 40
    assert ids == build_prompt(tok, msgs[2:], 40)     # the old turns were dropped
    with pytest.raises(ValueError, match="at most 3"):
        build_prompt(tok, msgs[2:], 3)


def test_ctrl_c_stops_the_answer_not_the_program(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_gpu_blocks=64, block_size=4)
    engine, real_step, steps = llm.engine, llm.engine.step, []

    def step():                       # Ctrl-C arrives in the middle of the third step
        steps.append(1)
        if len(steps) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return real_step()

    engine.step = step
    handler_before = signal.getsignal(signal.SIGINT)     # (SIG_IGN when run in the background)
    out = io.StringIO()
    text = stream_answer(engine, "r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), out)
    assert len(steps) == 3 and out.getvalue().endswith(" [stopped]\n")
    assert text and out.getvalue() == text + " [stopped]\n" and not engine.has_unfinished_requests()
    assert engine.get_stats()["num_free_gpu_blocks"] == 64
    assert signal.getsignal(signal.SIGINT) == handler_before      # restored
    engine.step = real_step
    out = io.StringIO()
    stream_answer(engine, "next", [5, 6], SamplingParams(max_tokens=3, ignore_eos=True), out)
    assert out.getvalue().endswith("\n") and "[stopped]" not in out.getvalue()
    assert engine.num_generated_tokens == 3 + 3      # 3 before the stop, then the next answer in full


@pytest.mark.slow
def test_chat_answers_capital_of_france_with_paris(default_model_dir):
    r = run_chat("What is the capital of France?\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_lora_runs_every_turn_with_the_adapter(tiny_model_dir, tmp_path):
    """--lora NAME=PATH turns enable_lora on and sends each turn with the adapter: the
    answers are LLM.chat's with that LoRARequest (and not the base model's); a bad
    folder stops the chat before the first turn, naming the file and the field."""
    from nanopaged import LoRARequest
    from nanopaged.lora.random_adapter import write_random_adapter
    from nanopaged.model.config import ModelConfig
    folder = write_random_adapter(tmp_path / "poet", ModelConfig.from_pretrained(tiny_model_dir), rank=4)
    flags = ["--model", str(tiny_model_dir), "--max-tokens", "6", "--temperature", "0", "--dtype", "float32",
             "--block-size", "4", "--num-gpu-blocks", "64"]
    llm = LLM(str(tiny_model_dir), dtype="float32", block_size=4, num_gpu_blocks=64, enable_lora=True)
    greedy = SamplingParams(temperature=0, max_tokens=6)
    turn = [{"role": "user", "content": "Hello"}]
    want = llm.chat(turn, greedy, use_tqdm=False, lora_request=LoRARequest("poet", 1, str(folder)))[0].outputs[0]
    base = llm.chat(turn, greedy, use_tqdm=False)[0].outputs[0]
    assert want.token_ids != base.token_ids
    for lora in (f"poet={folder}", str(folder)):               # named, or after its folder
        r = run_chat("Hello\n/exit\n", *flags, "--lora", lora)
        assert r.returncode == 0, r.stderr
        assert r.stdout == want.text + "\n"
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 64, "target_modules": ["q_proj"]}')
    r = run_chat("Hello\n/exit\n", *flags, "--lora", f"poet={folder}")
    assert r.returncode == 1 and f"{folder}/adapter_config.json" in r.stderr and "r=64" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
