"""The runner's logits in bounded chunks of rows (issue 34; worker/logits_chunks.py): no
compute_logits call takes more rows than max_logits_bytes allows, and chunking changes
nothing: every row's logits are bit-identical to those of one call over all rows (the
kernels' matmul is batch-invariant: test_batch_invariance.py), and so are the tokens,
logprobs and prompt logprobs of the same requests run unchunked. The step mixes every
kind of row: forks of fresh n > 1 requests, seeded samples, greedy rows, a structured
output's masked rows, prompt-logprob rows, drafts to verify (speculative decoding: the
n-gram proposer, and a draft model, whose own logits are chunked too)."""
import pytest
import torch

from nanopaged import LLM, SamplingParams
from nanopaged.sampling_params import StructuredOutputsParams
from nanopaged.worker.logits_chunks import max_logits_rows, row_chunks

from conftest import TINY_VOCAB

pytestmark = pytest.mark.exactness

ROW = TINY_VOCAB * 4


def test_row_chunks_keep_items_whole_and_in_order():
    assert row_chunks([5, 6, 7, 8, 9], 2) == [[5, 6], [7, 8], [9]]
    assert row_chunks(list("abcd"), 4, sizes=[2, 3, 1, 5]) == [["a"], ["b", "c"], ["d"]]   # d alone: 5 > 4
    assert row_chunks([1, 2, 3], None) == [[1, 2, 3]] and row_chunks([], 2) == []
    assert max_logits_rows(3 * ROW + 7, TINY_VOCAB) == 3 and max_logits_rows(None, TINY_VOCAB) is None


def record_logits(model):
    """Wrap the model's compute_logits: every call's (hidden rows, logits) is kept."""
    calls = []
    compute = model.compute_logits

    def recorded(hidden):
        logits = compute(hidden)
        calls.append((hidden.clone(), logits.clone()))
        return logits
    model.compute_logits = recorded
    return calls, compute


def run(llm):
    prompts = ["Hello, my name is", "The capital of France is", list(range(30, 60)), "Paged attention",
               [5, 6, 7, 8] * 6]
    params = [SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, logprobs=3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=2, ignore_eos=True),
              SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=5, ignore_eos=True, prompt_logprobs=1),
              SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8,
                             structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe so"])),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)]      # repeats: drafts to verify
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.prompt_logprobs, [(c.token_ids, c.logprobs, c.text, c.finish_reason) for c in o.outputs])
            for o in outs]


@pytest.mark.parametrize("speculative", [None, "ngram", "draft_model"])
def test_chunked_logits_equal_unchunked_bit_for_bit(tiny_model_dir, speculative):
    spec = {None: None, "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3},
            "draft_model": {"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 3}}
    kw = dict(num_gpu_blocks=128, block_size=4, attention_backend="cpu", enable_prefix_caching=False,
              speculative_config=spec[speculative], dtype="float32")
    whole = LLM(str(tiny_model_dir), **kw)
    want = run(whole)
    chunked = LLM(str(tiny_model_dir), max_logits_bytes=3 * ROW, **kw)      # a request's n rows fit
    runner = chunked.engine.model_runner
    calls, compute = record_logits(runner.model)
    draft_calls, _ = record_logits(runner.proposer.model) if speculative == "draft_model" else ([], None)
    assert run(chunked) == want
    sizes = [len(h) for h, _ in calls]
    # three rows a call, but a verifying sequence's k + 1 = 4 rows (kept whole)
    assert max(sizes) <= (4 if speculative else 3) and sizes.count(3) > 3
    if draft_calls:                                        # the draft's greedy proposals, 3 rows at most
        assert max(len(h) for h, _ in draft_calls) == 3
    hidden, logits = torch.cat([h for h, _ in calls]), torch.cat([lg for _, lg in calls])
    assert torch.equal(compute(hidden), logits)            # one call over every row: the same bits
