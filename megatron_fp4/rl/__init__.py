"""GRPO for megatron-fp4 (SPEC 5, 6), by role, as slime splits it.

The loop: trainer (GRPOTrainer.train: rollout -> update -> weight sync -> eval -> save), over the roles
rollout_manager (engine, sampling, rewards, filters, weight sync), actor (advantages, loss through megatron's
schedule, optimizer, LR), evaluator, checkpointer (where a run starts, save, resume, reshard, HF export) and warmup;
setup wires them from config (every knob, one documented field each; arguments generates the flags and YAML).
Below them, free of Megatron: grpo (advantages, loss, filters, metrics), rewards, data, tokenizer, sequences,
checkpoint (atomic, owned, checksummed files), monitor; distributed holds the collectives the roles share.
"""
