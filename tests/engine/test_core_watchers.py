"""The core process's watchers (engine_core_client.CoreWatcher, issue 35): a WATCH message
starts one, built in the core's process by the factory it names; its payloads ride in
EngineCoreOutputs.watcher_outputs after each message's outputs and before the loop rests;
it may wake a resting loop; WATCH with None stops it. Nothing here is the dashboard's."""
import os
import pickle
import threading
import time

import pytest
import zmq

from nanopaged import EngineConfig, LLMEngine, SamplingParams
from nanopaged.engine.engine_core_client import EngineCoreProc
from nanopaged.messages import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType

pytestmark = pytest.mark.timeout(120)


class Recorder:
    """A watcher that says which hook the loop called: after a step or news, before a rest
    (once per change), and once more when the test asks it to wake the loop."""

    def __init__(self):
        self.watched = self.unwatched = 0
        self.owed = False
        self.wake = False

    def watch(self, engine_core):
        self.watched += 1

    def unwatch(self, engine_core):
        self.unwatched += 1

    def after_step(self, engine_core, stepped):
        self.owed = True
        return ("after", stepped, engine_core.num_steps)

    def before_rest(self, engine_core):
        if self.wake:
            self.wake = False
            return "woken"
        owed, self.owed = self.owed, False
        return "rest" if owed else None

    def wants_wake(self):
        return self.wake


def test_a_watcher_adds_payloads_after_steps_and_before_rests_and_can_wake_the_loop(tiny_model_dir, tmp_path):
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_gpu_blocks=32, block_size=4,
                                 attention_backend="torch", num_cpu_blocks=0))
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind(f"ipc://{tmp_path}/in")
    pull.bind(f"ipc://{tmp_path}/out")
    proc = EngineCoreProc(eng.engine_core, f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out", os.getppid())
    loop = threading.Thread(target=proc.run, daemon=True)
    loop.start()

    def send(kind, payload):
        push.send(pickle.dumps((kind, payload)))

    def receive() -> EngineCoreOutputs:
        assert pull.poll(10_000), "the core's loop sent nothing for 10 s"
        return pickle.loads(pull.recv())

    try:
        send(EngineCoreRequestType.WATCH, ("rec", Recorder))
        assert receive().watcher_outputs == {"rec": ("after", False, 0)}       # news, no step
        rest = receive()                                                        # then it rests
        assert rest.watcher_outputs == {"rec": "rest"} and rest.scheduler_stats is not None
        recorder = proc.watchers["rec"]
        send(EngineCoreRequestType.WATCH, ("rec", Recorder))                   # again: the same one
        assert receive().watcher_outputs == {"rec": ("after", False, 0)} and proc.watchers == {"rec": recorder}
        assert receive().watcher_outputs == {"rec": "rest"} and recorder.watched == 2

        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        send(EngineCoreRequestType.ADD, EngineCoreRequest("a", [1, 2, 3], params, frozenset(), time.monotonic()))
        assert [receive().watcher_outputs for _ in range(3)] == [{"rec": ("after", True, n)} for n in (1, 2, 3)]
        assert receive().watcher_outputs == {"rec": "rest"}

        recorder.wake = True                                                    # wakes the resting loop
        assert receive().watcher_outputs == {"rec": "woken"}

        send(EngineCoreRequestType.WATCH, ("rec", None))
        assert receive().watcher_outputs == {} and proc.watchers == {} and recorder.unwatched == 1
        send(EngineCoreRequestType.SHUTDOWN, None)
        loop.join(10)
        assert not loop.is_alive()
    finally:
        if loop.is_alive():
            send(EngineCoreRequestType.SHUTDOWN, None)
            loop.join(10)
        for sock in (push, pull, proc.input, proc.output):
            sock.close(linger=0)
        ctx.term()
        proc.ctx.term()
