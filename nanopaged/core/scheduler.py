"""Scheduler: each step, decide which requests run and how many tokens each computes;
after the step, take in what the model produced.

Continuous batching (Orca, OSDI'22; the PagedAttention paper §4.5): the batch is rebuilt
every step. `schedule()` runs in three phases, each its own function:

    _schedule_running   running requests first, oldest first: one more token each (a
                        decode), or the next chunk of a prompt; preempting the latest
                        arrivals when blocks run out
    _schedule_swapped   swapped-out requests come back, oldest first, when they fit
    _schedule_waiting   then waiting requests join, strictly first come first served

within the step's limits: max_num_seqs requests, max_num_batched_tokens tokens computed
(a prompt that does not fit is chunked over several steps), and the free blocks. When
a running request needs a block and none is free, the request that arrived last is
preempted (vLLM's policy: the oldest always make progress), by *swap* (its blocks go to
a CPU pool, and come back before any new request is admitted) or by *recompute* (they
are freed; it recomputes prompt + output in one prefill when readmitted; paper §4.5);
"auto" picks the cheaper by costs measured at start.

The decision leaves as a self-contained SchedulerOutput (messages.py): the runner never
sees a Sequence. `update_from_output()` is the step's other half: it advances
num_computed_tokens, names the blocks the forward filled in the prefix cache, appends
sampled tokens, checks stop conditions (stop_checker.py), forks the n > 1 siblings and
beams, and frees what finished. So the scheduler is the only writer of blocks and
sequences. Its books (which requests, in which queue, how they come and go) are
request_queues.py; the step it builds, scheduler_output.py.

With async scheduling (chapters/16-async-scheduling.md; vLLM v1's AsyncScheduler) the
next schedule() runs before this step's output is in: a sequence that samples in a step
gets a placeholder (`num_output_placeholders`), its num_computed_tokens counts the
step's positions at once, and update_from_output reconciles. After a step that forks or
advances beams, the next schedule() waits (`can_schedule_ahead`).
vLLM: `vllm/v1/core/sched/scheduler.py`; v0's `vllm/core/scheduler.py` for swapping.
"""
from __future__ import annotations

from collections import deque

from ..config import SpeculativeConfig
from ..events import DraftsVerified, Preempted
from ..messages import (EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason, Logprobs,
                        ModelRunnerOutput, PreemptionCosts, SchedulerOutput)
from .beam_search import beam_search_step, finished_outputs
from .block_manager import BlockManager
from .request_queues import RequestQueues
from .scheduler_output import ScheduledSequence, ScheduledStep
from .sequence import Sequence, SequenceGroup, SequenceStatus
from .spec_decode import SpecDecodingStats, slot_plans, take_drafts
from .stop_checker import check_grammar_stop, check_stop
from .structured_output import StructuredOutputManager


class Scheduler(RequestQueues):
    """FCFS continuous-batching scheduler with a token budget, chunked prefill and
    preemption by swap or recompute; the owner of every Sequence and block change. Its
    queues and the requests' coming and going are its base, RequestQueues.

    Args:
        block_manager: the device pool's BlockManager.
        max_num_seqs: most requests in one step's batch.
        max_num_batched_tokens: most tokens computed in one step (the token budget).
        max_model_len: a sequence stops when prompt + output reach it (tokens).
        enable_chunked_prefill: compute a prompt that does not fit in what is left of the
            budget over several steps, num_computed_tokens advancing chunk by chunk.
        preemption_mode: "recompute", "swap" or "auto" (the cheaper one, by `costs`).
        costs: measured PreemptionCosts, needed by "auto".
        async_scheduling: schedule() may run while the previous step's forward does
            (vLLM v1's AsyncScheduler): a sequence that samples in a step gets a
            placeholder for that token, and num_computed_tokens counts a step's tokens
            as soon as it is scheduled; update_from_output reconciles. The runner then
            appends its own samples, so they are not sent back to it.
        structured_output_manager: compiles the matchers of requests with
            structured outputs and fills their bitmasks (structured_output.py); None
            makes such requests a ValueError at add_request.
        speculative_config: speculative decoding (None: off). A decoding sequence
            verifies the drafts the runner proposed for it (seq.spec_token_ids) in its
            next step; the draft model also gets num_lookahead_tokens slots past a
            sampling sequence's tokens. See spec_decode.py and _verified.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_chunked_prefill: bool = True,
                 preemption_mode: str = "recompute", costs: PreemptionCosts | None = None,
                 async_scheduling: bool = False,
                 structured_output_manager: StructuredOutputManager | None = None,
                 speculative_config: SpeculativeConfig | None = None) -> None:
        super().__init__(block_manager, async_scheduling, structured_output_manager)
        self.speculative_config = speculative_config
        self.num_lookahead_tokens = speculative_config.num_lookahead_tokens if speculative_config else 0
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.preemption_mode = preemption_mode
        self.costs = costs
        self.async_scheduling = async_scheduling
        # the last scheduled step decides something the next schedule() depends on (see
        # can_schedule_ahead)
        self._waits_for_output = False
        self.num_preemptions = self.num_preemptions_swap = self.num_preemptions_recompute = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens_computed = 0             # prefill work done (cache hits excluded)
        self.spec_decoding_stats = SpecDecodingStats()

    def add_request(self, request: EngineCoreRequest) -> None:
        """RequestQueues.add_request; also a ValueError for beam search with speculative
        decoding (beams advance one token a step together; drafts do not fit that)."""
        if request.beam_search is not None and self.speculative_config is not None:
            raise ValueError("beam search does not work with speculative_config "
                             f"(method {self.speculative_config.method!r}): use one or the other")
        super().add_request(request)

    # -- async scheduling -------------------------------------------------------------------

    def can_schedule_ahead(self) -> bool:
        """Async scheduling: may the next schedule() run before the output of the step
        scheduled last has been taken in? Not when that step forks (the other n - 1
        samples of a request whose prompt it completes get their blocks from the fork,
        in update_from_output) or advances a beam search (which tokens the beams keep,
        and which blocks they share, is decided there too). Then the engine waits for
        that one step's output before it schedules the next (synchronous for a step)."""
        return not self._waits_for_output

    def reset_after_failure(self, lost: list[SchedulerOutput]) -> None:
        """RequestQueues.reset_after_failure, and nothing waits for a lost step."""
        super().reset_after_failure(lost)
        self._waits_for_output = False

    # -- schedule(): the three phases -------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Build this step's batch; mutates queues and block tables (see the module doc)."""
        step = ScheduledStep(budget=self.max_num_batched_tokens)
        self._schedule_running(step)
        self._schedule_swapped(step)
        self._schedule_waiting(step)
        if self.observers:               # the block manager's observers: see events.py
            self.observers.publish(*(s.event() for s in step.scheduled))
        return self._scheduler_output(step)

    def _schedule_running(self, step: ScheduledStep) -> None:
        """Running requests, oldest first: a decode needs a slot for its next token, a
        chunked prefill goes on with as much of its prompt as the budget allows."""
        kept: deque[SequenceGroup] = deque()
        while self.running:
            group = self.running.popleft()
            running = [s for s in group.get_seqs(SequenceStatus.RUNNING) if not self._ends_in_flight(s, group)]
            if not running:                  # each one's last token is being sampled
                kept.append(group)
                continue
            seqs = [s for s in group.seqs_to_compute(SequenceStatus.RUNNING) if s in running]
            forks = [s for s in running if s not in seqs]
            work = [(s, self._chunk(s.num_uncomputed_tokens, step.budget)) for s in seqs]
            # Out of budget: it keeps its blocks and waits a step. (A request whose n
            # sequences alone exceed the whole budget runs in a step of its own.)
            if any(n == 0 for _, n in work) or (sum(n for _, n in work) > step.budget and step.scheduled):
                kept.append(group)
                continue
            ends = [s.num_computed_tokens + n for s, n in work]
            before = [list(s.block_table.block_ids) for s in seqs]
            copies = None
            drafts = take_drafts(group, work, step.budget - sum(n for _, n in work), self.max_model_len)
            for drafts, extra in slot_plans(work, drafts, self.num_lookahead_tokens):   # the best that fits
                copies = self.block_manager.append_slots(seqs, [e + x for e, x in zip(ends, extra)])
                if copies is not None:
                    break
            while copies is None and self.running:
                self._preempt(self.running.pop(), step)     # evict the latest arrival
                copies = self.block_manager.append_slots(seqs, ends)
            if copies is None:
                if kept:
                    self._preempt(group, step)   # it is the latest arrival left: itself
                elif any(s.num_output_placeholders for s in group.seqs):
                    # async: a sibling may stop with the token in flight and free its
                    # blocks; whether it fits is decided when that token is known
                    kept.append(group)
                else:
                    self._finish_too_long(group)
                continue
            step.blocks_to_copy += copies
            for (seq, n), ids, d in zip(work, before, drafts):     # copy-on-write replaces a last block
                replaced = seq.block_table.block_ids[:len(ids)] != ids
                step.add(ScheduledSequence(seq, group, n + len(d), forks, len(ids), replaced, d))
            kept.append(group)
        self.running = kept

    def _schedule_swapped(self, step: ScheduledStep) -> None:
        """Swapped-out requests come back, oldest first, when their blocks fit (with one
        block of headroom per sequence, so they are not preempted again at once). They
        run from the next step; the copies happen before this step's forward."""
        while (self.swapped and not step.preempted and len(self.running) < self.max_num_seqs
               and self.block_manager.can_swap_in(self.swapped[0],
                                                  headroom=len(self.swapped[0].seqs) if self.running else 0)):
            group = self.swapped.popleft()
            step.blocks_to_swap_in += self.block_manager.swap_in(group)
            for seq in group.get_seqs(SequenceStatus.SWAPPED):
                seq.status = SequenceStatus.RUNNING
                self.runner_view.forget(seq.seq_id)      # every block moved
            self._add_running(group)

    def _schedule_waiting(self, step: ScheduledStep) -> None:
        """Waiting requests join the batch strictly in order (FCFS: never skip ahead of
        the head) while the step has room: fewer than max_num_seqs running, token budget
        left (step.budget; a lone sequence's prompt is cut to fit by _chunk) and free
        blocks (allocate says None when they are short). Nobody joins while a request is
        swapped out, nor in a step that had to preempt: memory is tight, admitting more
        would only cause more preemption (vLLM too). A request the whole pool can never
        hold is finished (_finish_too_long) instead of blocking the queue forever."""
        while (self.waiting and not step.preempted and not self.swapped
               and len(self.running) < self.max_num_seqs):
            group = self.waiting[0]
            computed = self.block_manager.get_computed_blocks(group)   # cache hits: not computed
            if computed.never_fits:
                self.waiting.popleft()            # can never fit again; see _finish_too_long
                self._finish_too_long(group)
                continue
            first, *rest = group.seqs_to_compute()
            first_tokens = first.num_tokens - computed.num_computed_tokens
            rest_tokens = sum(s.num_tokens - computed.num_shared_tokens for s in rest)
            # Only a lone sequence is chunked. A recomputed n > 1 request may need more
            # than the whole budget: it then runs in a step of its own rather than never.
            n_first = first_tokens if rest else self._chunk(first_tokens, step.budget)
            if n_first == 0 or (n_first + rest_tokens > step.budget and step.scheduled):
                break
            first_end = computed.num_computed_tokens + n_first
            starts = None
            if self.num_lookahead_tokens and first_end == first.num_tokens:   # the draft's slots, if they fit
                starts = self.block_manager.allocate(group, computed, first_end + self.num_lookahead_tokens)
            if starts is None:
                starts = self.block_manager.allocate(group, computed, first_end)
            if starts is None:                    # not enough free blocks: wait
                break
            self.waiting.popleft()
            self._admit(step, group, first_end, starts)

    def _admit(self, step: ScheduledStep, group: SequenceGroup, first_end: int, starts: list[int]) -> None:
        """A waiting request joins, its blocks allocated: each sequence to compute starts
        at starts[i] (its cache hit or shared prompt), its first sequence computes up to
        first_end; it is put in this step's batch and in the running queue."""
        first, *rest = group.seqs_to_compute()
        forks = [s for s in group.get_seqs(SequenceStatus.WAITING) if s is not first and s not in rest]
        for seq, start in zip([first, *rest], starts):
            seq.num_computed_tokens = start
        if not first.output_token_ids:
            group.num_cached_tokens = first.num_computed_tokens
        for seq in group.get_seqs(SequenceStatus.WAITING):
            seq.status = SequenceStatus.RUNNING
        for seq in [first, *rest]:
            self.runner_view.forget(seq.seq_id)      # (re)starts: send it in full
            n = (first_end if seq is first else seq.num_tokens) - seq.num_computed_tokens
            step.add(ScheduledSequence(seq, group, n, forks if seq is first else []))
        self._add_running(group)

    def _scheduler_output(self, step: ScheduledStep) -> SchedulerOutput:
        """Turn the step into the runner's message (RunnerView.message: what it has not
        seen in full, the rest as deltas). With async scheduling the step's tokens count
        as computed from now on, and each sample gets a placeholder."""
        samples = [s.samples() for s in step.scheduled]       # before anything counts
        out = self.runner_view.message(step.scheduled, samples, step.blocks_to_copy, step.blocks_to_swap_out,
                                       step.blocks_to_swap_in)
        out.scheduled_spec_decode_tokens = {s.seq.seq_id: list(s.spec_token_ids)
                                            for s in step.scheduled if s.spec_token_ids}
        self._waits_for_output = any(sample and (s.seq_group.beam_state is not None or s.forks)
                                     for s, sample in zip(step.scheduled, samples))
        if self.async_scheduling:
            for s, sample in zip(step.scheduled, samples):
                s.seq.num_computed_tokens += s.num_new_tokens
                s.seq.num_output_placeholders += sample
                for fork in s.forks if sample else []:
                    fork.num_output_placeholders += 1
        return out

    def _chunk(self, num_tokens: int, budget: int) -> int:
        """Tokens of a prefill computed this step: all of them, or with chunked prefill
        as many as the budget has left, never fewer than 0 (the budget can be negative
        once a step is full). Decodes never come here: 1 token is never cut."""
        return min(num_tokens, max(budget, 0)) if self.enable_chunked_prefill else num_tokens

    def _ends_in_flight(self, seq: Sequence, group: SequenceGroup) -> bool:
        """Async scheduling: the token a step in flight samples for seq is surely its
        last (check_stop's length rules: max_tokens, max_model_len), so it must not be
        scheduled again: that step would compute the token's K/V and sample a next
        token only to throw it away. False when nothing is in flight for seq."""
        k = seq.num_output_placeholders
        return k > 0 and (len(seq.output_token_ids) + k >= group.sampling_params.max_tokens
                          or seq.num_tokens + k >= self.max_model_len)

    def _preempt(self, group: SequenceGroup, step: ScheduledStep) -> None:
        """Free a running request's device blocks by swap or by recompute (see the
        module doc); either way it goes to the head of its queue.

        It counts (num_preemptions, and num_preemptions_swap or _recompute), marks the
        step as one that preempted (step.preempted: nobody is admitted or swapped in
        then), and forgets what the runner knows of its running sequences (they are
        sent in full when they run again). Swap (_should_swap): swap_out's (device, cpu)
        pairs join step.blocks_to_swap_out, the running sequences become SWAPPED, the
        request goes to the head of self.swapped. Recompute: each running sequence's
        blocks are freed, its num_computed_tokens set to 0 and its status to WAITING;
        the request goes to the head of self.waiting."""
        self.num_preemptions += 1
        step.preempted = True
        swap = self._should_swap(group)
        if self.observers:
            self.observers.publish(Preempted(group.request_id, "swap" if swap else "recompute"))
        running = group.get_seqs(SequenceStatus.RUNNING)
        for seq in running:
            self.runner_view.forget(seq.seq_id)
            seq.spec_token_ids = []
        if swap:
            step.blocks_to_swap_out += self.block_manager.swap_out(group)
            for seq in running:
                seq.status = SequenceStatus.SWAPPED
            self.swapped.appendleft(group)
            self.num_preemptions_swap += 1
            return
        for seq in running:
            self.block_manager.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(group)
        self.num_preemptions_recompute += 1

    def _should_swap(self, group: SequenceGroup) -> bool:
        """Preempt `group` by swap (True) or by recompute (False)? "recompute" mode never
        swaps. In every mode a request whose blocks the CPU pool cannot take
        (block_manager.can_swap_out) is recomputed. "swap" mode swaps otherwise; "auto"
        asks self.costs.prefer_swap(the distinct device blocks of its running sequences,
        their num_computed_tokens together)."""
        if self.preemption_mode == "recompute" or not self.block_manager.can_swap_out(group):
            return False
        if self.preemption_mode == "swap":
            return True
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        num_blocks = len({b for s in seqs for b in s.block_table.block_ids})
        return self.costs.prefer_swap(num_blocks, sum(s.num_computed_tokens for s in seqs))

    # -- update_from_output(): the step's other half ----------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        """Take in one forward's results: advance num_computed_tokens, name the blocks it
        filled in the prefix cache, fork, append tokens, stop, free. Returns an
        EngineCoreOutput per sequence that got a token, prompt logprobs, or finished."""
        result = EngineCoreOutputs()
        c = scheduler_output.scheduled_cached_reqs      # where each sequence started
        starts = dict(zip(c.seq_ids, c.num_computed_tokens))
        starts.update((r.seq_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs)
        spec = scheduler_output.scheduled_spec_decode_tokens
        for seq_id, n in scheduler_output.num_scheduled_tokens.items():
            if n and seq_id in self._seqs:
                # the positions of rejected drafts are not computed: rolled back here
                rejected = len(spec.get(seq_id, ())) - runner_output.num_accepted_tokens.get(seq_id, 0)
                self._computed(*self._seqs[seq_id], starts[seq_id], n - rejected, runner_output, result)
        for seq_id, parent in scheduler_output.sample_from.items():
            # prefill done: the other n - 1 fork it, before any token is appended (its
            # own first token may finish it, and a finished sequence holds no blocks)
            if seq_id in self._seqs and seq_id in runner_output.sampled_token_ids \
                    and not self._seqs[seq_id][0].status.is_finished:
                self._fork(self._seqs[parent][0], self._seqs[seq_id][0])
        beam_groups = {}
        for seq_id, token in runner_output.sampled_token_ids.items():
            if seq_id not in self._seqs:
                continue                      # aborted while the step ran
            seq, group = self._seqs[seq_id]
            if self.async_scheduling:
                seq.num_output_placeholders -= 1
            if seq.status.is_finished:
                # async: it stopped (eos, stop string, a sibling's abort...) after this
                # step was scheduled: the extra token is discarded, never appended
                continue
            if group.beam_state is not None:
                beam_groups[group.request_id] = group
                continue                      # beams advance together, below
            accepted = spec.get(seq_id, [])[:runner_output.num_accepted_tokens.get(seq_id, 0)]
            self._append_tokens(seq, group, accepted + [token], runner_output.logprobs.get(seq_id), result)
        for group in beam_groups.values():
            self._beam_step(group, runner_output, result)
        for seq_id, n in scheduler_output.num_scheduled_tokens.items():
            if seq_id in self._seqs and (seq_id in spec or self.num_lookahead_tokens):
                self._verified(*self._seqs[seq_id], starts[seq_id], spec.get(seq_id, []), runner_output)
        for seq_id, drafts in runner_output.draft_token_ids.items():
            if seq_id in self._seqs and self._seqs[seq_id][0].status == SequenceStatus.RUNNING:
                self._seqs[seq_id][0].spec_token_ids = list(drafts)     # for its next step
        self._remove_finished(scheduler_output.num_scheduled_tokens, result)
        return result

    def _verified(self, seq: Sequence, group: SequenceGroup, start: int, drafts: list[int],
                  runner_output: ModelRunnerOutput) -> None:
        """Speculative decoding, after seq's new tokens are appended: count its drafts,
        name the blocks its accepted tokens filled (only now are their tokens known:
        a block is named only when every slot holds an accepted token), and take back
        the blocks that hold only rejected slots or lookahead."""
        if drafts:
            accepted = runner_output.num_accepted_tokens.get(seq.seq_id, 0)
            self.spec_decoding_stats.observe(len(drafts), accepted)
            if self.observers:
                self.observers.publish(DraftsVerified(group.request_id, seq.seq_id, start, tuple(drafts), accepted,
                                                      seq.num_computed_tokens))
        if seq.status != SequenceStatus.RUNNING:
            return                                # finished: its blocks are freed already
        self.block_manager.cache_full_blocks(seq, start, seq.num_computed_tokens)
        self.block_manager.free_slots_past_computed(seq)

    def _computed(self, seq: Sequence, group: SequenceGroup, start: int, n: int,
                  runner_output: ModelRunnerOutput, result: EngineCoreOutputs) -> None:
        """Positions [start, start + n) of seq now have K/V in the cache."""
        num_prompt = len(seq.prompt_token_ids)
        self.num_prompt_tokens_computed += max(0, min(start + n, num_prompt) - start)
        if not self.async_scheduling:
            seq.num_computed_tokens += n     # (async: counted when it was scheduled)
        if seq.status == SequenceStatus.RUNNING:
            # (async: a sequence preempted, stopped or aborted while the step ran has
            # no blocks of its own in the device pool to name any more)
            self.block_manager.cache_full_blocks(seq, start, start + n)
        lp = runner_output.prompt_logprobs.get(seq.seq_id)
        if lp is not None:                    # row j: the prompt token at start + 1 + j
            skip = max(0, seq.num_prompt_logprobs - start)     # a recompute repeats rows
            rows = lp.token_ids[skip:]
            if rows:
                seq.num_prompt_logprobs = start + skip + len(rows)
                sliced = type(lp)(rows, lp.logprobs[skip:], lp.ranks[skip:])
                result.outputs.append(EngineCoreOutput(group.request_id, seq.index, [], new_prompt_logprobs=sliced,
                                                       num_cached_tokens=group.num_cached_tokens))

    def _append_tokens(self, seq: Sequence, group: SequenceGroup, tokens: list[int],
                       logprobs: Logprobs | None, result: EngineCoreOutputs) -> None:
        """Append a step's tokens to seq (one, or accepted drafts and one more), each
        checked for a stop: tokens after the one that finishes it are dropped."""
        for i, token in enumerate(tokens):
            seq.append_token(token)
            self.num_generated_tokens += 1
            status = check_stop(seq, group, self.max_model_len)
            status = check_grammar_stop(seq, group.request_id, token) or status   # the grammar's word wins
            if status is not None:
                self._finish_seq(seq, status)            # its siblings may run on
                tokens = tokens[:i + 1]
                break
        if logprobs is not None and len(logprobs.ranks) > len(tokens):
            logprobs = Logprobs(logprobs.token_ids[:len(tokens)], logprobs.logprobs[:len(tokens)],
                                logprobs.ranks[:len(tokens)])
        result.outputs.append(EngineCoreOutput(
            group.request_id, seq.index, tokens, new_logprobs=logprobs,
            finish_reason=FinishReason(seq.status.finish_reason) if seq.status.is_finished else None,
            stop_reason=seq.stop_reason, num_cached_tokens=group.num_cached_tokens))

    def _fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares parent's blocks (BlockManager.fork) and has computed what the
        parent has: a new sample of n > 1, or a surviving beam."""
        self.block_manager.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens

    def _beam_step(self, group: SequenceGroup, runner_output: ModelRunnerOutput,
                   result: EngineCoreOutputs) -> None:
        """Extend a beam-search request by one token per beam (beam_search.py), from the
        top logprobs the runner returned for each beam."""
        beams = group.get_seqs(SequenceStatus.RUNNING)
        if not all(b.seq_id in runner_output.logprobs for b in beams):
            return                       # not sampled this step (e.g. mid-recompute)
        candidates = {b.seq_id: runner_output.logprobs[b.seq_id] for b in beams}
        forked = beam_search_step(group, candidates, group.request.eos_token_ids, self.max_model_len,
                                  self._fork)
        for seq_id in forked:
            self.runner_view.forget(seq_id)
        if self.async_scheduling:            # the runner appended the token it sampled,
            for seq in beams:                # which a beam may not have kept: resend all
                self.runner_view.forget(seq.seq_id)
        self.num_generated_tokens += len(beams)
        if group.beam_state.done:
            for seq in beams:
                self._finish_seq(seq, SequenceStatus.FINISHED_STOPPED)
            result.outputs += finished_outputs(group)
