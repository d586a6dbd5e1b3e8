/* nanopaged's dashboard: draws DashboardSnapshots (nanopaged/dashboard/messages.py) into index.html.
 *
 * Two sources of snapshots:
 *   live:   a server's GET /dashboard/events, server-sent events, one JSON snapshot each
 *           (the server sends at most 5 a second, and only while a page watches);
 *   replay: window.NANOPAGED_REPLAY = [snapshot, ...], embedded by
 *           `python -m nanopaged.trace --export FILE.html`; ← and → step through them.
 *
 * Every snapshot is drawn whole: the pools, the queues, the selected request's block
 * tables. The step log and the sparklines remember the last snapshots. The pools' cells
 * are built once per pool size and only their attributes change afterwards, so a pool of
 * tens of thousands of blocks stays cheap to redraw.
 *
 * What a browser test can query:
 *   #status                 data-state: connecting | live | disconnected | replay; data-step
 *   #gpu-grid [data-block]  one cell per device block: data-state free | cached | used | shared,
 *                           data-ref-count, data-owners (request ids, comma-separated), data-cached
 *   #cpu-grid [data-cpu-block]  one per CPU block: data-state free | used, data-owners
 *   #cpu-pool               a <details>, data-used (blocks in use); open while any is in use,
 *                           folded to its summary line while none is, unless the viewer
 *                           opened or closed it by hand (then it stays as they left it)
 *   #queue-running / -waiting / -swapped li[data-request-id]  (data-status, data-num-tokens,
 *                           data-lora: its LoRA adapter's name, "" for the base model)
 *   #block-table            data-request-id of the request shown; tr[data-logical][data-physical]
 *                           per logical block, with data-seq-id and data-on-cpu
 *   #step-log li[data-step], #spark-tokens / #spark-kv / #spark-hit [data-value]
 *   #pipeline               shown when pipeline_parallel_size > 1, data-stages; its
 *                           #pipeline-stages li[data-stage] one per stage as its workers
 *                           report it (a server's; none in a replay): data-state, data-ranks,
 *                           data-batch-number, data-request-ids (while that batch is in flight);
 *                           #pipeline-batches li[data-batch] (1 = oldest, the furthest along)
 *                           data-request-ids (comma-separated): the batches in flight now
 *   #replay-position        data-index (1-based), data-count
 *   #weights                the model's weights (weight_bytes): data-bytes (all of them, resident),
 *                           data-formats ("Q4_1,Q8_0,float32": the biggest share first)
 */
(function () {
  "use strict";

  var HISTORY = 60;            // sparkline points
  var LOG_LINES = 200;         // step-log entries kept
  var LARGE_UP_TO = 128;      // a pool this small (the tracer's) gets big cells
  var DENSE_AT = 2048;         // past this many blocks, cells get small and lose their labels
  var MAX_BLOCKS = 16384;      // dashboard/sampler.MAX_BLOCKS: a snapshot describes this many per pool
  var MAX_CELLS = 32768;       // cells drawn per pool; the rest are counted in a note

  var $ = function (id) { return document.getElementById(id); };
  var selected = null;         // the request id whose block table is shown
  var history = [];            // the stats of the last HISTORY snapshots
  var last = null;             // the snapshot drawn last

  // -- colours: stable per request id (a hash spread by the golden angle) ------------------
  var colours = {};
  // A request's colour: by order of first appearance, each hue 137.5° (the golden angle)
  // from the one before, so requests that arrive together never share a colour.
  var numColoured = 0;
  function colour(requestId) {
    if (!(requestId in colours)) {
      var n = numColoured++;
      colours[requestId] = "hsl(" + ((n * 137.508) % 360).toFixed(1) + ", 60%, " + (56 + 8 * (n % 3)) + "%)";
    }
    return colours[requestId];
  }

  // -- the pools ---------------------------------------------------------------------------
  // A grid keeps its cells and the attributes it last set on each, so a redraw touches
  // only the cells that changed.
  function makeGrid(container, note, attr) {
    return { el: $(container), note: $(note), attr: attr, cells: [], shown: {}, size: -1 };
  }
  var gpuGrid = makeGrid("gpu-grid", "gpu-note", "data-block");
  var cpuGrid = makeGrid("cpu-grid", "cpu-note", "data-cpu-block");
  // The swap pool is usually empty and often big (thousands of blocks): folded, unless
  // something is swapped out. A click on its summary line hands the choice to the viewer.
  var cpuFoldedByHand = false;
  $("cpu-pool").querySelector("summary").addEventListener("click", function () { cpuFoldedByHand = true; });

  // size: the pool's blocks; sent: how many of them the snapshot describes (the server
  // sends at most dashboard/sampler.MAX_BLOCKS per pool)
  function build(grid, size, sent, prefix) {
    if (grid.size === size && grid.sent === sent) return;
    grid.size = size;
    grid.sent = sent;
    grid.el.textContent = "";
    grid.cells = [];
    grid.shown = [];
    var n = Math.min(size, sent, MAX_CELLS), dense = n > DENSE_AT;
    grid.el.classList.toggle("dense", dense);
    grid.el.classList.toggle("large", size <= LARGE_UP_TO);
    var frag = document.createDocumentFragment();
    for (var b = 0; b < n; b++) {
      var cell = document.createElement("div");
      cell.className = "cell";
      cell.setAttribute(grid.attr, b);
      cell.title = prefix + b;
      if (!dense) cell.textContent = b;
      frag.appendChild(cell);
      grid.cells.push(cell);
      grid.shown.push({});
    }
    grid.el.appendChild(frag);
    grid.note.hidden = n === size;
    grid.note.textContent = "(the first " + n + " of " + size + " blocks are drawn)";
  }

  function set(grid, b, name, value) {
    if (grid.shown[b][name] !== value) {
      grid.shown[b][name] = value;
      if (name === "background") grid.cells[b].style.background = value;
      else if (name === "selected") grid.cells[b].classList.toggle("selected", value);
      else grid.cells[b].setAttribute(name, value);
    }
  }

  function drawGpu(s) {
    var sent = s.gpu_ref_count.length;
    build(gpuGrid, s.num_gpu_blocks, sent, "block ");
    var counts = { free: 0, cached: 0, used: 0, shared: 0 };
    for (var b = 0; b < sent; b++) {
      var ref = s.gpu_ref_count[b], owners = s.gpu_owners[b] || [];
      var state = ref > 1 ? "shared" : ref === 1 ? "used" : s.gpu_cached[b] ? "cached" : "free";
      counts[state]++;
      if (b >= gpuGrid.cells.length) continue;
      set(gpuGrid, b, "data-state", state);
      set(gpuGrid, b, "data-ref-count", String(ref));
      set(gpuGrid, b, "data-owners", owners.join(","));
      set(gpuGrid, b, "data-cached", String(!!s.gpu_cached[b]));
      set(gpuGrid, b, "background", owners.length && ref > 0 ? colour(owners[0]) : "");
      set(gpuGrid, b, "selected", selected !== null && owners.indexOf(selected) >= 0);
    }
    gpuGrid.el.classList.toggle("has-selection", selected !== null);
    var summary = $("gpu-summary");
    summary.textContent = s.num_gpu_blocks + " blocks" + (sent < s.num_gpu_blocks ? " (counts of the first " +
      sent + ")" : "") + " · " + counts.used + " held by one · " + counts.shared +
      " shared · " + counts.cached + " free cached · " + counts.free + " free · block size " + s.block_size;
    for (var k in counts) summary.setAttribute("data-" + k, counts[k]);
  }

  function drawCpu(s) {
    var pool = $("cpu-pool");
    pool.hidden = !s.num_cpu_blocks;
    if (!s.num_cpu_blocks) return;
    var sent = Math.min(s.num_cpu_blocks, MAX_BLOCKS);    // cpu_owners: the held ones only
    build(cpuGrid, s.num_cpu_blocks, sent, "CPU block ");
    var used = 0;
    for (var b = 0; b < sent; b++) {
      var owner = s.cpu_owners[b];
      if (owner !== null && owner !== undefined) used++;
      if (b >= cpuGrid.cells.length) continue;
      set(cpuGrid, b, "data-state", owner == null ? "free" : "used");
      set(cpuGrid, b, "data-owners", owner == null ? "" : owner);
      set(cpuGrid, b, "background", owner == null ? "" : colour(owner));
      set(cpuGrid, b, "selected", owner != null && owner === selected);
    }
    cpuGrid.el.classList.toggle("has-selection", selected !== null);
    pool.setAttribute("data-used", used);
    if (!cpuFoldedByHand) pool.open = used > 0;
    $("cpu-summary").textContent = s.num_cpu_blocks + " blocks, " + (used ? used + " in use" : "none in use") +
      (sent < s.num_cpu_blocks ? " (of the first " + sent + ")" : "");
  }

  // -- the queues --------------------------------------------------------------------------
  function drawQueues(s) {
    var byId = {};
    s.requests.forEach(function (r) { byId[r.request_id] = r; });
    ["running", "waiting", "swapped"].forEach(function (queue) {
      var ul = $("queue-" + queue), ids = s[queue] || [];
      $("count-" + queue).textContent = ids.length;
      ul.textContent = "";
      ids.forEach(function (id) {
        var r = byId[id], li = document.createElement("li");
        li.setAttribute("data-request-id", id);
        li.setAttribute("data-status", queue);
        li.style.borderLeftColor = colour(id);
        li.classList.toggle("selected", id === selected);
        var line = document.createElement("span");
        line.className = "mono";
        if (r) {
          var held = {}, blocks = 0;                             // distinct blocks: seqs share some
          r.seqs.forEach(function (q) {
            q.block_table.forEach(function (b) { if (!held[b]) { held[b] = true; blocks++; } });
          });
          li.setAttribute("data-num-tokens", r.num_prompt_tokens + r.num_output_tokens);
          line.textContent = id;
          var counts = document.createElement("span");            // on its own line: ids are long
          counts.className = "counts";
          counts.textContent = r.num_prompt_tokens + " prompt + " + r.num_output_tokens + " output tokens" +
            (r.seqs.length > 1 ? " (all seqs)" : "") + " · " +
            r.seqs.length + " seq" + (r.seqs.length > 1 ? "s" : "") + " · " + blocks + " blocks";
          li.appendChild(line);
          li.appendChild(counts);
          li.setAttribute("data-lora", r.lora_name || "");
          if (r.lora_name != null) {                            // multi-LoRA: the adapter it runs with
            var adapter = document.createElement("span");
            adapter.className = "adapter";
            adapter.textContent = "adapter " + r.lora_name;
            li.appendChild(adapter);
          }
        } else {
          line.textContent = id;
          li.appendChild(line);
        }
        if (r && (r.prompt != null || r.output != null)) {     // only with --dashboard-show-text
          var text = document.createElement("span");
          text.className = "text";
          var p = document.createElement("b");
          p.textContent = r.prompt != null ? r.prompt : "";
          text.appendChild(p);
          text.appendChild(document.createTextNode(r.output != null ? r.output : ""));
          li.appendChild(text);
        }
        ul.appendChild(li);
      });
    });
  }

  // -- the selected request's block tables: logical -> physical ----------------------------
  function drawBlockTable(s) {
    var panel = $("block-table");
    panel.textContent = "";
    panel.setAttribute("data-request-id", selected === null ? "" : selected);
    $("block-table-title").textContent = selected === null ? "" : selected;
    if (selected === null) return note(panel, "Click a request or a block.");
    var r = s.requests.filter(function (q) { return q.request_id === selected; })[0];
    if (!r) return note(panel, selected + " is not in the engine any more (finished or aborted).");
    if (r.lora_name != null) $("block-table-title").textContent = selected + " · adapter " + r.lora_name;
    r.seqs.forEach(function (q) {
      var h = document.createElement("h3");
      h.textContent = "seq " + q.seq_id + " ";
      var where = document.createElement("span");
      where.textContent = (q.on_cpu ? "in the CPU swap pool" : r.status) + " · " + q.num_computed_tokens + " of " +
        q.num_tokens + " tokens computed";
      h.appendChild(where);
      panel.appendChild(h);
      if (!q.block_table.length) return note(panel, "no blocks");
      var table = document.createElement("table");
      table.setAttribute("data-seq-id", q.seq_id);
      row(table, "th", ["logical", "physical", "filled"]);
      q.block_table.forEach(function (block, i) {
        var ref = q.on_cpu ? 1 : s.gpu_ref_count[block];
        var filled = Math.max(0, Math.min(s.block_size, q.num_computed_tokens - i * s.block_size));
        var tr = row(table, "td", [String(i), (q.on_cpu ? "cpu " : "") + block + (ref > 1 ? " ×" + ref : ""),
                                   filled + "/" + s.block_size]);
        tr.setAttribute("data-logical", i);
        tr.setAttribute("data-physical", block);
        tr.setAttribute("data-seq-id", q.seq_id);
        tr.setAttribute("data-on-cpu", String(q.on_cpu));
      });
      panel.appendChild(table);
    });
  }

  function note(parent, text) {
    var p = document.createElement("p");
    p.className = "note";
    p.textContent = text;
    parent.appendChild(p);
  }

  function row(table, tag, cells) {
    var tr = document.createElement("tr");
    cells.forEach(function (c) {
      var td = document.createElement(tag);
      td.textContent = c;
      tr.appendChild(td);
    });
    table.appendChild(tr);
    return tr;
  }

  function select(requestId) {
    selected = requestId || null;
    if (last) draw(last);
  }

  // Selection on mousedown, not click: the queues are rebuilt with every snapshot, and a
  // click whose press and release land on two versions of an entry is no click at all.
  $("gpu-grid").addEventListener("mousedown", function (e) {
    var owners = e.target.getAttribute && e.target.getAttribute("data-owners");
    if (owners !== null && owners !== undefined) select(owners ? owners.split(",")[0] : null);
  });
  $("cpu-grid").addEventListener("mousedown", function (e) {
    var owners = e.target.getAttribute && e.target.getAttribute("data-owners");
    if (owners) select(owners);
  });
  $("queues").addEventListener("mousedown", function (e) {
    var li = e.target.closest && e.target.closest("li[data-request-id]");
    if (li) select(li.getAttribute("data-request-id"));
  });

  // -- pipeline parallelism: each stage, and the batches in flight ---------------------------------
  function batchText(batch) { return "[" + batch.request_ids.join(" ") + "]"; }

  function requestSpans(li, requestIds) {        // a batch's requests, in their colours
    requestIds.forEach(function (id) {
      var span = document.createElement("span");
      span.className = "batch-request";
      span.style.borderLeftColor = colour(id);
      span.textContent = id;
      li.appendChild(span);
    });
  }

  function drawStages(stages) {
    var ul = $("pipeline-stages");
    ul.hidden = !stages.length;
    ul.textContent = "";
    stages.forEach(function (st) {
      var li = document.createElement("li"), last = st.ranks[st.ranks.length - 1];
      li.setAttribute("data-stage", st.stage);
      li.setAttribute("data-state", st.state);
      li.setAttribute("data-ranks", st.ranks.join(","));
      li.setAttribute("data-batch-number", st.batch == null ? "" : st.batch);
      li.setAttribute("data-request-ids", st.request_ids.join(","));
      li.className = "mono";
      li.appendChild(document.createTextNode("stage " + st.stage + " (rank" + (st.ranks.length > 1 ?
        "s " + st.ranks[0] + "-" + last : " " + last) + ") " +
        (st.state === "unknown" ? "not reported (another host)" : st.state)));   // DashboardStage.state
      if (st.batch != null) {
        var on = st.state === "idle" ? " · last: batch " : " · batch ";     // idle: the batch it finished
        li.appendChild(document.createTextNode(on + st.batch + " "));
        requestSpans(li, st.request_ids);
        if (!st.request_ids.length) li.appendChild(document.createTextNode("(out of the pipe)"));
      }
      ul.appendChild(li);
    });
  }

  function drawPipeline(s) {
    var pp = s.pipeline_parallel_size || 1, batches = s.in_flight || [], ol = $("pipeline-batches");
    $("pipeline").hidden = pp < 2;
    $("pipeline").setAttribute("data-stages", pp);
    $("pipeline-summary").textContent = pp + " stages · " + batches.length + " batch" +
      (batches.length === 1 ? "" : "es") + " in flight";
    drawStages(s.stages || []);
    ol.textContent = "";
    batches.forEach(function (b, i) {
      var li = document.createElement("li");
      li.setAttribute("data-batch", i + 1);
      li.setAttribute("data-request-ids", b.request_ids.join(","));
      li.className = "mono";
      requestSpans(li, b.request_ids);
      if (i === 0) li.appendChild(document.createTextNode(" (oldest: next out of the pipe)"));
      ol.appendChild(li);
    });
  }

  // -- the step log --------------------------------------------------------------------------
  function describe(step) {
    var parts = step.scheduled.map(function (x) {
      return x.request_id + "/seq " + x.seq_id + " " + x.kind + " " + x.num_tokens;
    });
    step.preempted.forEach(function (p) { parts.push("preempt " + p.request_id + " (" + p.mode + ")"); });
    step.copy_on_write.forEach(function (c) { parts.push("copy-on-write seq " + c.seq_id + ": " + c.src + "→" + c.dst); });
    (step.verified || []).forEach(function (v) {
      parts.push(v.request_id + "/seq " + v.seq_id + ": " + v.num_accepted + " of " + v.num_drafts + " drafts accepted" +
                 (v.taken_back.length ? ", block" + (v.taken_back.length > 1 ? "s " : " ") + v.taken_back.join(", ") +
                  " taken back" : ""));
    });
    if ((step.in_flight || []).length) {       // pipeline parallelism: the first one's output was taken in
      parts.push("in flight " + step.in_flight.map(batchText).join(" ") + ", took in " + batchText(step.in_flight[0]));
    }
    return parts.join(" · ") || "nothing scheduled";           // the list's number is the step
  }

  var lastLogged = null;
  function logSteps(steps) {
    var log = $("step-log");
    steps.forEach(function (step) {
      if (lastLogged !== null && step.step > lastLogged + 1) {   // steps no snapshot carried
        var gap = document.createElement("li");
        gap.className = "gap";
        gap.value = step.step - 1;
        gap.textContent = "… " + (step.step - lastLogged - 1) + " step" + (step.step - lastLogged > 2 ? "s" : "") +
          " not shown (more than a snapshot carries)";
        log.insertBefore(gap, log.firstChild);
      }
      lastLogged = step.step;
      var li = document.createElement("li");
      li.value = step.step;
      li.setAttribute("data-step", step.step);
      li.textContent = describe(step);
      if (step.preempted.length) li.className = "preempt";
      log.insertBefore(li, log.firstChild);
    });
    while (log.childNodes.length > LOG_LINES) log.removeChild(log.lastChild);
  }

  // -- sparklines ------------------------------------------------------------------------------
  function spark(id, values, format) {
    var el = $(id), max = Math.max.apply(null, values.concat([1e-9]));
    if (id !== "spark-tokens") max = 1;                        // fractions: 0..1
    var n = values.length, points = values.map(function (v, i) {
      var x = n > 1 ? (i * 120) / (n - 1) : 0;
      return x.toFixed(1) + "," + (23 - (22 * v) / max).toFixed(1);
    });
    el.querySelector("polyline").setAttribute("points", points.join(" "));
    var now = n ? values[n - 1] : 0;
    el.setAttribute("data-value", now);
    el.querySelector(".value").textContent = format(now);
  }

  function drawSparklines() {
    var pct = function (v) { return (100 * v).toFixed(1) + "%"; };
    var pick = function (k) { return history.map(function (h) { return +h[k] || 0; }); };
    spark("spark-tokens", pick("tokens_per_s"), function (v) { return v.toFixed(1); });
    spark("spark-kv", pick("kv_usage"), pct);
    spark("spark-hit", pick("prefix_cache_hit_rate"), pct);
  }

  // -- one snapshot ----------------------------------------------------------------------------
  function draw(s) {
    last = s;
    drawGpu(s);
    drawCpu(s);
    drawQueues(s);
    drawBlockTable(s);
    drawPipeline(s);
    var st = s.stats || {};
    $("stats").textContent = "step " + s.step + " · " + (st.num_preemptions || 0) + " preemptions · " +
      (st.num_copy_on_write || 0) + " copy-on-write";
    drawWeights(s.weight_bytes || {});
  }

  // "weights Q4_1 66.4 MB + Q8_0 30.1 MB + float32 0.1 MB = 96.6 MB", as messages.WeightsInfo.describe says it
  function drawWeights(bytes) {
    var names = Object.keys(bytes).sort(function (a, b) { return bytes[b] - bytes[a] || (a < b ? -1 : 1); });
    var total = names.reduce(function (sum, n) { return sum + bytes[n]; }, 0);
    var mb = function (b) { return (b / 1e6).toFixed(1) + " MB"; };
    var el = $("weights");
    el.setAttribute("data-bytes", names.length ? String(total) : "");
    el.setAttribute("data-formats", names.join(","));
    el.textContent = names.length ? "weights " + names.map(function (n) { return n + " " + mb(bytes[n]); }).join(" + ") +
      (names.length > 1 ? " = " + mb(total) : "") : "";
  }

  function status(state, text, step) {
    var el = $("status");
    el.setAttribute("data-state", state);
    if (step !== undefined) el.setAttribute("data-step", step);
    el.textContent = text;
  }

  // -- live: server-sent events ----------------------------------------------------------------
  function live() {
    // relative to the page's own path, so it works behind a prefix: /x/dashboard -> /x/dashboard/events.
    // No key in it: with --api-key, /dashboard?key= has set an HttpOnly cookie (auth.py), and
    // the browser sends it with this same-origin request by itself.
    var url = location.pathname.replace(/\/+$/, "") + "/events";
    var source = null, retry = null;
    function connect() {
      source = new EventSource(url);
      source.onopen = function () { status("live", "live", $("status").getAttribute("data-step")); };
      source.onmessage = function (e) {
        var s = JSON.parse(e.data);
        history.push(s.stats || {});
        if (history.length > HISTORY) history.shift();
        logSteps(s.steps || []);
        draw(s);
        drawSparklines();
        status("live", "live · step " + s.step, s.step);
      };
      source.onerror = function () {
        status("disconnected", "disconnected · retrying");
        // EventSource retries by itself unless the server refused it (CLOSED): then we do
        if (source.readyState === EventSource.CLOSED && retry === null) {
          retry = setTimeout(function () { retry = null; connect(); }, 2000);
        }
      };
    }
    connect();
  }

  // -- replay: the snapshots of a traced run, embedded in the page ------------------------------
  function replay(snapshots) {
    $("spark-tokens").hidden = true;      // the tracer's own wall-clock rate: it means nothing here
    var index = 0;
    $("replay-controls").hidden = false;
    function show(i) {
      index = Math.max(0, Math.min(snapshots.length - 1, i));
      var s = snapshots[index], from = Math.max(0, index - HISTORY + 1);
      history = snapshots.slice(from, index + 1).map(function (x) { return x.stats || {}; });
      $("step-log").textContent = "";
      lastLogged = null;
      snapshots.slice(Math.max(0, index - LOG_LINES + 1), index + 1).forEach(function (x) { logSteps(x.steps || []); });
      draw(s);
      drawSparklines();
      var pos = $("replay-position");
      pos.textContent = "step " + (index + 1) + " of " + snapshots.length;
      pos.setAttribute("data-index", index + 1);
      pos.setAttribute("data-count", snapshots.length);
      $("replay-prev").disabled = index === 0;
      $("replay-next").disabled = index === snapshots.length - 1;
      status("replay", "replay · engine step " + s.step, s.step);
    }
    $("replay-prev").addEventListener("click", function () { show(index - 1); });
    $("replay-next").addEventListener("click", function () { show(index + 1); });
    document.addEventListener("keydown", function (e) {
      if (e.key === "ArrowLeft") show(index - 1);
      else if (e.key === "ArrowRight") show(index + 1);
      else if (e.key === "Home") show(0);
      else if (e.key === "End") show(snapshots.length - 1);
    });
    if (snapshots.length) show(0);
    else status("replay", "replay · no steps");
  }

  if (Array.isArray(window.NANOPAGED_REPLAY)) replay(window.NANOPAGED_REPLAY);
  else live();
})();
