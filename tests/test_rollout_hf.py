"""BF16 (here fp32 on CPU) native rollout against Hugging Face transformers generate() on the same weights: a tiny
random Qwen2 model converted with megatron_fp4.models.hf_conversion and loaded through update_weights()."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
hf_conversion = pytest.importorskip("megatron_fp4.models.hf_conversion")

from megatron_fp4.models import GPTModelArgs, build_gpt_model  # noqa: E402
from megatron_fp4.parallel import initialize_parallel  # noqa: E402
from megatron_fp4.resq import RolloutPrecision  # noqa: E402
from megatron_fp4.rollout import NativeRolloutEngine, SamplingParams  # noqa: E402
from rollout_helpers import VOCAB, random_prompts  # noqa: E402

STOP = (3, 4, 5)



@pytest.fixture(scope="module")
def hf_and_engine():
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False, initializer_range=0.08, use_sliding_window=False)
    cfg.architectures = ["Qwen2ForCausalLM"]
    hf = transformers.Qwen2ForCausalLM(cfg).eval().to(torch.float32)
    cfg_dict = cfg.to_dict()
    source = hf_conversion.DictSource(cfg_dict, {k: v.detach() for k, v in hf.state_dict().items()})
    margs = source.model_args()
    initialize_parallel(1, 1, seed=5)
    model = build_gpt_model(GPTModelArgs(**margs))
    engine = NativeRolloutEngine(model, RolloutPrecision("bf16"))
    stats = engine.update_weights(
        (name, hf_conversion.megatron_tensor_from_hf(name, source, margs)) for name, _ in model.named_parameters())
    assert stats.num_tensors == len(list(model.parameters()))
    return hf, engine


def test_greedy_matches_hf_generate(hf_and_engine):
    hf, engine = hf_and_engine
    prompts = random_prompts((4, 7, 3, 9), seed=3)
    params = SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=STOP)
    samples = engine.generate(prompts, params)
    total = 0
    for p, s in zip(prompts, samples):
        ids = torch.tensor([p])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                              eos_token_id=list(STOP), pad_token_id=0, output_scores=True,
                              return_dict_in_generate=True)
        hf_tokens = out.sequences[0, len(p):].tolist()
        assert s.token_ids == hf_tokens
        hf_lp = [float(torch.log_softmax(sc[0].float(), -1)[t]) for sc, t in zip(out.scores, hf_tokens)]
        assert max(abs(a - b) for a, b in zip(s.logprobs, hf_lp)) < 1e-4
        total += len(hf_tokens)
    assert total > 2 * len(prompts)
