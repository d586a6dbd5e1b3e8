"""TEMPORARY shim; replaced by the output branch."""
from dataclasses import dataclass, field

from .detokenizer import IncrementalDetokenizer
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import RequestOutputKind


@dataclass
class OutputProcessorOutput:
    request_outputs: list = field(default_factory=list)
    seqs_to_stop: list = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.reqs = {}

    def add_request(self, request, prompt, n):
        self.reqs[request.request_id] = (request, prompt, [dict(ids=[], text="", fin=None, stop=None,
                                         det=IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids)) for _ in range(n)])

    def abort_requests(self, ids):
        for i in ids:
            self.reqs.pop(i, None)

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def process_outputs(self, outs):
        touched = {}
        for o in outs.outputs:
            if o.request_id not in self.reqs:
                continue
            req, prompt, seqs = self.reqs[o.request_id]
            s = seqs[o.index]
            if req.beam_search is not None:
                s["ids"] = o.new_token_ids
                s["text"] = self.tokenizer.decode(o.new_token_ids, skip_special_tokens=True)
                s["cum"], s["score"] = o.cumulative_logprob, o.score
            else:
                for t in o.new_token_ids:
                    s["ids"].append(t)
                    s["text"] += s["det"].step(t)
            if o.finish_reason is not None:
                s["fin"], s["stop"] = str(o.finish_reason), o.stop_reason
            touched[o.request_id] = True
        result = OutputProcessorOutput()
        for rid in touched:
            req, prompt, seqs = self.reqs[rid]
            finished = all(s["fin"] for s in seqs)
            if req.sampling_params.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
                continue
            result.request_outputs.append(RequestOutput(rid, prompt, req.prompt_token_ids, [
                CompletionOutput(i, s["text"], list(s["ids"]), s["fin"], cumulative_logprob=s.get("cum"))
                for i, s in enumerate(seqs)], finished))
            if finished:
                del self.reqs[rid]
        return result
