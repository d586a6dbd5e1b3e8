"""The live dashboard (issue 27) in a real browser: headless Chromium, driven by selenium,
watches GET /dashboard of a real server while a bounded load of completions runs.

test_dashboard_server.py checks the stream's JSON; this checks what the page makes of
it, through the attributes dashboard.js sets for exactly this purpose: the grid's cells
(data-state free | cached | used | shared, data-ref-count, data-owners), the queues'
entries (data-request-id), the block table's rows (data-logical, data-physical) and
#status (data-step).

- /dashboard?key= lands on /dashboard (the key traded for an HttpOnly cookie, which the
  page's stream then uses);
- the legend sits above the grid;
- during the load the grid shows used blocks, and blocks shared with ref_count 2 by the
  two sequences of one n=2 request;
- a click on a request shows its block table, and its physical ids are exactly the cells
  the grid marks as that request's;
- after the load every block is free or free-cached, the queues are empty, and #status
  shows a step number.

It saves a screenshot during the load and one after, into the test's tmp dir, and with
NANOPAGED_SAVE_FIGURES=1 into chapters/figures/dashboard-live.png and dashboard-idle.png
as well: the chapter's pictures are taken by this test.

Chromium and chromedriver come from Debian (`apt-get install chromium chromium-driver`;
.ci/run installs them when missing). Without them the test skips, except under CI
(the CI variable set), where it fails: there a skip would hide a broken install.
Everything it starts (the server, its EngineCore, chromedriver, Chromium's processes)
is stopped by pid and checked gone. The same page as the tracer's replay (`nanopaged.trace
--export FILE.html`, window.NANOPAGED_REPLAY): its buttons and arrow keys step through a
run, chapter 13's preempt figure shows the CPU swap pool folded to one line while
none of its blocks is in use and open while some are, and its pipeline figure the
batches in flight; a server's snapshot at pp=2 draws a row per stage, its state and batch.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from serve_harness import KEY, ROOT, Server

pytestmark = pytest.mark.timeout(240)

# a 64-block pool of 4-token blocks: a grid small enough to read in a screenshot, and
# small enough that the load below fills it (recompute preemption; no CPU swap pool, so
# the server's start skips measuring swap against recompute, see test_serve.TINY_ARGS)
ARGS = ["--api-key", KEY, "--served-model-name", "tiny", "--block-size", "4",
        "--num-gpu-blocks", "64", "--attention-backend", "torch",
        "--preemption-mode", "recompute", "--num-cpu-blocks", "0"]
# distinct first words, so no two requests share a prefix-cached block: a block with
# ref_count 2 is then shared by the two sequences of one n=2 request
PROMPTS = ["Alpha: paged attention splits the KV cache into blocks of tokens",
           "Bravo: a block table maps each logical block to a physical one",
           "Charlie: copy on write keeps shared prompt blocks until they differ",
           "Delta: the scheduler admits requests while free blocks remain"]
FIGURES = os.path.join(ROOT, "chapters", "figures")


# -- the browser --------------------------------------------------------------------------------

def _chromium() -> tuple[str, str]:
    """(chromium, chromedriver) paths; skip without them, or fail under CI."""
    browser = next(filter(None, map(shutil.which, ("chromium", "chromium-browser"))), None)
    driver = shutil.which("chromedriver") or ("/usr/bin/chromedriver" if os.path.exists("/usr/bin/chromedriver") else None)
    missing = [name for name, found in (("chromium", browser), ("chromedriver", driver),
                                         ("the selenium package", importlib.util.find_spec("selenium")))
               if not found]
    if missing:
        message = (f"{' and '.join(missing)} not found; on Debian/Ubuntu: sudo apt-get install chromium "
                   f"chromium-driver (.ci/run does this), and pip install -e '.[test]' for selenium")
        if os.environ.get("CI"):
            pytest.fail(f"CI is set, so the browser test must run: {message}")
        pytest.skip(message)
    return browser, driver


@pytest.fixture
def browser(tmp_path):
    """A headless Chromium with a private profile; quit afterwards, and chromedriver and
    every Chromium process under it checked gone."""
    chromium, chromedriver = _chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = str(tmp_path / "chromium-profile")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1100", f"--user-data-dir={profile}",
                "--no-first-run", "--disable-extensions", "--disable-background-networking"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(chromedriver), options=options)
    try:
        driver.set_script_timeout(10)
        yield driver
    finally:
        # ours: chromedriver (our child) and everything under it, listed before quit(),
        # plus whatever names our private profile (a crash handler that left the tree)
        started = {p.pid: p for p in _under(driver.service.process.pid) + _naming(profile)}
        driver.quit()
    _, alive = psutil.wait_procs(list(started.values()), timeout=10)
    alive += [p for p in _naming(profile) if p.pid not in started]
    for p in alive:
        p.kill()
    assert not alive, f"driver.quit() left {[(p.pid, p.name()) for p in alive]}"


def _under(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _naming(profile: str) -> list[psutil.Process]:
    """The processes whose command line names `profile`, a folder only this test uses."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if any(profile in arg for arg in p.info["cmdline"] or ()):
            found.append(p)
    return found


def _screenshot(driver, tmp_path, name: str) -> None:
    driver.save_screenshot(str(tmp_path / name))
    if os.environ.get("NANOPAGED_SAVE_FIGURES") == "1":
        shutil.copyfile(tmp_path / name, os.path.join(FIGURES, name))


# One read of the page, in one script: JavaScript runs between two draws, never during
# one, so what it returns is one snapshot's picture.
READ_PAGE = """
var cells = Array.prototype.map.call(document.querySelectorAll('#gpu-grid [data-block]'), function (c) {
  return {block: +c.getAttribute('data-block'), state: c.getAttribute('data-state'),
          ref: +c.getAttribute('data-ref-count'), selected: c.classList.contains('selected'),
          owners: (c.getAttribute('data-owners') || '').split(',').filter(Boolean)};
});
var rows = Array.prototype.map.call(document.querySelectorAll('#block-table tr[data-physical]'), function (r) {
  return {logical: +r.getAttribute('data-logical'), physical: +r.getAttribute('data-physical'),
          seq: +r.getAttribute('data-seq-id'), on_cpu: r.getAttribute('data-on-cpu') === 'true'};
});
var queued = Array.prototype.map.call(document.querySelectorAll('#queues li[data-request-id]'), function (li) {
  return li.getAttribute('data-request-id');
});
var status = document.getElementById('status');
return {cells: cells, rows: rows, queued: queued,
        shown: document.getElementById('block-table').getAttribute('data-request-id'),
        state: status.getAttribute('data-state'), step: status.getAttribute('data-step')};
"""

# Loaded before the page's own scripts (CDP's addScriptToEvaluateOnNewDocument): an
# EventSource whose messages reach the page only while window.nanopagedHold is false, so
# the test can hold the picture still for a screenshot. Nothing else changes.
HOLD = """
(function () {
  var Real = window.EventSource;
  window.nanopagedHold = false;
  function Held(url, init) {
    var source = new Real(url, init), handler = null;
    Object.defineProperty(source, 'onmessage', {get: function () { return handler; },
                                                set: function (f) { handler = f; }});
    source.addEventListener('message', function (e) { if (handler && !window.nanopagedHold) handler(e); });
    return source;
  }
  Held.CONNECTING = Real.CONNECTING; Held.OPEN = Real.OPEN; Held.CLOSED = Real.CLOSED;
  window.EventSource = Held;
})();
"""

YOUNGEST_RUNNING = """
var entries = Array.prototype.slice.call(document.querySelectorAll('#queue-running li[data-request-id]'));
entries.sort(function (a, b) { return a.getAttribute('data-num-tokens') - b.getAttribute('data-num-tokens'); });
return entries.length ? entries[0] : null;
"""


def _poll(read, predicate, timeout: float, what: str):
    """read() until predicate(result) holds; fail with the last result after timeout s."""
    deadline = time.monotonic() + timeout
    while True:
        page = read()
        if predicate(page):
            return page
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout} s; the page last showed {page}")
        time.sleep(0.05)


# -- the load -------------------------------------------------------------------------------------

class Load(threading.Thread):
    """8 clients, each sending completions one after another (every other client with
    n=2, so its request's two sequences share the prompt's blocks), max_tokens 48, until
    stop() or max_each requests each: long enough for the browser checks, bounded either way."""

    def __init__(self, url: str, max_each: int = 30) -> None:
        super().__init__(daemon=True)
        self.url, self.max_each = url, max_each
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.done, self.error = 0, None

    def client(self, http: httpx.Client, i: int) -> None:
        try:
            for r in range(self.max_each):
                if self.stopping.is_set():
                    return
                body = {"model": "tiny", "prompt": f"{PROMPTS[i % len(PROMPTS)]} (client {i}, request {r})",
                        "max_tokens": 48, "temperature": 0.8, "seed": r, "ignore_eos": True,
                        "n": 2 if i % 2 else 1}
                resp = http.post("/v1/completions", json=body)
                if resp.status_code != 200:
                    raise RuntimeError(f"{resp.status_code}: {resp.text}")
                with self.lock:
                    self.done += 1
        except Exception as e:          # reported by stop(), not lost in a thread; the others stop too
            self.error = self.error or e
            self.stopping.set()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as http, \
                ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: self.client(http, i), range(8)))

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=150)
        assert not self.is_alive(), "the load did not finish"
        assert self.error is None, f"the load failed: {self.error!r}"


# -- the test -------------------------------------------------------------------------------------

def _shared_by_one_n2_request(page) -> list[dict]:
    return [c for c in page["cells"] if c["state"] == "shared" and c["ref"] == 2 and len(c["owners"]) == 1]


def _click_a_request_and_read_its_table(driver, read):
    """Click a running request's entry; return (its id, the page) once the block table
    shows that request's rows. The youngest request first (fewest tokens: the longest
    left to live). A click can miss (an entry redrawn meanwhile, or a request that just
    finished): then try again."""
    from selenium.common.exceptions import StaleElementReferenceException

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        # found in the page, not entry by entry over the wire: a snapshot redraws the
        # entries every ~0.2 s, and each round trip to the driver takes some of that
        entry = driver.execute_script(YOUNGEST_RUNNING)
        if entry is not None:
            try:
                request_id = entry.get_attribute("data-request-id")
                entry.click()
            except StaleElementReferenceException:
                continue
            page = read()
            if page["shown"] == request_id and page["rows"]:
                return request_id, page
        time.sleep(0.05)
    pytest.fail("no click on a running request showed its block table within 30 s")


def _check_the_block_table(request_id: str, page: dict) -> None:
    """The table's physical ids are the grid's cells owned by the request (and only
    those are highlighted); each sequence's logical blocks count 0, 1, 2, ..."""
    physical = {row["physical"] for row in page["rows"] if not row["on_cpu"]}
    coloured = {c["block"] for c in page["cells"] if request_id in c["owners"]}
    highlighted = {c["block"] for c in page["cells"] if c["selected"]}
    assert physical and physical == coloured == highlighted, (request_id, page["rows"], coloured, highlighted)
    for seq in {row["seq"] for row in page["rows"]}:
        logical = [row["logical"] for row in page["rows"] if row["seq"] == seq]
        assert logical == list(range(len(logical))), page["rows"]


def _busy(page: dict) -> bool:
    return bool(_shared_by_one_n2_request(page)) and sum(c["state"] in ("used", "shared") for c in page["cells"]) >= 16


def _screenshot_under_load(driver, read, tmp_path) -> None:
    """A request of the tiny model lives about a second, less than a click, a screenshot
    and a read take on a busy 2-core machine. So hold the picture still (HOLD) once the
    pool is busy, select the youngest request, check its table again, take the picture,
    and let the page go on."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        driver.execute_script("window.nanopagedHold = true;")
        try:
            page = read()
            if _busy(page):
                request_id, page = _click_a_request_and_read_its_table(driver, read)
                _check_the_block_table(request_id, page)
                _screenshot(driver, tmp_path, "dashboard-live.png")
                return
        finally:
            driver.execute_script("window.nanopagedHold = false;")
        time.sleep(0.05)
    pytest.fail("the pool was not busy (16 blocks held, one shared by an n=2 request) within 30 s")


def test_the_dashboard_in_chromium_under_load(browser, tiny_model_dir, tmp_path):
    server = Server(tiny_model_dir, *ARGS)
    load = None
    try:
        browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": HOLD})
        browser.get(f"{server.url}/dashboard?key={KEY}")
        # the key is traded for an HttpOnly cookie: the page's URL no longer holds it, and
        # its scripts cannot read the cookie (the stream goes live below on the cookie alone)
        assert browser.current_url == f"{server.url}/dashboard", browser.current_url
        assert browser.execute_script("return document.cookie;") == ""
        read = lambda: browser.execute_script(READ_PAGE)    # noqa: E731
        idle = _poll(read, lambda p: p["state"] == "live" and len(p["cells"]) == 64, 30, "the page going live")
        assert all(c["state"] in ("free", "cached") for c in idle["cells"])
        legend, grid = browser.execute_script(  # the legend is read first, above the grid
            "return ['legend', 'gpu-grid'].map(function (id) {"
            " var r = document.getElementById(id).getBoundingClientRect(); return [r.top, r.bottom]; });")
        assert legend[1] <= grid[0], (legend, grid)

        load = Load(server.url)
        load.start()
        busy = _poll(read, lambda p: _shared_by_one_n2_request(p) and any(c["state"] == "used" for c in p["cells"]),
                     60, "used blocks and blocks shared by an n=2 request's two sequences")
        for cell in busy["cells"]:
            # a cell's state follows its ref count, and a held block names its owner
            expected = ("free", "cached") if cell["ref"] == 0 else ("used",) if cell["ref"] == 1 else ("shared",)
            assert cell["state"] in expected, cell
            assert bool(cell["owners"]) == (cell["ref"] > 0), cell

        request_id, page = _click_a_request_and_read_its_table(browser, read)
        _check_the_block_table(request_id, page)
        _screenshot_under_load(browser, read, tmp_path)

        load.stop()
        assert load.done >= 8
        after = _poll(read, lambda p: not p["queued"] and all(c["state"] in ("free", "cached") for c in p["cells"]),
                      20, "every block free or free-cached after the load")
        assert any(c["state"] == "cached" for c in after["cells"])           # the prompts stay in the prefix cache
        assert not any(c["owners"] for c in after["cells"])
        assert after["step"] and int(after["step"]) > 0
        # a second after the last step the core reports the rate it now has: none
        rate = "return document.getElementById('spark-tokens').getAttribute('data-value')"
        _poll(lambda: browser.execute_script(rate), lambda v: v is not None and float(v) == 0, 10,
              "tokens/s back to 0 when idle")
        _screenshot(browser, tmp_path, "dashboard-idle.png")
    finally:
        if load is not None and load.is_alive():
            load.stopping.set()
            load.join(timeout=150)
        alive = server.stop()
    assert server.proc.returncode == 0 and not alive, f"exit {server.proc.returncode}, left behind: {alive}"
    assert server.left_in_tmp == [], server.left_in_tmp


SWAP_POOL = """
var pool = document.getElementById('cpu-pool');
return {index: +document.getElementById('replay-position').getAttribute('data-index'), hidden: pool.hidden,
        open: pool.open, used: +pool.getAttribute('data-used'),
        summary: document.getElementById('cpu-summary').textContent,
        grid_shown: document.getElementById('cpu-grid').checkVisibility(),
        height: pool.getBoundingClientRect().height};
"""


def test_the_swap_pool_is_folded_while_unused_and_open_while_used_in_chromium(browser):
    """Chapter 13's preempt figure (a CPU pool of 2 blocks; a request swapped out and
    back in): the pool is one summary line, "2 blocks, none in use", while nothing is
    swapped out; it opens at the step that swaps out and folds again once the blocks
    are back. A click on the summary is the viewer's choice, and then it stays."""
    from selenium.webdriver.common.by import By
    browser.get(Path(FIGURES, "trace-preempt.html").as_uri())
    read = lambda: browser.execute_script(SWAP_POOL)      # noqa: E731
    first = _poll(read, lambda p: p["index"] == 1, 10, "the replay page to load")
    count = int(browser.find_element(By.ID, "replay-position").get_attribute("data-count"))
    assert not first["hidden"] and first["used"] == 0 and not first["open"] and not first["grid_shown"], first
    assert first["summary"] == "2 blocks, none in use" and first["height"] < 40, first      # one line
    seen = [first]
    for _ in range(count - 1):
        browser.find_element(By.ID, "replay-next").click()
        seen.append(read())
    assert all(p["open"] == p["grid_shown"] == (p["used"] > 0) for p in seen), seen
    assert any(p["used"] for p in seen) and not seen[-1]["used"], seen
    assert [p["summary"] for p in seen if p["used"] == 2][0] == "2 blocks, 2 in use", seen
    browser.find_element(By.CSS_SELECTOR, "#cpu-pool > summary").click()     # open by hand, nothing in use
    browser.find_element(By.ID, "replay-prev").click()
    after = read()
    assert after["open"] and after["grid_shown"] and after["index"] == count - 1, after


PIPELINE = """
var p = document.getElementById('pipeline');
return {index: +document.getElementById('replay-position').getAttribute('data-index'), hidden: p.hidden,
        stages: p.getAttribute('data-stages'),
        rows: Array.from(document.querySelectorAll('#pipeline-stages li[data-stage]'))
                   .map(li => [li.getAttribute('data-state'), li.getAttribute('data-batch-number'),
                               li.getAttribute('data-request-ids'), li.textContent]),
        batches: Array.from(document.querySelectorAll('#pipeline-batches li[data-batch]'))
                      .map(li => li.getAttribute('data-request-ids')),
        log: Array.from(document.querySelectorAll('#step-log li[data-step]')).map(li => li.textContent)};
"""


def test_the_pipeline_figure_shows_the_batches_in_flight_in_chromium(browser, tmp_path):
    """Chapter 13's pipeline figure (pp=2, two requests in two batches): the pipeline
    panel is shown with its 2 stages, after step 1 B's batch is in flight, and the step
    log names the batches in flight during each step, A's taken in first. The figures
    of a single-stage engine keep the panel hidden, and the tracer's have no stage rows;
    a server's snapshot (hand-made here, as dashboard/sampler.stage_rows makes them) gets
    a row per stage with its state, its batch's number and requests."""
    from selenium.webdriver.common.by import By
    from nanopaged.dashboard.messages import DashboardSnapshot, DashboardStage
    from nanopaged.dashboard.replay import replay_page
    browser.get(Path(FIGURES, "trace-preempt.html").as_uri())
    assert _poll(lambda: browser.execute_script(PIPELINE), lambda p: p["index"] == 1, 10,
                 "the replay page to load")["hidden"]
    browser.get(Path(FIGURES, "trace-pipeline.html").as_uri())
    first = _poll(lambda: browser.execute_script(PIPELINE), lambda p: p["index"] == 1, 10, "the replay page to load")
    assert not first["hidden"] and first["stages"] == "2" and first["batches"] == ["B"] and first["rows"] == [], first
    assert first["log"] == ["A/seq 0 prefill 8 · B/seq 1 prefill 8 · in flight [A] [B], took in [A]"], first
    browser.find_element(By.ID, "replay-next").click()
    second = browser.execute_script(PIPELINE)
    assert second["batches"] == ["A"] and second["log"][0].endswith("in flight [B] [A], took in [B]"), second
    snap = DashboardSnapshot(step=3, time=1.0, block_size=4, num_gpu_blocks=4, num_cpu_blocks=0,
                             gpu_ref_count=[0] * 4, gpu_cached=[False] * 4, gpu_owners=[[]] * 4, cpu_owners={},
                             requests=[], running=[], waiting=[], swapped=[], pipeline_parallel_size=3,
                             in_flight=[{"request_ids": ["A"], "seq_ids": [0]}, {"request_ids": ["B"], "seq_ids": [1]}],
                             stages=[DashboardStage(0, [0, 1], "computing", 8, ["B"], [1]),
                                     DashboardStage(1, [2, 3], "idle", 7, ["A"], [0]),
                                     DashboardStage(2, [4, 5], "unknown")])
    page = tmp_path / "stages.html"
    page.write_text(replay_page([snap]))
    browser.get(page.as_uri())
    rows = _poll(lambda: browser.execute_script(PIPELINE), lambda p: p["index"] == 1, 10, "the page to load")["rows"]
    assert [r[:3] for r in rows] == [["computing", "8", "B"], ["idle", "7", "A"], ["unknown", "", ""]], rows
    assert [r[3] for r in rows] == ["stage 0 (ranks 0-1) computing · batch 8 B", "stage 1 (ranks 2-3) idle · last: batch 7 A",
                                    "stage 2 (ranks 4-5) not reported (another host)"], rows


QUEUES = """
return {index: +document.getElementById('replay-position').getAttribute('data-index'),
        rows: Array.from(document.querySelectorAll('.queue li[data-request-id]'))
                   .map(li => [li.getAttribute('data-request-id'), li.getAttribute('data-status'),
                               li.getAttribute('data-lora'), (li.querySelector('.adapter') || {}).textContent])};
"""


def test_the_lora_figure_names_each_requests_adapter_in_chromium(browser):
    """Chapter 13's lora figure (three adapters, two slots): after step 1 A, B and D run,
    A's and B's lines naming their adapters x and y, D's none (the base model), and C
    waits with adapter z."""
    browser.get(Path(FIGURES, "trace-lora.html").as_uri())
    first = _poll(lambda: browser.execute_script(QUEUES), lambda p: p["index"] == 1, 10, "the replay page to load")
    assert sorted(first["rows"], key=lambda r: r[0]) == [
        ["A", "running", "x", "adapter x"], ["B", "running", "y", "adapter y"], ["C", "waiting", "z", "adapter z"],
        ["D", "running", "", None]], first


def test_the_tracers_replay_page_steps_back_and_forth_in_chromium(browser, tmp_path):
    """`python -m nanopaged.trace --export FILE.html` on the tiny model, opened as a file:
    the first snapshot is shown, the buttons and the arrow keys move through the steps,
    and each step's grid is that snapshot's (the shared blocks of the cow scenario show
    ref_count 2 at some step)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from nanopaged.exercises import tiny_model_folder
    page = tmp_path / "cow.html"
    done = subprocess.run([sys.executable, "-m", "nanopaged.trace", "--model", tiny_model_folder(), "--scenario",
                           "cow", "--no-pause", "--export", str(page)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stderr
    browser.get(page.as_uri())
    position = lambda: browser.execute_script(
        "var p = document.getElementById('replay-position');"
        "return [+p.getAttribute('data-index'), +p.getAttribute('data-count'),"
        " document.getElementById('status').getAttribute('data-state'),"
        " Array.from(document.querySelectorAll('#gpu-grid [data-block]')).map(c => +c.getAttribute('data-ref-count'))];")
    index, count, state, _ = _poll(position, lambda p: p[1] > 2, 10, "the replay page to load")
    assert (index, state) == (1, "replay")
    shared_seen = False
    for i in range(2, count + 1):
        browser.find_element(By.ID, "replay-next").click()
        index, _, _, refs = position()
        assert index == i
        shared_seen |= max(refs) >= 2
    assert shared_seen, "no step of the cow scenario showed a shared block"
    browser.find_element(By.ID, "replay-prev").click()
    assert position()[0] == count - 1
    browser.find_element(By.TAG_NAME, "body").send_keys(Keys.ARROW_LEFT)
    assert position()[0] == count - 2
    browser.find_element(By.TAG_NAME, "body").send_keys(Keys.ARROW_RIGHT)
    assert position()[0] == count - 1


def test_the_header_names_the_weights_formats_and_bytes_in_chromium(browser, tmp_path):
    """A snapshot's weight_bytes, drawn in the header (#weights) as
    messages.WeightsInfo.describe words it (the tracer's header), with data-bytes the
    total and data-formats the biggest share first; chapter 13's figures: float32."""
    from nanopaged.dashboard.messages import DashboardSnapshot
    from nanopaged.messages import WeightsInfo
    from nanopaged.dashboard.replay import replay_page
    read = ("var w = document.getElementById('weights'); return [w.textContent, w.getAttribute('data-bytes'),"
            " w.getAttribute('data-formats'), document.getElementById('replay-position').getAttribute('data-index')];")
    held = {"float32": 140544, "Q8_0": 30081024, "Q4_1": 66355200}      # SmolLM2's file, as shipped
    snap = DashboardSnapshot(step=1, time=0.0, block_size=4, num_gpu_blocks=2, num_cpu_blocks=0, gpu_ref_count=[0, 0],
                             gpu_cached=[False, False], gpu_owners=[[], []], cpu_owners={}, requests=[], running=[],
                             waiting=[], swapped=[], weight_bytes=held)
    page = tmp_path / "weights.html"
    page.write_text(replay_page([snap]))
    browser.get(page.as_uri())
    text, total, formats, _ = _poll(lambda: browser.execute_script(read), lambda w: w[3] == "1", 10, "the page to load")
    assert text == "weights " + WeightsInfo(held).describe() == \
        "weights Q4_1 66.4 MB + Q8_0 30.1 MB + float32 0.1 MB = 96.6 MB", text
    assert (int(total), formats) == (sum(held.values()), "Q4_1,Q8_0,float32")
    browser.get(Path(FIGURES, "trace-fig6.html").as_uri())
    text, total, formats, _ = _poll(lambda: browser.execute_script(read), lambda w: w[3] == "1", 10, "the figure to load")
    assert text.startswith("weights float32 ") and formats == "float32" and int(total) > 500e6, text
