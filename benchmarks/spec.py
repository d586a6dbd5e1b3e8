"""spec: speculative decoding vs plain decoding: output tokens/s of chat
requests, copy-heavy and plain, at batch 1 and batch 8, with n-gram proposals (prompt
lookup) and with a draft model made of the target's first layers (targets: n-gram
>= 1.5x at batch 1 on the copy-heavy workload, >= 0.95x on plain chat)."""
from __future__ import annotations

import tempfile
import time

PARAGRAPHS = [
    "The city council met on Tuesday evening to discuss the new bicycle lanes on Main Street. "
    "Several shop owners said the lanes would reduce parking for their customers, while a group "
    "of parents argued that safer streets would bring more families downtown. After two hours of "
    "debate, the council agreed to run a six month trial and to count visitors before and after.",
    "Photosynthesis is the process by which green plants turn light into chemical energy. Inside "
    "the leaves, chlorophyll absorbs sunlight and uses it to split water into oxygen and hydrogen. "
    "The hydrogen is then combined with carbon dioxide from the air to build sugars, which the "
    "plant stores and later burns for energy as it grows.",
    "Our team will move to the new office on the third floor next Monday. Please pack your desk "
    "into the boxes provided by Friday afternoon and label each box with your name and the number "
    "of your new desk. The movers arrive at eight in the morning, and the network will be down "
    "until noon while the cables are connected.",
    "The lighthouse stood at the end of a narrow rocky point, and for a hundred years its keeper "
    "climbed the spiral stairs every evening to light the lamp. When the light was finally "
    "automated, the keeper's cottage became a small museum, and visitors can now read his logbooks "
    "and see the brass lens that once guided ships past the reef.",
]
CODE = [
    "def total_price(items, x):\n    result = 0\n    for item in items:\n        result += item.price * x\n"
    "    if result > 100:\n        result = result * 0.9\n    return result\n",
    "def count_words(text):\n    x = {}\n    for word in text.split():\n        word = word.lower()\n"
    "        x[word] = x.get(word, 0) + 1\n    return x\n",
    "class Stack:\n    def __init__(self):\n        self.x = []\n\n    def push(self, value):\n"
    "        self.x.append(value)\n\n    def pop(self):\n        return self.x.pop()\n\n"
    "    def is_empty(self):\n        return len(self.x) == 0\n",
    "def find_max(x):\n    best = x[0]\n    for value in x[1:]:\n        if value > best:\n"
    "            best = value\n    return best\n",
]
COPY_TASKS = [
    ("Repeat this paragraph exactly, but change the word \"{w}\" to \"{r}\":\n\n{p}", p, w, r)
    for p, w, r in [(PARAGRAPHS[0], "Tuesday", "Wednesday"), (PARAGRAPHS[1], "green", "most"),
                    (PARAGRAPHS[2], "Monday", "Tuesday"), (PARAGRAPHS[3], "narrow", "long")]
] + [
    ("Rename the variable x to {r} in this code and show the whole code:\n\n```python\n{p}```", p, "x", r)
    for p, r in [(CODE[0], "factor"), (CODE[1], "counts"), (CODE[2], "items"), (CODE[3], "numbers")]
]
COPY_PROMPTS = [t.format(p=p, w=w, r=r) for t, p, w, r in COPY_TASKS]
CHAT_PROMPTS = [
    "What are three tips for sleeping better?",
    "Why is the sky blue?",
    "Give me a simple recipe for pancakes.",
    "What is the difference between a virus and a bacterium?",
    "How do I start learning to play the guitar?",
    "Explain what a black hole is to a ten year old.",
    "What should I pack for a weekend hiking trip?",
    "Why do leaves change color in the autumn?",
]


def _methods(args, draft_dir: str) -> dict[str, dict | None]:
    """name -> speculative_config (None: the baseline)."""
    methods: dict[str, dict | None] = {"off": None}
    for k in (int(k) for k in args.spec_k.split(",")):
        methods[f"ngram k={k}"] = {"method": "ngram", "num_speculative_tokens": k,
                                   "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    if args.spec_draft_layers:
        methods[f"draft {args.spec_draft_layers}L k={args.spec_draft_k}"] = {
            "method": "draft_model", "model": draft_dir, "num_speculative_tokens": args.spec_draft_k}
    return methods


STAT_KEYS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
             "num_steps")


def _run(llm, prompts, params, batch: int) -> tuple[float, list[list[int]], dict]:
    """Seconds, each request's output ids, and the spec-decode counters' growth, for
    `prompts` sent `batch` at a time (batch 1: one after another)."""
    before = llm.engine.get_stats()
    t = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), batch):
        outs += llm.generate(prompts[i:i + batch], params, use_tqdm=False)
    secs = time.perf_counter() - t
    after = llm.engine.get_stats()
    return secs, [list(o.outputs[0].token_ids) for o in outs], {k: after[k] - before[k] for k in STAT_KEYS}


def bench_spec(model, args) -> None:
    """Every method's engine (same settings but speculative_config) on two chat
    workloads, copy-heavy (repeat a paragraph with one word changed, rename a variable
    in a code snippet) and plain questions, at batch 1 (requests one at a time) and at
    batch 8 (all at once), greedy, eos honoured, max_tokens --spec-max-tokens.
    Interleaved: every engine runs one request (batch 1) or the 8 (batch 8) before the
    next request starts, in an order reversed each time; each request's (or batch's)
    best of --spec-rounds rounds counts. Output
    tokens/s of each method vs off, acceptance (accepted / proposed tokens), accepted
    tokens per verify step (+1: tokens per step for a row that was checked), and
    whether every output is token for token the baseline's (greedy: it must be)."""
    import torch
    from nanopaged import LLM, SamplingParams
    from nanopaged.engine.processor import apply_chat_template
    from nanopaged.spec_decode.draft_model import make_layer_draft

    common = dict(dtype=args.dtype, attention_backend=args.attention_backend,
                  enable_prefix_caching=False,          # rounds repeat the prompts: no cache hits
                  num_gpu_blocks=1024, num_cpu_blocks=64)
    base = LLM(model, **common)
    tok = base.get_tokenizer()
    n = args.spec_requests

    def chat_ids(texts):
        texts = (texts * (-(-n // len(texts))))[:n]
        return [apply_chat_template(tok, [{"role": "user", "content": t}]) for t in texts]
    workloads = {"copy": chat_ids(COPY_PROMPTS), "chat": chat_ids(CHAT_PROMPTS)}
    batches = [int(b) for b in args.spec_batches.split(",")]
    params = SamplingParams(temperature=0, max_tokens=args.spec_max_tokens)
    with tempfile.TemporaryDirectory() as draft_dir:
        if args.spec_draft_layers:
            make_layer_draft(base.engine.model_path, draft_dir, args.spec_draft_layers)
        engines = {name: (base if cfg is None else LLM(model, speculative_config=cfg, **common))
                   for name, cfg in _methods(args, draft_dir).items()}
        print(f"spec: model {base.engine.model_path.name}, dtype {args.dtype}, torch threads "
              f"{torch.get_num_threads()}, {n} requests per workload (prompts "
              + ", ".join(f"{w} {sum(map(len, p)) / len(p):.0f}" for w, p in workloads.items())
              + f" tokens on average), max_tokens {args.spec_max_tokens}, greedy, eos honoured; "
              f"engines: {', '.join(engines)}; best of {args.spec_rounds} interleaved rounds")
        for llm in engines.values():                                       # warm-up
            for ids in workloads.values():
                llm.generate(ids[:2], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        rows = []
        for wname, prompts in workloads.items():
            for batch in batches:
                # Interleaved per unit (one request at batch 1, 8 at batch 8): every engine
                # runs a unit before the next unit starts, so a slow minute of this shared
                # machine hits all engines alike; each unit's best of the rounds counts.
                units = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
                best = {name: [float("inf")] * len(units) for name in engines}
                ids = {name: [None] * len(units) for name in engines}
                stats = {name: dict.fromkeys(STAT_KEYS, 0) for name in engines}
                order = list(engines)
                for r in range(args.spec_rounds):
                    for u, unit in enumerate(units):
                        for name in (order if (r + u) % 2 == 0 else order[::-1]):
                            secs, out, st = _run(engines[name], unit, params, batch)
                            best[name][u] = min(best[name][u], secs)
                            if r == 0:
                                ids[name][u] = out
                                for k in STAT_KEYS:
                                    stats[name][k] += st[k]
                            elif out != ids[name][u]:
                                ids[name][u] = "irreproducible"
                best = {name: sum(b) for name, b in best.items()}
                tokens = sum(len(o) for unit in ids["off"] for o in unit)
                for name in engines:
                    if name == "off":
                        continue
                    st = stats[name]
                    rows.append(dict(workload=wname, batch=batch, method=name, tokens=tokens,
                                     off=tokens / best["off"], on=tokens / best[name],
                                     drafts=st["spec_decode_num_drafts"],
                                     proposed=st["spec_decode_num_draft_tokens"],
                                     accepted=st["spec_decode_num_accepted_tokens"],
                                     steps=st["num_steps"], steps_off=stats["off"]["num_steps"],
                                     same=ids[name] == ids["off"]))
                    _print_row(rows[-1])
    _print_summary(rows)


def _print_row(r: dict) -> None:
    ratio = r["on"] / r["off"]
    acc = r["accepted"] / r["proposed"] if r["proposed"] else 0.0
    per = r["accepted"] / r["drafts"] if r["drafts"] else 0.0
    same = "same" if r["same"] else "DIFFERENT!"
    print(f"spec {r['workload']:<4} b{r['batch']:<2} {r['method']:<13} off {r['off']:6.1f} tok/s  on {r['on']:6.1f} "
          f"tok/s  {ratio:5.2f}x  accept {100 * acc:5.1f}%  accepted/step {per:4.2f} (+1 = {per + 1:4.2f} "
          f"tok/step)  steps {r['steps']} vs {r['steps_off']}  {r['tokens']} tokens  {same}")


def _print_summary(rows: list[dict]) -> None:
    differ = [r for r in rows if not r["same"]]
    if differ:
        print("!" * 78)
        print("spec: OUTPUTS DIFFER from the baseline (greedy must match token for token): "
              + ", ".join(f"{r['workload']} b{r['batch']} {r['method']}" for r in differ))
        print("!" * 78)
    else:
        print(f"spec: every output of every method is token for token the baseline's ({len(rows)} rows)")
    for r in rows:                      # the targets: n-gram >= 1.5x on copy at batch 1, >= 0.95x on chat
        if not r["method"].startswith("ngram") or (r["workload"] == "copy" and r["batch"] != 1):
            continue
        ratio = r["on"] / r["off"]
        goal = 1.5 if r["workload"] == "copy" else 0.95
        print(f"target {r['workload']} b{r['batch']} {r['method']}: {ratio:.3f}x (target >= {goal}x): "
              f"{'met' if ratio >= goal else 'MISSED'}")
