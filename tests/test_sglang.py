"""SGLang rollout backend: a real ``sglang.Engine`` on CPU with the megatron_fp4 plug-in against the native engine.

A tiny random Qwen2 model (plus a local WordLevel tokenizer) is written to a temp folder; for each precision the
greedy tokens must equal the native engine's and the per-token logprobs agree within 1e-4, also after two refits
through update_weights. Both engines run in fp32 ("bf16" rollout = the model dtype, as in test_rollout_hf), so
the comparison sees only summation-order noise. Skipped unless SGLang's CPU engine can run here (sglang plus an
sgl-kernel built for CPU; see docs/dev/SGLANG.md for why PyPI's wheels are not enough).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch


def _sglang_cpu_engine_error() -> str | None:
    """Why SGLang's CPU engine cannot run here (None: it can). It needs sglang and an sgl-kernel built for CPU
    (``torch.ops.sgl_kernel.*_cpu``); PyPI's sglang-kernel wheels are CUDA builds. Probed in a subprocess."""
    try:
        import sglang  # noqa: F401
    except Exception as e:  # ImportError, or a broken install that fails at import
        return f"sglang is not importable ({type(e).__name__}: {e}); install megatron-fp4[sglang]"
    probe = ("import torch, sgl_kernel; torch.ops.sgl_kernel.copy_all_layer_kv_cache_cpu; "
             "torch.ops.sgl_kernel.rmsnorm_cpu")
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
    r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    if r.returncode:
        errs = [ln.strip(" -") for ln in r.stderr.splitlines() if "Error" in ln][-2:] or ["?"]
        return f"SGLang's CPU engine needs sgl-kernel built for CPU (PyPI has CUDA builds only): {'; '.join(errs)}"
    return None


_ENGINE_ERR = _sglang_cpu_engine_error()
pytestmark = pytest.mark.skipif(_ENGINE_ERR is not None, reason=str(_ENGINE_ERR))

transformers = pytest.importorskip("transformers")

from megatron_fp4.models import hf_conversion  # noqa: E402
from megatron_fp4.resq import RolloutPrecision  # noqa: E402
from megatron_fp4.rollout.base import SamplingParams  # noqa: E402

VOCAB = 96
STOP = (3,)
PRECISIONS = {
    "bf16": RolloutPrecision("bf16"),
    "hif4": RolloutPrecision("w4a4", "hif4"),
    "hif4+2:4": RolloutPrecision("w4a4", "hif4", "2:4"),
    "mxfp4+2:4": RolloutPrecision("w4a4", "mxfp4", "2:4"),
}


def _write_tiny_qwen2(path, intermediate_size: int = 256, seed: int = 0):
    """A random tiny Qwen2ForCausalLM + WordLevel tokenizer saved to ``path``; returns the HF model (fp32)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=intermediate_size, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.08, use_sliding_window=False,
        bos_token_id=1, eos_token_id=STOP[0], pad_token_id=0)
    cfg.architectures = ["Qwen2ForCausalLM"]
    hf = transformers.Qwen2ForCausalLM(cfg).eval().to(torch.float32)
    hf.save_pretrained(path, safe_serialization=True)
    vocab = {"<pad>": 0, "<s>": 1, "<unk>": 2, "</s>": 3, **{f"t{i}": i for i in range(4, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", pad_token="<pad>")
    fast.save_pretrained(path)
    return hf


def _native_engine(hf, precision):
    from megatron_fp4.models import GPTModelArgs, build_gpt_model
    from megatron_fp4.parallel import initialize_parallel
    from megatron_fp4.rollout import NativeRolloutEngine

    source = hf_conversion.DictSource(hf.config.to_dict(), {k: v.detach() for k, v in hf.state_dict().items()})
    margs = source.model_args()
    initialize_parallel(1, 1, seed=5)
    model = build_gpt_model(GPTModelArgs(**margs))
    engine = NativeRolloutEngine(model, precision)
    engine.update_weights((n, hf_conversion.megatron_tensor_from_hf(n, source, margs))
                          for n, _ in model.named_parameters())
    return engine


def _sglang_engine(path, precision):
    from megatron_fp4.rollout.sglang_engine import SGLangRolloutEngine

    return SGLangRolloutEngine(path, precision, device="cpu", attention_backend="torch_native", dtype="float32",
                               disable_cuda_graph=True, mem_fraction_static=0.3, max_running_requests=8,
                               max_total_tokens=4096, disable_radix_cache=True)


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 3, 12)]


def _assert_same(native, sgl, prompts, params):
    a = native.generate(prompts, params)
    b = sgl.generate(prompts, params)
    for i, (x, y) in enumerate(zip(a, b)):
        assert y.token_ids == x.token_ids, f"prompt {i}: sglang {y.token_ids} != native {x.token_ids}"
        assert len(y.logprobs) == len(x.logprobs)
        diff = max((abs(p - q) for p, q in zip(x.logprobs, y.logprobs)), default=0.0)
        assert diff <= 1e-4, f"prompt {i}: logprobs differ by {diff:.3g}"
    return a, b


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2")
    hf = _write_tiny_qwen2(path)
    return path, hf


def test_entry_point_registers_quantization_method():
    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.value.startswith("megatron_fp4")]
    assert eps, "megatron-fp4 is not installed with its sglang.srt.plugins entry point (pip install -e .[sglang])"
    eps[0].load()()
    from sglang.srt.layers.quantization import get_quantization_config

    from megatron_fp4.sglang_plugin.method import MegatronFP4Config

    assert get_quantization_config("megatron_fp4") is MegatronFP4Config
    cfg = MegatronFP4Config.from_config({"quant_method": "megatron_fp4", "format": "mxfp4", "resq": "2:4"})
    assert cfg.options.precision == RolloutPrecision("w4a4", "mxfp4", "2:4")


@pytest.mark.parametrize("name", list(PRECISIONS))
def test_greedy_matches_native(tiny_model, name):
    path, hf = tiny_model
    precision = PRECISIONS[name]
    native = _native_engine(hf, precision)
    params = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=STOP)
    with _sglang_engine(path, precision) as sgl:
        a, _ = _assert_same(native, sgl, _prompts(), params)
    assert sum(len(s.token_ids) for s in a) > 8


def test_refit_matches_native_twice(tiny_model):
    path, hf = tiny_model
    precision = PRECISIONS["hif4+2:4"]
    native = _native_engine(hf, precision)
    params = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=STOP)
    prompts = _prompts()
    g = torch.Generator().manual_seed(11)
    with _sglang_engine(path, precision) as sgl:
        before = sgl.generate(prompts, params)
        for step in range(2):
            new = {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for n, p in native.model.named_parameters()}
            native.update_weights(new.items())
            stats = sgl.update_weights(new.items())  # megatron names -> HF through hf_conversion
            assert stats.num_tensors > 0 and stats.total_seconds > 0
            _, after = _assert_same(native, sgl, prompts, params)
            assert [s.token_ids for s in after] != [s.token_ids for s in before], f"refit {step} changed nothing"
            before = after


@pytest.mark.parametrize("override,needle", [
    ({"format": "fp5"}, "format='fp5'"),
    ({"resq": "3:4"}, "resq='3:4'"),
])
def test_bad_quant_config_fails_at_start(tiny_model, tmp_path, monkeypatch, override, needle):
    """Unknown format / sparsity in the model's quantization_config: SGLang itself refuses to start."""
    from megatron_fp4.sglang_plugin.options import PluginOptions, quant_config_dict

    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        PluginOptions.from_quant_config({**quant_config_dict(), **override})
    src, _ = tiny_model
    import shutil

    dst = tmp_path / "bad"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {**quant_config_dict(), **override}
    (dst / "config.json").write_text(json.dumps(cfg))
    import sglang as sgl

    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")  # SGLang's CPU switch (its processes read it at import)
    with pytest.raises(Exception) as info:
        eng = sgl.Engine(model_path=str(dst), quantization="megatron_fp4", device="cpu",
                         attention_backend="torch_native", disable_cuda_graph=True, skip_tokenizer_init=True,
                         dtype="float32", log_level="error")
        eng.shutdown()
    assert needle in str(info.value) or "Initialization failed" in str(info.value)
