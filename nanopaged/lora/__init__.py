"""Multi-LoRA serving: many low-rank adapters on one base model, each row of a batch with
its own (Punica, Chen et al. 2023; S-LoRA, Sheng et al. 2023; vLLM: `vllm/lora/`). Its
parts: adapter.py (PEFT folders, read and checked), processor.py, scheduler.py (the
slots: who holds which, who may run), worker.py, model_runner.py, model.py (the slots'
tensors around each projection), punica.py and kernels.py (the batched LoRA matmuls);
messages.py, its messages; serving.py (adapters as models of the OpenAI server, a row of
its server features' table) and random_adapter.py (a random PEFT adapter, for the
tracer's scenario and the tests).

How it joins the base (features.py, the "LoRA adapters" row): LoRAProcessor
(process_inputs, _check_lora_request), LoRAScheduler (_make_group, _request_removed,
schedule, _can_join, _after_schedule), LoRAWorker (__init__: the slots after the
weights), LoRAModelRunner (_update_states, prepare_inputs, measure_preemption_costs), LoRAModel
(set_ops, create_lora_slots, load_lora_slot); the hooks in parentheses. The doors
(LLM.generate, LLM.chat, AsyncLLM.generate, LLMEngine.add_request) take a
`lora_request`, which the base Processor refuses without this feature.

Adapters are named per request; the engine has no separate load or unload call: an
adapter is read when a request first names it and stays cached (the slots, the worker's
host memory) until others push it out, least recently used first. The server's load and
unload (serving.py) only change which names it serves."""
