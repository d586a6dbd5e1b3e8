"""bench.py's llama-server peer (benchmarks/llama_server.py), run against a stand-in
server: a small Python HTTP server that takes llama-server's command line and answers its
/health, /v1/models and /completion the way llama-server does, recording what it was
asked. The harness must start it on 127.0.0.1, send the workload's token ids greedily with
ignore_eos, count the tokens it says it produced, refuse a short count, and leave no
process behind."""
import os
import sys
import textwrap

import pytest

from benchmarks.llama_server import SLOT_CONTEXT, find_llama_server, run_llama_server

FAKE = textwrap.dedent('''\
    #!{python}
    import json, os, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    argv = sys.argv[1:]
    opt = lambda name: argv[argv.index(name) + 1]
    log = open(os.environ["FAKE_LOG"], "a")
    log.write(json.dumps({{"argv": argv, "pid": os.getpid()}}) + "\\n"); log.flush()
    short = int(os.environ.get("FAKE_SHORT", "0"))

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def reply(self, obj):
            body = json.dumps(obj).encode()
            self.send_response(200); self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
        def do_GET(self):
            self.reply({{"status": "ok"}} if self.path == "/health" else {{"data": [{{"id": "fake"}}]}})
        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            log.write(json.dumps({{"request": req}}) + "\\n"); log.flush()
            self.reply({{"content": "", "tokens_predicted": req["n_predict"] - short}})

    ThreadingHTTPServer((opt("--host"), int(opt("--port"))), H).serve_forever()
''')


@pytest.fixture
def fake_server(tmp_path, monkeypatch):
    binary = tmp_path / "llama-server"
    binary.write_text(FAKE.format(python=sys.executable))
    binary.chmod(0o755)
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "log.jsonl"))
    return binary


def _log(tmp_path):
    import json
    return [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_the_workload_goes_to_one_slot_per_request_greedy_and_the_server_is_stopped(fake_server, tmp_path):
    prompts, out_lens = [[101, 102, 103], [201] * 40, [301, 302]], [5, 7, 3]
    r = run_llama_server(str(fake_server), tmp_path / "model.gguf", 2, prompts, out_lens)
    assert r["tokens"] == 15 and r["slots"] == 3 and r["wall"] > 0
    log = _log(tmp_path)
    argv, pid = log[0]["argv"], log[0]["pid"]
    opt = lambda name: argv[argv.index(name) + 1]
    assert opt("--host") == "127.0.0.1" and opt("-m") == str(tmp_path / "model.gguf")
    assert (opt("-t"), opt("-tb"), opt("-np"), opt("-c")) == ("2", "2", "3", str(3 * SLOT_CONTEXT))
    requests = [entry["request"] for entry in log[1:]]
    assert len(requests) == 4                                    # a warm-up, then the workload
    timed = sorted(requests[1:], key=lambda q: q["prompt"][0])
    assert [q["prompt"] for q in timed] == prompts and [q["n_predict"] for q in timed] == out_lens
    assert all(q["ignore_eos"] and q["top_k"] == 1 and q["temperature"] == 0 and not q["cache_prompt"]
               for q in requests)
    assert _gone(pid)


def test_a_short_answer_is_an_error_not_a_figure(fake_server, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SHORT", "1")
    with pytest.raises(RuntimeError, match="produced 12 tokens, the requests asked for 15"):
        run_llama_server(str(fake_server), tmp_path / "model.gguf", 2, [[1], [2], [3]], [5, 7, 3])
    assert _gone(_log(tmp_path)[0]["pid"])


def test_the_binary_is_found_by_flag_then_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOPAGED_LLAMA_SERVER", "/from/env")
    assert find_llama_server("/from/flag") == "/from/flag"
    assert find_llama_server(None) == "/from/env"
