"""The megatron_fp4 SGLang plug-in against SGLang's real classes, in process (no Engine):

SGLang's own plug-in loader finds the entry point and registers the quantization method; SGLang's parallel
linears (QKV / merged gate-up / row) built with it load weights through SGLang's weight loaders, store the
reference quantizer's packed codes and scales bit for bit, and compute exactly what megatron-core's linears of
the native rollout engine compute in the same precision; refits re-quantize in place (same Parameter objects);
bad options fail naming the option. Skipped when SGLang is not importable.
"""

from __future__ import annotations

import json
import socket
from importlib.metadata import entry_points

import pytest
import torch

try:
    from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from sglang.srt.plugins import load_plugins

    _ERR = None
except Exception as e:  # not installed, or an install that fails at import
    _ERR = f"{type(e).__name__}: {e}"
pytestmark = pytest.mark.skipif(_ERR is not None, reason=f"sglang is not importable ({_ERR}); "
                                                        f"install megatron-fp4[sglang] (docs/dev/SGLANG.md)")

from megatron_fp4.formats import QuantizedTensor, get_format  # noqa: E402
from megatron_fp4.resq import RolloutPrecision, rollout_backend_for, rollout_linear  # noqa: E402

HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM = 128, 256, 4, 2, 32
PRECISIONS = {
    "hif4": RolloutPrecision("w4a4", "hif4"),
    "hif4+2:4": RolloutPrecision("w4a4", "hif4", "2:4"),
    "hif4+2:4/bf16sum": RolloutPrecision("w4a4", "hif4", "2:4", resq_combine="bf16"),
    "mxfp4+2:4": RolloutPrecision("w4a4", "mxfp4", "2:4"),
    "hif4+channel": RolloutPrecision("w4a4", "hif4", "channel"),
    "mxfp4+tile32x64": RolloutPrecision("w4a4", "mxfp4", "tile32x64"),
    "hif4+dense": RolloutPrecision("w4a4", "hif4", "dense"),
    "w4a16/mxfp4": RolloutPrecision("w4a16", "mxfp4"),
    "w16a4/hif4+2:4": RolloutPrecision("w16a4", "hif4", "2:4"),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", autouse=True)
def _sglang_dist():
    """SGLang's single-process (world 1, gloo) model-parallel groups; its layers need them even at TP=1."""
    from sglang.test.layer_ut_utils import init_single_process_dist

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    init_single_process_dist(_free_port())
    load_plugins()  # SGLang's own entry-point discovery (group sglang.srt.plugins)
    yield
    torch.set_num_threads(n)


def _config(precision: RolloutPrecision):
    from megatron_fp4.sglang_plugin.method import MegatronFP4Config
    from megatron_fp4.sglang_plugin.options import PluginOptions

    return MegatronFP4Config.from_config(PluginOptions.from_precision(precision).to_quant_config())


def _layers(precision: RolloutPrecision, prefix: str = "model.layers.0"):
    cfg = _config(precision)
    kw = dict(quant_config=cfg, params_dtype=torch.float32)
    return {
        "qkv": QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=True, prefix=f"{prefix}.self_attn.qkv_proj",
                                 **kw),
        "gate_up": MergedColumnParallelLinear(HIDDEN, [FFN, FFN], bias=False, prefix=f"{prefix}.mlp.gate_up_proj",
                                              **kw),
        "down": RowParallelLinear(FFN, HIDDEN, bias=False, prefix=f"{prefix}.mlp.down_proj", **kw),
    }


def _hf_weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: 0.08 * torch.randn(*s, generator=g)  # noqa: E731
    return {"q": r(HEADS * HEAD_DIM, HIDDEN), "k": r(KV_HEADS * HEAD_DIM, HIDDEN), "v": r(KV_HEADS * HEAD_DIM, HIDDEN),
            "qb": r(HEADS * HEAD_DIM), "kb": r(KV_HEADS * HEAD_DIM), "vb": r(KV_HEADS * HEAD_DIM),
            "gate": r(FFN, HIDDEN), "up": r(FFN, HIDDEN), "down": r(HIDDEN, FFN)}


def _load(layers, w) -> None:
    """Through SGLang's weight loaders (the plug-in's wrapper around them), shard by shard as a checkpoint does."""
    qkv = layers["qkv"]
    for sid in ("q", "k", "v"):
        qkv.weight.weight_loader(qkv.weight, w[sid], sid)
        qkv.bias.weight_loader(qkv.bias, w[sid + "b"], sid)
    gu = layers["gate_up"]
    gu.weight.weight_loader(gu.weight, w["gate"], 0)
    gu.weight.weight_loader(gu.weight, w["up"], 1)
    layers["down"].weight.weight_loader(layers["down"].weight, w["down"])


def _loaded_layers(precision: RolloutPrecision, w) -> dict:
    """:func:`_layers` with ``w`` loaded through SGLang's loaders and quantized (process_weights_after_loading)."""
    layers = _layers(precision)
    _load(layers, w)
    for m in layers.values():
        m.quant_method.process_weights_after_loading(m)
    return layers


def _fused(w):
    return {"qkv": (torch.cat([w["q"], w["k"], w["v"]]), torch.cat([w["qb"], w["kb"], w["vb"]])),
            "gate_up": (torch.cat([w["gate"], w["up"]]), None), "down": (w["down"], None)}


def _inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(37, HIDDEN, generator=g)
    x[:, 5] *= 30.0  # an outlier channel: activation quantization underflows the rest of its blocks
    return {"qkv": x, "gate_up": x, "down": torch.randn(37, FFN, generator=g)}


def test_sglang_discovers_the_plugin():
    from sglang.srt.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    from megatron_fp4.sglang_plugin import quantization_choices

    QUANTIZATION_CHOICES, _ = quantization_choices()

    from megatron_fp4.sglang_plugin.method import MegatronFP4Config

    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.value.startswith("megatron_fp4")]
    assert eps, "megatron-fp4 is installed without its sglang.srt.plugins entry point (pip install -e .[sglang])"
    assert QUANTIZATION_METHODS["megatron_fp4"] is MegatronFP4Config
    from sglang.srt.layers.quantization import CPU_QUANTIZATION_METHODS

    assert CPU_QUANTIZATION_METHODS["megatron_fp4"] is MegatronFP4Config  # SGLang's CPU engine on AMX hosts
    assert get_quantization_config("megatron_fp4") is MegatronFP4Config
    assert "megatron_fp4" in QUANTIZATION_CHOICES
    cfg = MegatronFP4Config.from_config({"quant_method": "megatron_fp4", "format": "mxfp4", "resq": "2:4",
                                         "packed_modules_mapping": {}, "hf_config": None})
    assert cfg.options.precision == RolloutPrecision("w4a4", "mxfp4", "2:4")
    assert rollout_backend_for("cpu") is None  # CPU: the PyTorch reference serves apply()


def test_register_on_the_sglang_0_5_17_layout(monkeypatch):
    """SGLang 0.5.17 has no ``sglang.srt.arg_groups.choices``: its ``--quantization`` choices and their extender
    live in ``sglang.srt.server_args``, and its registry has no CPU_QUANTIZATION_METHODS. That layout, simulated
    on the installed SGLang: register() adds the method to both registries and to server_args' choices."""
    import sys

    import sglang.srt.arg_groups as arg_groups
    import sglang.srt.server_args as server_args
    from sglang.srt.layers import quantization as sgl_quant

    from megatron_fp4.sglang_plugin import quantization_choices, register
    from megatron_fp4.sglang_plugin.method import MegatronFP4Config

    monkeypatch.setitem(sys.modules, "sglang.srt.arg_groups.choices", None)  # import -> ModuleNotFoundError
    monkeypatch.delattr(arg_groups, "choices", raising=False)
    old_choices = ["awq", "fp8"]
    monkeypatch.setattr(server_args, "QUANTIZATION_CHOICES", old_choices)
    monkeypatch.setattr(server_args, "add_quantization_method_choices", old_choices.extend)
    monkeypatch.setattr(sgl_quant, "QUANTIZATION_METHODS", {})
    monkeypatch.setattr(sgl_quant, "BASE_QUANTIZATION_METHODS", {})
    monkeypatch.delattr(sgl_quant, "CPU_QUANTIZATION_METHODS")
    with pytest.raises(ModuleNotFoundError):
        import sglang.srt.arg_groups.choices  # noqa: F401
    assert quantization_choices()[0] is old_choices
    register()
    register()  # idempotent
    assert old_choices == ["awq", "fp8", "megatron_fp4"]
    assert sgl_quant.QUANTIZATION_METHODS == {"megatron_fp4": MegatronFP4Config}
    assert sgl_quant.BASE_QUANTIZATION_METHODS == {"megatron_fp4": MegatronFP4Config}
    # neither layout: the error names the modules it looked in
    monkeypatch.delattr(server_args, "QUANTIZATION_CHOICES")
    with pytest.raises(ImportError, match="sglang.srt.server_args"):
        quantization_choices()


@pytest.mark.parametrize("name", list(PRECISIONS))
def test_layers_equal_reference_bit_for_bit(name):
    precision = PRECISIONS[name]
    fmt = get_format(precision.format)
    w = _hf_weights(0)
    layers = _loaded_layers(precision, w)
    xs, fused = _inputs(), _fused(w)
    with torch.no_grad():
        for key, layer in layers.items():
            W, b = fused[key]
            if precision.quantize_weights:
                qt = fmt.quantize(W, dim=-1)
                assert torch.equal(layer.weight_packed, qt.codes), key
                assert torch.equal(layer.weight_scale, qt.scales), key
            y, _ = layer(xs[key])
            ref = rollout_linear(xs[key], W, b, precision)
            assert torch.equal(y, ref), f"{key}: max diff {(y - ref).abs().max():.3g}"
            assert not torch.equal(ref, torch.nn.functional.linear(xs[key], W, b))  # FP4 really applied


@pytest.mark.parametrize("name", ["hif4+2:4", "mxfp4+2:4", "hif4"])
def test_layers_equal_native_megatron_linears(name):
    """Same HF weights in megatron-core's GPT layer (rollout precision swapped in) and in SGLang's layers."""
    from megatron_fp4.models import GPTModelArgs, build_gpt_model
    from megatron_fp4.parallel import initialize_parallel
    from megatron_fp4.rollout.precision import rollout_precision

    precision = PRECISIONS[name]
    initialize_parallel(1, 1, seed=3)
    model = build_gpt_model(GPTModelArgs(
        num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS, num_query_groups=KV_HEADS,
        kv_channels=HEAD_DIM, vocab_size=64, max_seq_len=64, add_qkv_bias=True, swiglu=True,
        normalization="RMSNorm")).eval()
    w = _hf_weights(4)
    qpg = HEADS // KV_HEADS
    qg = w["q"].reshape(KV_HEADS, qpg * HEAD_DIM, HIDDEN)
    kg, vg = w["k"].reshape(KV_HEADS, HEAD_DIM, HIDDEN), w["v"].reshape(KV_HEADS, HEAD_DIM, HIDDEN)
    layer = model.decoder.layers[0]
    with torch.no_grad():
        layer.self_attention.linear_qkv.weight.copy_(torch.cat([qg, kg, vg], 1).reshape(-1, HIDDEN))
        bq = torch.cat([w["qb"].reshape(KV_HEADS, -1), w["kb"].reshape(KV_HEADS, -1), w["vb"].reshape(KV_HEADS, -1)], 1)
        layer.self_attention.linear_qkv.bias.copy_(bq.reshape(-1))
        layer.mlp.linear_fc1.weight.copy_(torch.cat([w["gate"], w["up"]]))
        layer.mlp.linear_fc2.weight.copy_(w["down"])
    sgl = _loaded_layers(precision, w)
    xs = _inputs(2)
    with torch.no_grad(), rollout_precision(model, precision):
        mg = {"qkv": layer.self_attention.linear_qkv, "gate_up": layer.mlp.linear_fc1, "down": layer.mlp.linear_fc2}
        for key, m in mg.items():
            y_mg, b_mg = m(xs[key].unsqueeze(1))  # megatron: [s, b, h]
            y_mg = y_mg.squeeze(1) + (b_mg if b_mg is not None else 0)
            y_sgl, _ = sgl[key](xs[key])
            if key == "qkv":  # megatron's grouped [q_g; k_g; v_g] rows -> HF/SGLang's [q; k; v]
                yg = y_mg.reshape(-1, KV_HEADS, (qpg + 2) * HEAD_DIM)
                q, k, v = yg.split([qpg * HEAD_DIM, HEAD_DIM, HEAD_DIM], dim=-1)
                y_mg = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1)
            torch.testing.assert_close(y_sgl, y_mg, rtol=0, atol=2e-6)


def _kernel_like_backend(calls: list):
    """A CPU rollout backend shaped like megatron_fp4/rollout_kernels.py: it prepares
    ``megatron_fp4.kernels.dispatch.PreparedWeight`` (packed codes and scales + the GEMM expansion; the pure-PyTorch
    quantizer here) in the plug-in's cache and serves the GEMM from the prepared packed weight."""
    from megatron_fp4.kernels import dispatch

    def prepare_weight(weight, precision, cache):
        if cache is None:
            return dispatch.prepare_weight(weight.detach(), precision.format)
        return cache.get_prepared(weight, f"kernels:{precision.format}",
                                  lambda w: dispatch.prepare_weight(w, precision.format))

    def backend(x2, weight, precision, cache, out_dtype):
        calls.append(precision.label)
        pw = prepare_weight(weight, precision, cache)
        return rollout_linear(x2, weight, None, precision, weight_q=pw.packed.dequantize()).to(out_dtype)

    backend.prepare_weight = prepare_weight
    return backend


def _operand_tensors(layer) -> list:
    """Every tensor a captured CUDA graph of ``layer``'s apply() reads: the packed parameters, the reference
    operand and, where a backend prepared one, the kernels' prepared weight (codes, scales, expansion)."""
    import dataclasses

    from megatron_fp4.sglang_plugin.method import _BACKEND_CACHE

    def flat(o):
        if isinstance(o, torch.Tensor):
            return [o]
        if isinstance(o, (tuple, list)):
            return [t for x in o for t in flat(x)]
        if dataclasses.is_dataclass(o):
            return [t for f in dataclasses.fields(o) for t in flat(getattr(o, f.name))]
        return []

    prepared = [e[2] for k, e in _BACKEND_CACHE._entries.items() if k[0] == id(layer.weight)]
    return [layer.weight_packed, layer.weight_scale, layer.megatron_fp4_wq] + flat(prepared)


def test_trace_names_the_path_that_served_each_layer(tmp_path, monkeypatch):
    """MEGATRON_FP4_PLUGIN_TRACE: one line per layer at its first forward, naming the backend ("kernels") or the
    reference, also when a registered backend declines the call (the fallback the GPU tests must see); a backend's
    line carries its difference from the reference on the same input (0 for the exact kernel twin, large for a
    backend that computes something else), from its first forward with an input: an all-zero one (SGLang's
    warm-up forwards of dummy tokens, whose embedding row is the model's zero padding row) is not compared."""
    from megatron_fp4.resq import register_rollout_backend
    from megatron_fp4.sglang_plugin.method import TRACE_ENV, _BACKEND_CACHE

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(_BACKEND_CACHE, "_entries", {})
    precision = PRECISIONS["hif4+2:4"]
    xs = _inputs()

    def traced(backend, name):
        trace = tmp_path / f"{name}.jsonl"
        monkeypatch.setenv(TRACE_ENV, str(trace))
        register_rollout_backend("cpu", backend)
        try:
            layers = _loaded_layers(precision, _hf_weights(0))
            with torch.no_grad():
                for key, layer in layers.items():  # a warm-up forward of zeros
                    layer(torch.zeros_like(xs[key]))
                for _ in range(2):  # one line per layer, at its first forward only
                    for key, layer in layers.items():
                        layer(xs[key])
        finally:
            register_rollout_backend("cpu", None)
        rows = [json.loads(line) for line in trace.read_text().splitlines()]
        assert sorted(r["layer"] for r in rows) == sorted(m.quant_method.prefix for m in layers.values())
        diffs = [r.get("rel_diff_vs_reference") for r in rows]
        assert all(r["reference_abs_max"] > 0 for r in rows if "rel_diff_vs_reference" in r)
        return {r["path"] for r in rows}, diffs

    assert traced(None, "none") == ({"reference"}, [None] * 3)  # qkv, gate_up, down
    paths, diffs = traced(_kernel_like_backend([]), "kernels")
    assert paths == {"kernels"} and len(diffs) == 3 and max(diffs) <= 1e-6, diffs
    declined = traced(lambda x2, weight, precision, cache, out_dtype: NotImplemented, "declined")
    assert declined == ({"reference"}, [None] * 3)
    # a backend that forgets the activation quantization is caught by the difference
    paths, diffs = traced(lambda x2, weight, precision, cache, out_dtype: x2.float() @ weight.float().t(), "wrong")
    assert paths == {"kernels"} and min(diffs) > 1e-3, diffs


@pytest.mark.parametrize("with_backend", [False, True], ids=["reference", "kernel-like-backend"])
def test_refit_requantizes_in_place_twice(with_backend, monkeypatch):
    """Two refits through the re-quantizing loader: the same Parameters, loaders and operand storage (data_ptr():
    what SGLang's CUDA graphs captured), values equal to a fresh quantization bit for bit, outputs changed."""
    from megatron_fp4.resq import register_rollout_backend
    from megatron_fp4.sglang_plugin.loader import load_weights_and_requantize
    from megatron_fp4.sglang_plugin.method import _BACKEND_CACHE, REQUANT_STATS, requantize_stale_layers

    calls: list = []
    if with_backend:
        monkeypatch.setenv("TRITON_INTERPRET", "0")  # megatron_fp4.kernels.dispatch on CPU: its pure-PyTorch twin (fast)
        register_rollout_backend("cpu", _kernel_like_backend(calls))
        monkeypatch.setattr(_BACKEND_CACHE, "_entries", {})
    try:
        _refit_twice(with_backend, calls, load_weights_and_requantize, requantize_stale_layers, REQUANT_STATS)
    finally:
        register_rollout_backend("cpu", None)


def _refit_twice(with_backend, calls, load_weights_and_requantize, requantize_stale_layers, REQUANT_STATS):
    from megatron_fp4.kernels import dispatch

    precision = PRECISIONS["hif4+2:4"]
    layers = _loaded_layers(precision, _hf_weights(0))
    ids = {k: (id(m.weight), id(m.weight_packed), id(m.weight_scale)) for k, m in layers.items()}
    ptrs = {k: [t.data_ptr() for t in _operand_tensors(m)] for k, m in layers.items()}
    assert all(len(v) == (3 + 3 * with_backend) for v in ptrs.values()), {k: len(v) for k, v in ptrs.items()}
    reallocated = REQUANT_STATS["reallocated"]
    loaders = {k: m.weight.weight_loader for k, m in layers.items()}
    xs = _inputs()

    class Tiny(torch.nn.Module):
        """A model whose load_weights feeds HF-named shards to the layers' loaders (as SGLang's Qwen2 does)."""

        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleDict(layers)

        def load_weights(self, named):
            for name, t in named:
                key, shard = {"q": ("qkv", "q"), "k": ("qkv", "k"), "v": ("qkv", "v"), "gate": ("gate_up", 0),
                              "up": ("gate_up", 1), "down": ("down", None)}[name]
                p = self.layers[key].weight
                p.weight_loader(p, t, shard) if shard is not None else p.weight_loader(p, t)

    model = Tiny()
    for step in (1, 2):
        w = _hf_weights(10 + step)
        with torch.no_grad():
            before = {k: m(xs[k])[0].clone() for k, m in layers.items()}
        load_weights_and_requantize(model, [(n, w[n]) for n in ("q", "k", "v", "gate", "up", "down")])
        assert all(not m.megatron_fp4_stale for m in layers.values())
        assert requantize_stale_layers(model)["layers"] == 0  # nothing left stale
        fused = _fused(w)
        fused["qkv"] = (fused["qkv"][0], torch.cat([_hf_weights(0)[s] for s in ("qb", "kb", "vb")]))  # bias kept
        with torch.no_grad():
            for k, m in layers.items():
                W, b = fused[k]
                qt = get_format("hif4").quantize(W, dim=-1)
                assert torch.equal(m.weight_packed, qt.codes) and torch.equal(m.weight_scale, qt.scales), (step, k)
                assert torch.equal(m.megatron_fp4_wq, qt.dequantize()), (step, k)
                if with_backend:
                    fresh = dispatch.prepare_weight(W, "hif4")
                    now = _operand_tensors(m)[3:]
                    for a, f in zip(now, [fresh.packed.codes, fresh.packed.scales, fresh.expanded.values], strict=True):
                        torch.testing.assert_close(a, f, rtol=0, atol=0, equal_nan=True)
                n_calls = len(calls)
                y = m(xs[k])[0]
                assert len(calls) == n_calls + with_backend, (step, k)  # the backend served it, where registered
                assert torch.equal(y, rollout_linear(xs[k], W, b, precision)), (step, k)
                assert not torch.equal(y, before[k]), (step, k)
        assert ptrs == {k: [t.data_ptr() for t in _operand_tensors(m)] for k, m in layers.items()}, step
    assert REQUANT_STATS["reallocated"] == reallocated
    assert ids == {k: (id(m.weight), id(m.weight_packed), id(m.weight_scale)) for k, m in layers.items()}
    assert loaders == {k: m.weight.weight_loader for k, m in layers.items()}


def test_lazy_requantize_when_loader_bypassed():
    """A plain ``load_weights`` (no re-quantizing loader) still takes effect: apply() re-quantizes stale layers."""
    precision = PRECISIONS["mxfp4+2:4"]
    layers = _loaded_layers(precision, _hf_weights(0))
    w = _hf_weights(7)
    _load(layers, w)
    assert all(m.megatron_fp4_stale for m in layers.values())
    xs, fused = _inputs(), _fused(w)
    with torch.no_grad():
        for k, m in layers.items():
            assert torch.equal(m(xs[k])[0], rollout_linear(xs[k], *fused[k], precision)), k


@pytest.mark.parametrize("config,needle", [
    ({"format": "fp5"}, "format='fp5'"),
    ({"format": "nvfp4"}, "format='nvfp4'"),
    ({"resq": "3:4"}, "resq='3:4'"),
    ({"sparsity": "50%"}, "resq='50%'"),
    ({"mode": "w8a8"}, "mode='w8a8'"),
    ({"quant_method": "fp8"}, "quant_method='fp8'"),
    ({"activation_format": "mxfp4"}, "activation_format='mxfp4'"),
])
def test_bad_options_name_the_option(config, needle):
    from megatron_fp4.sglang_plugin.method import MegatronFP4Config

    with pytest.raises(ValueError) as info:
        MegatronFP4Config.from_config({"quant_method": "megatron_fp4", **config})
    assert needle in str(info.value)


@pytest.mark.parametrize("fmt,k", [("hif4", 96), ("mxfp4", 80)])
def test_unpackable_width_fails_at_layer_creation(fmt, k):
    with pytest.raises(ValueError, match=rf"format='{fmt}'.*in_features={k}"):
        RowParallelLinear(k, HIDDEN, bias=False, quant_config=_config(RolloutPrecision("w4a4", fmt)),
                          prefix="model.layers.0.mlp.down_proj", params_dtype=torch.float32)


def test_modules_not_quantized_stay_high_precision():
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    from megatron_fp4.sglang_plugin.method import MegatronFP4Config

    cfg = MegatronFP4Config.from_config({"quant_method": "megatron_fp4", "format": "hif4",
                                         "modules_not_quantized": ["model.layers.0.mlp.down_proj"]})
    down = RowParallelLinear(FFN, HIDDEN, bias=False, quant_config=cfg, prefix="model.layers.0.mlp.down_proj",
                             params_dtype=torch.float32)
    assert isinstance(down.quant_method, UnquantizedLinearMethod)


@pytest.mark.parametrize("fmt,resq", [("hif4", "2:4"), ("mxfp4", "none")])
def test_serves_an_fp4_export_without_requantizing(tmp_path, fmt, resq):
    """An FP4 checkpoint of models/fp4_checkpoint (weight_packed / weight_scale per linear): SGLang's loaders put
    the stored codes and scales in place and the layer computes with exactly them (no second quantization)."""
    from safetensors.torch import load_file

    transformers = pytest.importorskip("transformers")
    from megatron_fp4.models.fp4_checkpoint import export_fp4_checkpoint
    from megatron_fp4.sglang_plugin.loader import load_weights_and_requantize
    from megatron_fp4.sglang_plugin.method import MegatronFP4Config

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2,
                                   num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, tie_word_embeddings=False,
                                   use_sliding_window=False)
    cfg.architectures = ["Qwen2ForCausalLM"]
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    out = export_fp4_checkpoint(tmp_path / "hf", tmp_path / "fp4", format=fmt, resq=resq,
                                high_precision_first_layers=1, progress=False)
    import json

    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(f))
    config = MegatronFP4Config.from_config(qc)
    config.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    assert config.packed_checkpoint and config.options.precision == RolloutPrecision("w4a4", fmt, resq)
    kw = dict(quant_config=config, params_dtype=torch.float32)
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    first = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=True, prefix="model.layers.0.self_attn.qkv_proj",
                              **kw)
    assert isinstance(first.quant_method, UnquantizedLinearMethod)  # high_precision_first_layers=1
    p = "model.layers.1."
    layers = {"qkv": QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=True, prefix=p + "self_attn.qkv_proj",
                                       **kw),
              "gate_up": MergedColumnParallelLinear(HIDDEN, [FFN, FFN], bias=False, prefix=p + "mlp.gate_up_proj", **kw),
              "down": RowParallelLinear(FFN, HIDDEN, bias=False, prefix=p + "mlp.down_proj", **kw)}
    routes = {"self_attn.q_proj": ("qkv", "q"), "self_attn.k_proj": ("qkv", "k"), "self_attn.v_proj": ("qkv", "v"),
              "mlp.gate_proj": ("gate_up", 0), "mlp.up_proj": ("gate_up", 1), "mlp.down_proj": ("down", None)}
    for module, (key, shard) in routes.items():
        for t in ("weight_packed", "weight_scale"):
            param = getattr(layers[key], t)
            args = (shard,) if shard is not None else ()
            param.weight_loader(param, tensors[f"{p}{module}.{t}"], *args)
    for sid in ("q", "k", "v"):
        layers["qkv"].bias.weight_loader(layers["qkv"].bias, tensors[f"{p}self_attn.{sid}_proj.bias"], sid)
    for m in layers.values():
        m.quant_method.process_weights_after_loading(m)
    f = get_format(fmt)
    cat = lambda names, t: torch.cat([tensors[f"{p}{n}.{t}"] for n in names])  # noqa: E731
    stored = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
    xs = _inputs()
    with torch.no_grad():
        for key, names in stored.items():
            m = layers[key]
            codes, scales = cat(names, "weight_packed"), cat(names, "weight_scale")
            assert torch.equal(m.weight_packed, codes) and torch.equal(m.weight_scale, scales), key
            wq = f.dequantize(QuantizedTensor(f, codes, scales, m.weight.shape, 1, torch.float32))
            b = m.bias if m.bias is not None else None
            assert torch.equal(m(xs[key])[0], rollout_linear(xs[key], m.weight, b, m.quant_method.precision,
                                                             weight_q=wq)), key
            assert torch.equal(m.weight, wq), key
    # a later high-precision refit re-quantizes from the new weights as usual
    new = _hf_weights(21)

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleDict(layers)

        def load_weights(self, named):
            for name, t in named:
                m = self.layers["down"]
                m.weight.weight_loader(m.weight, t)

    load_weights_and_requantize(Tiny(), [("down", new["down"])])
    with torch.no_grad():
        assert torch.equal(layers["down"](xs["down"])[0],
                           rollout_linear(xs["down"], new["down"], None, layers["down"].quant_method.precision))


def test_fused_module_kept_whole_or_not_at_all():
    from megatron_fp4.sglang_plugin.method import MegatronFP4Config

    cfg = MegatronFP4Config.from_config({"quant_method": "megatron_fp4", "format": "hif4",
                                         "modules_not_quantized": ["model.layers.0.self_attn.q_proj"]})
    cfg.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    with pytest.raises(ValueError, match="modules_not_quantized lists only some"):
        QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=True, quant_config=cfg,
                          prefix="model.layers.0.self_attn.qkv_proj", params_dtype=torch.float32)


def _tiny_hf_folder(path, quantization_config=None):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=1,
                                   num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, use_sliding_window=False)
    cfg.architectures = ["Qwen2ForCausalLM"]
    if quantization_config is not None:
        cfg.quantization_config = quantization_config
    cfg.save_pretrained(path)
    return path


@pytest.mark.parametrize("source", ["override", "config.json"])
def test_sglang_start_path_resolves_the_method(tmp_path, source):
    """What SGLang's scheduler does at start (ServerArgs -> ModelConfig -> get_quant_config): the method comes
    from --quantization + json_model_override_args, or from an FP4 export's config.json alone; bad options
    stop it there with the option named."""
    import json

    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.weight_utils import get_quant_config
    from sglang.srt.server_args import ServerArgs

    from megatron_fp4.sglang_plugin.method import MegatronFP4Config

    def resolve(qc):
        if source == "override":
            path = _tiny_hf_folder(tmp_path / "m")
            sa = ServerArgs(model_path=str(path), quantization="megatron_fp4", device="cpu", dtype="float32",
                            skip_tokenizer_init=True, json_model_override_args=json.dumps({"quantization_config": qc}))
        else:
            path = _tiny_hf_folder(tmp_path / f"m{len(list(tmp_path.iterdir()))}", qc)
            sa = ServerArgs(model_path=str(path), device="cpu", dtype="float32", skip_tokenizer_init=True)
        mc = ModelConfig.from_server_args(sa)
        assert mc.quantization == "megatron_fp4"
        return get_quant_config(mc, LoadConfig(), {"qkv_proj": ["q_proj", "k_proj", "v_proj"]})

    cfg = resolve({"quant_method": "megatron_fp4", "format": "mxfp4", "resq": "2:4"})
    assert isinstance(cfg, MegatronFP4Config)
    assert cfg.options.precision == RolloutPrecision("w4a4", "mxfp4", "2:4")
    for bad, needle in (({"format": "fp5"}, "format='fp5'"), ({"resq": "3:4"}, "resq='3:4'")):
        with pytest.raises(ValueError) as info:
            resolve({"quant_method": "megatron_fp4", **bad})
        assert needle in str(info.value)


@pytest.mark.parametrize("precision", [RolloutPrecision("w4a4", "hif4", "2:4"), RolloutPrecision("bf16")])
def test_engine_args_are_valid_server_args(tmp_path, precision):
    """SGLangRolloutEngine's Engine arguments build SGLang's ServerArgs and ModelConfig with the intended method."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.weight_utils import get_quant_config
    from sglang.srt.server_args import ServerArgs

    from megatron_fp4.rollout.sglang_engine import SGLangRolloutEngine
    from megatron_fp4.sglang_plugin.loader import REQUANTIZING_LOADER

    path = _tiny_hf_folder(tmp_path / "m")
    kwargs = SGLangRolloutEngine.engine_args(path, precision, device="cpu", attention_backend="torch_native",
                                             dtype="float32", disable_cuda_graph=True)
    sa = ServerArgs(**kwargs)
    assert sa.custom_weight_loader == [REQUANTIZING_LOADER] and sa.skip_tokenizer_init
    mc = ModelConfig.from_server_args(sa)
    if precision.mode == "bf16":
        assert mc.quantization is None
        return
    cfg = get_quant_config(mc, LoadConfig(), {})
    assert cfg.options.precision == precision


def test_driver_engine_args_are_valid_server_args(tmp_path):
    """pretrain_rl.py's Engine arguments (--sglang-* flags, ports per local rank, dummy load, memory saver with
    --offload-rollout, --sglang-server-args) are ServerArgs fields of the installed SGLang (0.5.17 has the same
    names), and so is every field --sglang-server-args refuses as the driver's own."""
    import torch
    from sglang.srt.server_args import ServerArgs

    from megatron_fp4.rl.config import RolloutConfig
    from megatron_fp4.rl.rollout_manager import sglang_engine_kwargs
    from megatron_fp4.rollout.sglang_engine import SGLangRolloutEngine

    from megatron_fp4.rl.config import SGLANG_DRIVER_FIELDS
    from megatron_fp4.rollout.sglang_engine import sglang_server_args_fields

    fields = sglang_server_args_fields()
    assert "chunked_prefill_size" in fields
    assert not set(SGLANG_DRIVER_FIELDS) - set(fields)  # what --sglang-server-args refuses names real fields
    cfg = RolloutConfig(sglang_mem_fraction_static=0.35, sglang_cuda_graph_max_bs=96, offload_rollout=True,
                        sglang_attention_backend="flashinfer", sglang_base_port=32000,
                        sglang_server_args='{"chunked_prefill_size": 2048}')
    kwargs = SGLangRolloutEngine.engine_args(_tiny_hf_folder(tmp_path / "m"), RolloutPrecision("w4a4", "hif4", "2:4"),
                                             **sglang_engine_kwargs(cfg, torch.bfloat16, seed=3))
    sa = ServerArgs(**kwargs)
    assert (sa.load_format, sa.mem_fraction_static, sa.attention_backend) == ("dummy", 0.35, "flashinfer")
    assert (sa.port, sa.nccl_port, sa.random_seed, sa.enable_memory_saver) == (32000, 32008, 3, True)
    assert sa.cuda_graph_max_bs_decode == 96 and sa.chunked_prefill_size == 2048 and sa.disable_prefill_cuda_graph


def _sglang_mlp(precision: RolloutPrecision, w):
    """SGLang's own Qwen2MLP with the plug-in at ``precision``, ``w`` loaded through its loaders and quantized."""
    from sglang.srt.models.qwen2 import Qwen2MLP

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        sgl = Qwen2MLP(HIDDEN, FFN, "silu", quant_config=_config(precision), prefix="model.layers.0.mlp")
    finally:
        torch.set_default_dtype(default)
    gu = sgl.gate_up_proj.weight
    gu.weight_loader(gu, w["gate"], 0)
    gu.weight_loader(gu, w["up"], 1)
    sgl.down_proj.weight.weight_loader(sgl.down_proj.weight, w["down"])
    for m in (sgl.gate_up_proj, sgl.down_proj):
        m.quant_method.process_weights_after_loading(m)
    return sgl


@pytest.mark.parametrize("name", ["hif4+2:4", "mxfp4+2:4"])
def test_sglang_qwen2_mlp_equals_native_mlp(name):
    """SGLang's own Qwen2MLP (gate_up -> SiluAndMul -> down, the down_proj quantizing SGLang's activation) with the
    plug-in equals the MLP of megatron-core's GPT layer in the native engine's rollout precision."""
    from megatron_fp4.models import GPTModelArgs, build_gpt_model
    from megatron_fp4.parallel import initialize_parallel
    from megatron_fp4.rollout.precision import rollout_precision

    precision = PRECISIONS[name]
    initialize_parallel(1, 1, seed=3)
    model = build_gpt_model(GPTModelArgs(
        num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS, num_query_groups=KV_HEADS,
        kv_channels=HEAD_DIM, vocab_size=64, max_seq_len=64, add_qkv_bias=True, swiglu=True,
        normalization="RMSNorm")).eval()
    w = _hf_weights(5)
    mlp = model.decoder.layers[0].mlp
    with torch.no_grad():
        mlp.linear_fc1.weight.copy_(torch.cat([w["gate"], w["up"]]))
        mlp.linear_fc2.weight.copy_(w["down"])
    sgl = _sglang_mlp(precision, w)
    x = _inputs(6)["qkv"]
    with torch.no_grad(), rollout_precision(model, precision):
        y_mg, b = mlp(x.unsqueeze(1))
        y_sgl = sgl(x)
    assert b is None
    torch.testing.assert_close(y_sgl, y_mg.squeeze(1), rtol=0, atol=1e-5)
    with torch.no_grad():  # and FP4 mattered: the bf16 MLP differs by far more
        ref = torch.nn.functional.linear(torch.nn.functional.silu(x @ w["gate"].t()) * (x @ w["up"].t()), w["down"])
    assert (ref - y_sgl).abs().max() > 1e-3


def _bf16_sum_operand(h: torch.Tensor, fmt: str) -> torch.Tensor:
    """What the fused kernels make from the op's output ``h``: the ResQ linear's own operand (bf16 sum), held in
    ``h``'s dtype (the kernels' is bf16; these CPU layers compute in fp32)."""
    from megatron_fp4.resq import resq_activation

    return resq_activation(h, fmt, "2:4", dim=-1, out_dtype=torch.bfloat16).to(h.dtype)


@pytest.mark.parametrize("fmt", ["hif4", "mxfp4"])
def test_fused_swiglu_makes_down_projs_operand(fmt, monkeypatch):
    """At W4A4 + ResQ 2:4 (bf16 sum), SGLang's own Qwen2MLP gets the fused SwiGLU + ResQ activation (same object
    and parameter names) whose operand down_proj multiplies as W4A16: with the CUDA kernel stood in for by the
    reference ops (its bits are tests/test_cuda_quantize.py's GPU tests), the MLP's output is the unfused one's
    exactly, and the kernel served every call. Not at other precisions, nor with MEGATRON_FP4_FUSED_SWIGLU_RESQ=0,
    nor where the kernel does not apply (then SGLang's SiluAndMul serves and down_proj quantizes as before)."""
    from sglang.srt.layers.activation import SiluAndMul

    from megatron_fp4.kernels import cuda_quantize
    from megatron_fp4.kernels.cuda_quantize import SWIGLU_RESQ_SWITCH as SWIGLU_SWITCH
    from megatron_fp4.sglang_plugin.fused import SiluAndMulResQ

    precision = RolloutPrecision("w4a4", fmt, "2:4", resq_combine="bf16")
    w = _hf_weights(7)
    x = _inputs(8)["qkv"]
    calls = []

    def swiglu_resq(a, f):
        assert f == fmt
        calls.append(a.shape)
        return _bf16_sum_operand(SiluAndMul().forward_native(a), f)

    monkeypatch.setenv(SWIGLU_SWITCH, "0")
    plain = _sglang_mlp(precision, w)
    monkeypatch.delenv(SWIGLU_SWITCH)
    fused = _sglang_mlp(precision, w)
    assert type(plain.act_fn) is SiluAndMul and type(fused.act_fn) is SiluAndMulResQ
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert type(_sglang_mlp(PRECISIONS["hif4+2:4"], w).act_fn) is SiluAndMul  # the exact combine: its own quantize
    with torch.no_grad():
        want = plain(x)
        unfused_here = fused(x)  # on the CPU the kernel does not apply: SGLang's activation, down_proj's quantize
        monkeypatch.setattr(cuda_quantize, "swiglu_resq_usable", lambda a, f: True)
        monkeypatch.setattr(cuda_quantize, "swiglu_resq", swiglu_resq)
        got = fused(x)
        assert plain(x).equal(want)  # the plain MLP never calls the kernel
    assert calls == [(x.shape[0], 2 * FFN)]
    assert unfused_here.equal(want) and got.equal(want)
    with torch.no_grad():  # and the operand mattered: W4A16 on SGLang's plain activation is another output
        assert (want - _sglang_mlp(RolloutPrecision("w4a16", fmt), w)(x)).abs().max() > 0


class _DecoderLike(torch.nn.Module):
    """The attributes of SGLang's Qwen2 / Llama decoder layers that the fused norms read, in their order: the
    attention's qkv_proj and the MLP's gate_up_proj, then the two RMSNorms (SGLang's real classes; its whole layer
    needs a rotary embedding and a layer stack that a CPU test cannot build)."""

    def __init__(self, precision: RolloutPrecision, w):
        from sglang.srt.layers.layernorm import RMSNorm

        super().__init__()
        layers = _loaded_layers(precision, w)
        self.self_attn, self.mlp = torch.nn.Module(), torch.nn.Module()
        self.self_attn.qkv_proj = layers["qkv"]
        self.mlp.gate_up_proj = layers["gate_up"]
        self.input_layernorm = RMSNorm(HIDDEN, eps=1e-6)
        self.post_attention_layernorm = RMSNorm(HIDDEN, eps=1e-6)
        g = torch.Generator().manual_seed(9)
        for norm in (self.input_layernorm, self.post_attention_layernorm):
            norm.weight.data.copy_(1 + 0.1 * torch.randn(HIDDEN, generator=g))


@pytest.mark.parametrize("fmt", ["hif4", "mxfp4"])
def test_fused_norms_make_qkv_and_gate_ups_operand(fmt, monkeypatch):
    """At W4A4 + ResQ 2:4 (bf16 sum), SGLang's RMSNorms before qkv_proj and gate_up_proj get the fused residual
    add + RMSNorm + ResQ forward: with the kernel stood in for by the reference ops, each linear's output and the
    new residual are the unfused ones' exactly (with and without a residual), the operand went to its own linear,
    and a linear handed an operand fails loudly when it gets another tensor."""
    from sglang.srt.layers.layernorm import RMSNorm

    from megatron_fp4.kernels import decode_ops
    from megatron_fp4.kernels.cuda_quantize import NORM_RESQ_SWITCH as NORM_SWITCH
    from megatron_fp4.sglang_plugin.fused import RMSNormResQ

    precision = RolloutPrecision("w4a4", fmt, "2:4", resq_combine="bf16")
    w = _hf_weights(10)
    monkeypatch.setenv(NORM_SWITCH, "0")
    plain = _DecoderLike(precision, w)
    monkeypatch.delenv(NORM_SWITCH)
    fused = _DecoderLike(precision, w)
    assert {type(plain.input_layernorm), type(plain.post_attention_layernorm)} == {RMSNorm}
    assert {type(fused.input_layernorm), type(fused.post_attention_layernorm)} == {RMSNormResQ}
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert type(_DecoderLike(PRECISIONS["hif4+2:4"], w).input_layernorm) is RMSNorm
    calls = []

    def rms_norm_resq(x, delta, weight, eps, f):
        assert f == fmt
        calls.append(delta is not None)
        ref = RMSNorm(HIDDEN, eps=eps)
        ref.weight.data.copy_(weight)
        out = ref.forward_native(x, delta) if delta is not None else (ref.forward_native(x), x)
        return _bf16_sum_operand(out[0], f), out[1]

    monkeypatch.setattr(decode_ops, "rms_norm_resq", rms_norm_resq)
    g = torch.Generator().manual_seed(11)
    x, r = torch.randn(37, HIDDEN, generator=g), torch.randn(37, HIDDEN, generator=g)
    x[:, 5] *= 30.0
    with torch.no_grad():
        h0 = fused.input_layernorm(x)  # the first layer: no residual yet
        got = fused.self_attn.qkv_proj(h0)[0]
        assert got.equal(plain.self_attn.qkv_proj(plain.input_layernorm(x))[0])
        h, s = fused.post_attention_layernorm(x, r)
        want_h, want_s = plain.post_attention_layernorm(x, r)
        assert s.equal(want_s)
        assert fused.mlp.gate_up_proj(h)[0].equal(plain.mlp.gate_up_proj(want_h)[0])
        assert calls == [False, True]
        fused.input_layernorm(x)  # an operand that nobody keeps leaves nothing behind
        assert fused.self_attn.qkv_proj(x)[0].equal(plain.self_attn.qkv_proj(x)[0])
        h0 = fused.input_layernorm(x)
        with pytest.raises(RuntimeError, match="MEGATRON_FP4_FUSED_NORM_RESQ=0"):
            fused.self_attn.qkv_proj(x)  # not the operand its norm made for it
        assert fused.self_attn.qkv_proj(x)[0].equal(plain.self_attn.qkv_proj(x)[0])  # (the hand-off is one call)
