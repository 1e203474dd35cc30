"""FP4 rollout checkpoint export: reference packed layout, quantization_config, logits == fake-quantized weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from test_tools_helpers import VARIANTS, make_hf_model, run_tool

from megatron_fp4.formats import get_format
from megatron_fp4.models.fp4_checkpoint import (
    QUANTIZED_LINEARS,
    FP4FolderSource,
    export_fp4_checkpoint,
    load_fp4_checkpoint,
)
from megatron_fp4.models.hf_conversion import HFFolderSource
from megatron_fp4.models.loading import convert_hf_to_megatron, load_gpt

MEGATRON_LINEARS = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    for name in ("qwen2_tied", "qwen2_untied", "llama_bf16"):
        make_hf_model(name, root / name, seed=1)
    return {n: root / n for n in ("qwen2_tied", "qwen2_untied", "llama_bf16")}


def _ids(vocab, b=2, s=12):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(3))


def _mg_logits(model, ids):
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)


@pytest.mark.parametrize("fmt", ["hif4", "mxfp4"])
def test_packed_layout_is_the_reference_quantizer(fmt, hf_models, tmp_path):
    name = "qwen2_tied"  # intermediate 96: down_proj's K is padded to the HiF4 block of 64
    out = export_fp4_checkpoint(hf_models[name], tmp_path / "fp4", fmt, "2:4", progress=False)
    src, exp = HFFolderSource(hf_models[name]), HFFolderSource(out)
    F = get_format(fmt)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "megatron_fp4" and qc["format"] == fmt and qc["resq"] == "2:4"
    assert qc["block_size"] == F.block_size and qc["activation_format"] == fmt
    layers = VARIANTS[name]["layers"]
    assert sorted(qc["quantized_modules"]) == sorted(f"model.layers.{i}.{m}" for i in range(layers)
                                                       for m in QUANTIZED_LINEARS)
    assert "model.embed_tokens" in qc["modules_not_quantized"] and "model.norm" in qc["modules_not_quantized"]
    for module, info in qc["quantized_modules"].items():
        w = src.get(module + ".weight")
        assert info["shape"] == list(w.shape)
        qt = F.quantize(w, dim=-1)
        assert not exp.has(module + ".weight")
        packed, scale = exp.get(module + ".weight_packed"), exp.get(module + ".weight_scale")
        assert packed.dtype == torch.uint8 and torch.equal(packed, qt.codes), module
        assert scale.dtype == torch.uint8 and torch.equal(scale, qt.scales), module
    for k in src.keys():  # everything else (embeddings, norms, biases) is carried over unchanged
        if not any(k == f"{m}.weight" for m in qc["quantized_modules"]):
            assert torch.equal(src.get(k), exp.get(k)), k
    assert (out / "generation_config.json").is_file()


@pytest.mark.parametrize("fmt", ["hif4", "mxfp4"])
@pytest.mark.parametrize("name", ["qwen2_tied", "qwen2_untied"])
def test_loaded_fp4_logits_equal_fake_quantized_model(fmt, name, hf_models, tmp_path):
    out = export_fp4_checkpoint(hf_models[name], tmp_path / "fp4", fmt, "none", progress=False)
    F = get_format(fmt)
    ref = load_gpt(hf_models[name])
    with torch.no_grad():
        n = 0
        for pname, p in ref.named_parameters():
            if pname.endswith(MEGATRON_LINEARS):
                p.copy_(F.fake_quantize(p, dim=-1))
                n += 1
        assert n == 4 * VARIANTS[name]["layers"]
    ids = _ids(VARIANTS[name]["vocab"])
    expected = _mg_logits(ref, ids)
    got = _mg_logits(load_gpt(out), ids)
    assert torch.equal(got, expected)
    # the dequantized HF state dict runs in transformers too (within fp32 tolerance of megatron)
    from transformers import AutoConfig, AutoModelForCausalLM

    ck = load_fp4_checkpoint(out, packed=True)
    cfg = {k: v for k, v in ck.config.items() if k != "quantization_config"}
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg)).eval()
    missing, unexpected = hf.load_state_dict(ck.state_dict, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing)
    if VARIANTS[name]["tie"]:
        hf.tie_weights()
    with torch.no_grad():
        assert (hf(ids).logits - expected).abs().max().item() <= 1e-4
    module = "model.layers.0.mlp.down_proj"
    assert torch.equal(ck.quantized[module].dequantize(), ck.state_dict[module + ".weight"])


def test_export_from_megatron_checkpoint_equals_export_from_hf(hf_models, tmp_path):
    name = "qwen2_untied"
    mg = tmp_path / "mg"
    convert_hf_to_megatron(hf_models[name], mg, 2, 2, progress=False)
    a = export_fp4_checkpoint(hf_models[name], tmp_path / "a", "hif4", "channel", progress=False)
    b = export_fp4_checkpoint(mg, tmp_path / "b", "hif4", "channel", max_shard_bytes=32 * 1024, progress=False)
    assert (b / "model.safetensors.index.json").is_file()
    ra, rb = HFFolderSource(a), HFFolderSource(b)
    assert sorted(ra.keys()) == sorted(rb.keys())
    assert all(torch.equal(ra.get(k), rb.get(k)) for k in ra.keys())
    ca, cb = (json.loads((d / "config.json").read_text())["quantization_config"] for d in (a, b))
    assert ca == cb


def test_bf16_source_and_high_precision_layers(hf_models, tmp_path):
    name = "llama_bf16"
    out = export_fp4_checkpoint(hf_models[name], tmp_path / "fp4", "mxfp4", "dense",
                                high_precision_first_layers=1, progress=False)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert sorted(qc["quantized_modules"]) == sorted(f"model.layers.1.{m}" for m in QUANTIZED_LINEARS)
    assert "model.layers.0.self_attn.q_proj" in qc["modules_not_quantized"]
    src = HFFolderSource(hf_models[name])
    ck = load_fp4_checkpoint(out)
    w = ck.state_dict["model.layers.1.mlp.up_proj.weight"]
    assert w.dtype == torch.bfloat16
    assert torch.equal(w, get_format("mxfp4").fake_quantize(src.get("model.layers.1.mlp.up_proj.weight")))
    assert torch.equal(ck.state_dict["model.layers.0.mlp.up_proj.weight"],
                       src.get("model.layers.0.mlp.up_proj.weight"))


def test_cli_and_errors(hf_models, tmp_path):
    r = run_tool("export_fp4_checkpoint.py", "--hf-path", str(hf_models["qwen2_tied"]), "--save",
                 str(tmp_path / "fp4"), "--format", "hif4", "--resq", "2:4", "--resq-combine", "bf16")
    assert r.returncode == 0, r.stderr
    assert "export hif4" in r.stderr  # progress bar
    qc = json.loads((tmp_path / "fp4" / "config.json").read_text())["quantization_config"]
    assert (qc["resq"], qc["resq_combine"]) == ("2:4", "bf16")
    assert isinstance(FP4FolderSource(tmp_path / "fp4"), FP4FolderSource)
    r = run_tool("export_fp4_checkpoint.py", "--hf-path", str(hf_models["qwen2_tied"]), "--save",
                 str(tmp_path / "x"), "--format", "hif4", "--resq", "3:4")
    assert r.returncode == 2 and "--resq" in r.stderr and "2:4" in r.stderr
    with pytest.raises(ValueError, match=r"--resq '1:2' is not valid; allowed values: none, 2:4, channel"):
        export_fp4_checkpoint(hf_models["qwen2_tied"], tmp_path / "y", "hif4", "1:2", progress=False)
    with pytest.raises(ValueError, match=r"--resq-combine 'bf16' needs a ResQ residual"):
        export_fp4_checkpoint(hf_models["qwen2_tied"], tmp_path / "y", "hif4", "none", resq_combine="bf16",
                              progress=False)
    with pytest.raises(ValueError, match=r"--format 'fp3' is not valid; allowed values: hif4, mxfp4"):
        export_fp4_checkpoint(hf_models["qwen2_tied"], tmp_path / "y", "fp3", "none", progress=False)
    with pytest.raises(ValueError, match="already an FP4 export"):
        export_fp4_checkpoint(tmp_path / "fp4", tmp_path / "z", "hif4", "none", progress=False)
    # a damaged export: a packed tensor missing from the index
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "fp4", bad)
    from safetensors.torch import load_file, save_file

    sd = load_file(str(bad / "model.safetensors"))
    del sd["model.layers.1.mlp.down_proj.weight_scale"]
    save_file(sd, str(bad / "model.safetensors"))
    with pytest.raises(KeyError, match=r"model.layers.1.mlp.down_proj.weight_scale is missing"):
        load_fp4_checkpoint(bad)


def test_native_engine_on_mxfp4_export_equals_engine_on_original(hf_models, tmp_path):
    """The native rollout engine (W4A16) on the loaded MXFP4 export computes exactly what it computes on the
    original weights (MXFP4 re-quantization of dequantized weights is the identity). HiF4 is not idempotent:
    an engine must use the stored HiF4 weights without quantizing them again (see tools/README.md)."""
    from megatron_fp4.resq import RolloutPrecision
    from megatron_fp4.rollout.native import full_forward_logits
    from megatron_fp4.rollout.precision import rollout_precision

    name = "qwen2_untied"
    out = export_fp4_checkpoint(hf_models[name], tmp_path / "fp4", "mxfp4", "none", progress=False)
    seqs = [list(range(5, 17)), list(range(20, 30))]
    logits = []
    for src in (hf_models[name], out):
        model = load_gpt(src)
        with rollout_precision(model, RolloutPrecision("w4a16", "mxfp4")):
            logits.append(full_forward_logits(model, seqs))
    assert torch.equal(logits[0], logits[1])


def test_nvfp4_export_has_a_global_scale_per_hf_module(hf_models, tmp_path):
    """NVFP4 (Python API only) stores its fp32 per-tensor scale per HF module (q, k, v, gate, up separately)."""
    name = "qwen2_untied"
    out = export_fp4_checkpoint(hf_models[name], tmp_path / "fp4", "nvfp4", "none", progress=False)
    src, exp = HFFolderSource(hf_models[name]), HFFolderSource(out)
    ck = load_fp4_checkpoint(out, packed=True)
    F = get_format("nvfp4")
    for module, qt in ck.quantized.items():
        w = src.get(module + ".weight")
        ref = F.quantize(w, dim=-1)
        assert torch.equal(exp.get(module + ".weight_global_scale"), ref.global_scale.reshape(()))
        assert torch.equal(ck.state_dict[module + ".weight"], F.fake_quantize(w, dim=-1)), module
