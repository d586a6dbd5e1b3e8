"""The server's features join through its table (entrypoints/openai/server_features.py):
with the dashboard's package unimportable, the server still parses its own flags and
serves the API, and the dashboard's flags, routes and series are gone; with it, they
are there. The same for LoRA's flags (lora/serving.py) with the lora package."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from serve_harness import ROOT

pytestmark = pytest.mark.timeout(120)

SCRIPT = r'''
import collections, importlib.abc, json, sys
blocked = sys.argv[1]             # a package of nanopaged made unimportable, or ""

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == f"nanopaged.{blocked}" or name.startswith(f"nanopaged.{blocked}."):
            raise ImportError(f"{name} is blocked in this test")
        return None

if blocked:
    sys.meta_path.insert(0, Refuse())
from fastapi.testclient import TestClient
from nanopaged.entrypoints.openai.api_server import build_app, parse_args, ready_line
from serve_harness import FakeEngine

engine = FakeEngine()
engine.get_stats, engine.model_path = (lambda: collections.defaultdict(int)), "/m"
engine.config = type("Config", (), {"max_model_len": 64})()
result = {}
try:
    parse_args(["--no-dashboard"])
    result["no_dashboard_flag"] = "parsed"
except SystemExit as e:
    result["no_dashboard_flag"] = f"exit {e.code}"
try:
    parse_args(["--lora-modules", "a=/p"])
    result["lora_modules_flag"] = "parsed"
except SystemExit as e:
    result["lora_modules_flag"] = f"exit {e.code}"
args = parse_args(["--api-key", "k"])
app = build_app(engine, "m", api_key="k", args=args)
client = TestClient(app)
result["features"] = [f.name for f in app.state.server_features]
result["models"] = client.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code
result["page"] = client.get("/dashboard", headers={"Authorization": "Bearer k"}).status_code
result["dashboard_series"] = "nanopaged:dashboard_viewers" in client.get("/metrics").text
result["ready"] = ready_line(args, "m", app)
result["dashboard_modules"] = sorted(m for m in sys.modules if m.startswith("nanopaged.dashboard"))
result["lora_modules"] = sorted(m for m in sys.modules if m.startswith("nanopaged.lora."))
print(json.dumps(result))
'''


def _run(mode: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], env=env, capture_output=True, text=True,
                         timeout=100)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_the_server_serves_without_the_dashboard_package():
    got = _run("dashboard")
    assert got["no_dashboard_flag"] == "exit 2"             # argparse: an unknown flag
    assert got["features"] == [] and got["dashboard_modules"] == []
    assert got["models"] == 200 and got["page"] == 404 and not got["dashboard_series"]
    assert "dashboard" not in got["ready"] and got["ready"].endswith("the API docs at http://127.0.0.1:8000/docs")


def test_with_its_package_the_dashboard_joins_through_the_table():
    got = _run("")
    assert got["no_dashboard_flag"] == "parsed" and got["features"] == ["dashboard"]
    assert got["models"] == 200 and got["page"] == 200 and got["dashboard_series"]
    assert "the dashboard at http://127.0.0.1:8000/dashboard?key=<api-key>" in got["ready"]


def test_loras_flags_come_with_its_package():
    """--lora-modules is LoRA's flag (parsed with the package; without it, unknown), and
    without --enable-lora or --lora-modules the feature is off: the server is the plain one."""
    assert _run("")["lora_modules_flag"] == "parsed"
    got = _run("lora")
    assert got["lora_modules_flag"] == "exit 2" and got["lora_modules"] == []
    assert got["features"] == ["dashboard"] and got["models"] == 200 and got["page"] == 200
