"""GRPO post-training with FP4 training and FP4 (+ Rollout-ResQ) rollout on megatron-core.

    python pretrain_rl.py                            # the tiny CPU default (synthetic addition, HiF4 + ResQ 2:4)
    python pretrain_rl.py --print-config > run.yaml  # every argument, its default and help, as YAML
    python pretrain_rl.py --config run.yaml          # the same run from the file (flags override it)
    torchrun --nproc-per-node 2 pretrain_rl.py --tensor-model-parallel-size 2 ...
    torchrun --nproc-per-node 2 pretrain_rl.py --pipeline-model-parallel-size 2 ...   # rollout on a full copy

See ``python pretrain_rl.py --help`` for every argument and README.md for recipes. The loop itself is
``megatron_fp4.rl.trainer.GRPOTrainer.train``; ``megatron_fp4.rl.setup`` wires its roles.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings


def _quiet_imports() -> None:
    """megatron-core and torchao warn at import on CPU-only machines; keep the console readable."""
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    import logging

    logging.getLogger("megatron").setLevel(logging.ERROR)


def _error(message: str) -> None:
    print(f"pretrain_rl.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def parse(argv=None):
    """Parsed and validated arguments; a bad argument exits with a one-line message naming it (status 2).
    ``--print-config`` prints the configuration as YAML and exits."""
    from megatron_fp4.rl.arguments import config_yaml, load_args, validate_args

    try:
        args = load_args(argv)
        if args.print_config:
            print(config_yaml(args), end="")
            sys.exit(0)
        return validate_args(args, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError as e:
        _error(str(e))


def main(argv=None) -> dict:
    _quiet_imports()
    args = parse(argv)
    import torch

    from megatron_fp4.parallel import destroy_parallel, initialize_parallel
    from megatron_fp4.rl.arguments import rl_config
    from megatron_fp4.rl.checkpointer import plan_start
    from megatron_fp4.rl.setup import build_trainer

    cfg = rl_config(args)
    try:
        plan = plan_start(cfg.checkpoint)  # before any model is built: a run with nothing to start from stops here
    except ValueError as e:
        _error(str(e))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    initialize_parallel(cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size,
                        seed=cfg.run.seed, cuda_graphs=cfg.actor.cuda_graph_impl == "local")
    rank = torch.distributed.get_rank()
    t_start = time.monotonic()
    if rank == 0:
        for note in plan.notes:
            print(f"[checkpoint] {note}", flush=True)
    try:
        trainer, setup = build_trainer(cfg, plan)
    except ValueError as e:
        _error(str(e))
    trainer.start(plan)
    result = trainer.train()
    result.update(seconds=time.monotonic() - t_start, setup=setup)
    # --exit-signal-handler's stop: saved, not finished (no final numbers, no --results-json)
    if rank == 0 and not result.get("stopped"):
        warm = result["warm_start"]
        for key, value in result["final"].items():
            before = warm.get(key, float("nan"))
            print(f"[result] held-out {key}: {before:.3f} (warm start) -> {value:.3f} after {result['steps']} GRPO "
                  f"steps ({(value - before) * 100:+.1f} points)", flush=True)
        print(f"[result] wall time {result['seconds']:.0f}s", flush=True)
        if cfg.run.results_json:
            with open(cfg.run.results_json, "w") as f:
                json.dump(result, f, indent=2)
    trainer.logger.close()
    destroy_parallel()  # gloo's threads torn down at interpreter exit instead could abort a rank ("terminate called")
    return result


if __name__ == "__main__":
    _quiet_imports()  # before the first megatron_fp4 import: rl.checkpoint pulls in megatron-core
    from megatron_fp4.rl.checkpoint import CheckpointError
    from megatron_fp4.rl.monitor import TrainingDivergedError

    try:
        main()
    except (TrainingDivergedError, CheckpointError) as e:  # the messages name the step / checkpoint and what to do
        print(f"pretrain_rl.py: error: {e}", file=sys.stderr)
        sys.exit(1)
