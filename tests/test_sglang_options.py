"""The SGLang backend's parts that need no SGLang: plug-in options, fail-fast model checks, megatron -> HF weight
mapping for refits, sampling parameters. Runs everywhere (the plug-in's SGLang parts: tests/test_sglang_plugin.py)."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_fp4.resq import RolloutPrecision
from megatron_fp4.rollout.base import SamplingParams
from megatron_fp4.rollout.sglang_engine import SGLangRolloutEngine, check_model_for_precision, megatron_to_hf_tensors
from megatron_fp4.sglang_plugin.options import PluginOptions, quant_config_dict

transformers = pytest.importorskip("transformers")


def _qwen2_config(**kw) -> dict:
    base = dict(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, use_sliding_window=False)
    cfg = transformers.Qwen2Config(**{**base, **kw})
    cfg.architectures = ["Qwen2ForCausalLM"]
    return cfg


@pytest.mark.parametrize("config,precision", [
    ({}, RolloutPrecision("w4a4", "hif4")),
    ({"format": "mxfp4", "resq": "2:4"}, RolloutPrecision("w4a4", "mxfp4", "2:4")),
    ({"format": "hif4", "sparsity": "tile32x64"}, RolloutPrecision("w4a4", "hif4", "tile32x64")),
    ({"format": "mxfp4", "activation_format": "none"}, RolloutPrecision("w4a16", "mxfp4")),
    ({"format": "hif4", "activation_format": "hif4", "resq": "dense"}, RolloutPrecision("w4a4", "hif4", "dense")),
    ({"format": "hif4", "mode": "w16a4", "resq": "channel"}, RolloutPrecision("w16a4", "hif4", "channel")),
    ({"format": "hif4", "resq": "2:4", "resq_combine": "bf16"},
     RolloutPrecision("w4a4", "hif4", "2:4", resq_combine="bf16")),
])
def test_options_parse_to_precision(config, precision):
    opts = PluginOptions.from_quant_config({"quant_method": "megatron_fp4", **config})
    assert opts.precision == precision
    assert PluginOptions.from_quant_config(opts.to_quant_config()) == opts
    assert PluginOptions.from_precision(precision) == opts


def test_exporter_quantization_config_is_accepted():
    """The quantization_config that models/fp4_checkpoint writes selects the same rollout form."""
    qc = {"quant_method": "megatron_fp4", "version": 1, "format": "mxfp4", "block_size": 32, "bits_per_value": 4.25,
          "scale_bytes_per_block": 1, "group_dim": "in_features", "activation_format": "mxfp4", "resq": "2:4",
          "quantized_modules": {}, "modules_not_quantized": []}
    assert PluginOptions.from_quant_config(qc).precision == RolloutPrecision("w4a4", "mxfp4", "2:4")


@pytest.mark.parametrize("config,needle", [
    ({"format": "fp5"}, "format='fp5'"), ({"resq": "3:4"}, "resq='3:4'"), ({"mode": "w8a8"}, "mode='w8a8'"),
    ({"resq": "2:4", "sparsity": "dense"}, "resq='2:4' and sparsity='dense'"),
    ({"mode": "w4a16", "resq": "2:4"}, "resq='2:4'"),
    ({"resq": "2:4", "resq_combine": "fp16"}, "resq_combine='fp16'"),
    ({"resq": "none", "resq_combine": "bf16"}, "resq_combine='bf16' needs a ResQ residual"),
])
def test_bad_options_name_the_option(config, needle):
    with pytest.raises(ValueError) as info:
        PluginOptions.from_quant_config({**quant_config_dict(), **config})
    assert needle in str(info.value)


def test_model_width_checks():
    ok = _qwen2_config().to_dict()
    for p in (RolloutPrecision("w4a4", "hif4", "2:4"), RolloutPrecision("w4a4", "mxfp4"), RolloutPrecision("bf16")):
        check_model_for_precision(ok, p)
    bad = _qwen2_config(intermediate_size=80).to_dict()  # down_proj K = 80: not whole 64- or 32-value blocks
    for fmt, block in (("hif4", 64), ("mxfp4", 32)):
        with pytest.raises(ValueError, match=rf"format='{fmt}' packs weights in blocks of {block}.*down_proj.*80"):
            check_model_for_precision(bad, RolloutPrecision("w4a4", fmt))
    check_model_for_precision(bad, RolloutPrecision("bf16"))
    check_model_for_precision(ok, RolloutPrecision("w4a4", "mxfp4"), tp_size=4)  # o_proj K = 128 / 4 = 32 blocks
    with pytest.raises(ValueError, match="o_proj has in_features=32 per tensor-parallel rank"):
        check_model_for_precision(ok, RolloutPrecision("w4a4", "hif4"), tp_size=4)  # 32 < one 64-value block


def test_engine_fails_fast_before_starting_sglang(tmp_path):
    """Bad configuration fails in the constructor, naming the option, before any SGLang process (or import)."""
    _qwen2_config(intermediate_size=80).to_json_file(tmp_path / "config.json")
    for fmt in ("hif4", "mxfp4"):
        with pytest.raises(ValueError, match=rf"format='{fmt}'.*in_features=80"):
            SGLangRolloutEngine(tmp_path, RolloutPrecision("w4a4", fmt), device="cpu")
    with pytest.raises(ValueError, match="format='nvfp4'"):
        SGLangRolloutEngine(tmp_path, RolloutPrecision("w4a4", "nvfp4"), device="cpu")
    with pytest.raises(ValueError, match="activation_method='occ'"):
        SGLangRolloutEngine(tmp_path, RolloutPrecision("w4a4", "hif4", activation_method="occ"), device="cpu")


@pytest.mark.parametrize("tied", [False, True])
def test_megatron_to_hf_tensors_round_trip(tied):
    """Gathered megatron tensors map back to the HF names and layouts bit for bit (what a refit pushes)."""
    from megatron_fp4.models import hf_conversion

    torch.manual_seed(0)
    cfg = _qwen2_config(tie_word_embeddings=tied)
    hf = transformers.Qwen2ForCausalLM(cfg)
    sd = {k: v.detach() for k, v in hf.state_dict().items()}
    if tied:
        sd.pop("lm_head.weight", None)
    source = hf_conversion.DictSource(cfg.to_dict(), sd)
    margs = source.model_args()
    mg_names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight"]
    for i in range(cfg.num_hidden_layers):
        p = f"decoder.layers.{i}."
        mg_names += [p + "input_layernorm.weight", p + "self_attention.linear_qkv.weight",
                     p + "self_attention.linear_qkv.bias", p + "self_attention.linear_proj.weight",
                     p + "pre_mlp_layernorm.weight", p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
    if not tied:
        mg_names.append("output_layer.weight")
    mg = [(n, hf_conversion.megatron_tensor_from_hf(n, source, margs)) for n in mg_names]
    out = dict(megatron_to_hf_tensors(mg, cfg.to_dict()))
    assert set(out) == set(sd)
    for k, v in sd.items():
        assert torch.equal(out[k], v), k
    passed = megatron_to_hf_tensors(list(sd.items()), cfg.to_dict())  # HF names pass through unchanged
    assert [n for n, _ in passed] == list(sd) and all(torch.equal(t, sd[n]) for n, t in passed)
    with pytest.raises(ValueError, match="mixed HF"):
        megatron_to_hf_tensors(mg[:1] + [("model.norm.weight", sd["model.norm.weight"])], cfg.to_dict())
    with pytest.raises(KeyError, match="linear_qkv"):
        megatron_to_hf_tensors([t for t in mg if "linear_qkv.weight" not in t[0]], cfg.to_dict())


def test_weight_pushes_are_buckets_of_whole_layers(tmp_path, monkeypatch):
    """update_weights pushes whole decoder layers per call (each FP4 linear re-quantized once) of about the bucket
    size, every HF tensor exactly once, then flushes the cache once; the layer-bucketing rule on its own."""
    import fake_sglang
    from megatron_fp4.rollout.sglang_engine import layer_buckets

    t = torch.zeros(4, dtype=torch.float32)  # 16 bytes
    names = ["model.embed_tokens.weight", "model.layers.0.a", "model.layers.0.b", "model.layers.1.a",
             "model.layers.1.b", "model.layers.2.a", "model.norm.weight", "lm_head.weight"]
    cut = [[n for n, _ in b] for b in layer_buckets([(n, t) for n in names], 20)]
    assert cut == [names[:2] + names[2:3], names[3:5], names[5:7], names[7:]]  # a layer is never split
    assert [[n for n, _ in b] for b in layer_buckets([(n, t) for n in names], 10**9)] == [names]

    cfg = _qwen2_config()
    cfg.save_pretrained(tmp_path)
    monkeypatch.setenv("FAKE_SGLANG_LOG", str(tmp_path / "engine.jsonl"))
    monkeypatch.setattr(SGLangRolloutEngine, "_launch", staticmethod(lambda kw: fake_sglang.FakeEngine(**kw)))
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(cfg)
    sd = {k: v.detach() for k, v in hf.state_dict().items()}
    layer_bytes = sum(v.numel() * v.element_size() for k, v in sd.items() if k.startswith("model.layers.0."))
    engine = SGLangRolloutEngine(tmp_path, RolloutPrecision("w4a4", "hif4", "2:4"), weight_bucket_bytes=layer_bytes)
    stats = engine.update_weights(sd.items())
    calls = [json.loads(line) for line in (tmp_path / "engine.jsonl").read_text().splitlines()]
    pushes = [c for c in calls if c["op"] == "update"]
    assert [c["op"] for c in calls[len(pushes) + 1:]] == ["flush_cache"]
    assert len(pushes) == stats.extra["buckets"] >= cfg.num_hidden_layers
    pushed = [n for c in pushes for n in c["names"]]
    assert sorted(pushed) == sorted(sd) and stats.num_tensors == len(sd)  # every tensor exactly once
    where = {}
    for i, c in enumerate(pushes):
        layers = {n.split(".")[2] for n in c["names"] if n.startswith("model.layers.")}
        assert len(layers) <= 1 and not c["flush_cache"]  # one layer's worth per push
        for layer in layers:
            assert where.setdefault(layer, i) == i  # a layer is never split over two pushes
    engine.shutdown()


def test_sampling_params_map_to_sglang():
    d = SGLangRolloutEngine._sampling_dict(SamplingParams(temperature=0.0, max_new_tokens=7, stop_token_ids=(3, 4),
                                                          seed=5))
    assert d == {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 7, "stop_token_ids": [3, 4],
                 "sampling_seed": 5}
    assert SGLangRolloutEngine._sampling_dict(SamplingParams(top_k=20))["top_k"] == 20
