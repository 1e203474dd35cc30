"""A stand-in for ``sglang.Engine`` that runs on the CPU, for tests of the GRPO driver's SGLang wiring.

SGLang's Engine cannot start without a GPU (PyPI's sgl-kernel is CUDA-only), so ``pretrain_rl.py --rollout-backend
sglang`` is tested on the CPU against this fake, started through the same ``SGLangRolloutEngine._launch`` hook with
the same keyword arguments. It behaves as the Engine does where the driver depends on it, and independently of our
own code: it builds a Hugging Face transformers model from the config.json it is given (random weights, as SGLang's
``load_format="dummy"``), takes weights only through ``update_weights_from_tensor`` (HF names, checked against the
model's), answers ``generate`` in SGLang's output format (``meta_info.output_token_logprobs`` as (logprob, token,
None), ``finish_reason``) with logprobs of log_softmax(logits / T), and after ``release_memory_occupation`` (the
memory saver without CPU backup) its weights are garbage (NaN) until weights are pushed again.

Every call is appended to the JSON-lines file named by ``FAKE_SGLANG_LOG`` (with the process id). Use in a
subprocess::

    python -c "import fake_sglang; fake_sglang.run_driver()" ARGS...   # pretrain_rl.py ARGS with the fake
    python -m torch.distributed.run --nproc-per-node 2 tests/fake_sglang.py ARGS...   # the same under torchrun
"""

from __future__ import annotations

import json
import os
import runpy
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class FakeEngine:
    def __init__(self, **kwargs) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        self.kwargs = kwargs
        config = AutoConfig.from_pretrained(kwargs["model_path"])
        torch.manual_seed(1234)
        self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        self.released = False
        self._log("start", kwargs={k: v for k, v in kwargs.items() if isinstance(v, (str, int, float, bool, list))},
                  files=sorted(os.listdir(kwargs["model_path"])))

    @staticmethod
    def _log(op: str, **info) -> None:
        with open(os.environ["FAKE_SGLANG_LOG"], "a") as f:
            f.write(json.dumps({"op": op, "pid": os.getpid(), **info}) + "\n")

    @torch.no_grad()
    def generate(self, input_ids, sampling_params, return_logprob=False):
        assert not self.released, "generate() while the Engine's memory is released"
        outs = []
        for i, (ids, sp) in enumerate(zip(input_ids, sampling_params)):
            if sp["top_p"] != 1.0 or sp["top_k"] not in (-1, 0):
                raise NotImplementedError("the fake Engine samples without top-p/top-k")
            gen = torch.Generator().manual_seed(int(sp.get("sampling_seed", 0)) * 1000 + i)
            seq, lps, finish = list(ids), [], "length"
            for _ in range(sp["max_new_tokens"]):
                logits = self.model(torch.tensor([seq])).logits[0, -1].float()
                if sp["temperature"] == 0:
                    logp = torch.log_softmax(logits, -1)
                    tok = int(logits.argmax())
                else:
                    logp = torch.log_softmax(logits / sp["temperature"], -1)
                    tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
                seq.append(tok)
                lps.append((float(logp[tok]), tok, None))
                if tok in sp["stop_token_ids"]:
                    finish = "stop"
                    break
            outs.append({"output_ids": seq[len(ids):],
                         "meta_info": {"output_token_logprobs": lps if return_logprob else None,
                                       "finish_reason": {"type": finish}}})
        self._log("generate", prompts=len(input_ids), temperature=sampling_params[0]["temperature"])
        return outs

    @torch.no_grad()
    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        state = self.model.state_dict()
        names = []
        for name, tensor in named_tensors:
            if name not in state:
                return False, f"unknown weight {name}"
            if tuple(tensor.shape) != tuple(state[name].shape):
                return False, f"{name}: shape {tuple(tensor.shape)} != {tuple(state[name].shape)}"
            state[name].copy_(tensor.float())
            names.append(name)
        tied = self.model.config.tie_word_embeddings
        missing = sorted(set(state) - set(names) - ({"lm_head.weight"} if tied else set()))
        self._log("update", tensors=len(names), names=names, missing=missing, load_format=load_format,
                  flush_cache=flush_cache)
        return True, "Succeeded to update model weights."

    def release_memory_occupation(self, tags=None):
        for p in self.model.parameters():
            p.data.fill_(float("nan"))  # what a pause without CPU backup leaves: nothing usable
        self.released = True
        self._log("release", tags=tags)

    def resume_memory_occupation(self, tags=None):
        self.released = False
        self._log("resume", tags=tags)

    def flush_cache(self):
        self._log("flush_cache")

    def shutdown(self):
        self._log("shutdown")


def install() -> None:
    """Make this process's SGLangRolloutEngine start :class:`FakeEngine` and treat SGLang as available."""
    from megatron_fp4.rollout import sglang_engine

    sglang_engine.SGLangRolloutEngine._launch = staticmethod(lambda kwargs: FakeEngine(**kwargs))
    sglang_engine.sglang_start_problem = lambda needs_plugin=True: None


def run_driver() -> None:
    """``pretrain_rl.py`` with ``sys.argv[1:]``, its SGLang Engine the fake."""
    install()
    sys.argv = [os.path.join(ROOT, "pretrain_rl.py"), *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":  # torchrun ... tests/fake_sglang.py ARGS: pretrain_rl.py on every rank, with the fake
    run_driver()
