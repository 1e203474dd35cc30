"""HF <-> megatron-core checkpoint conversion: logits at TP=1 / TP=2 / PP=2, bit-exact round trips, clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from test_tools_helpers import VARIANTS, make_hf_model, run_tool

from megatron_fp4.models.checkpoint_io import MegatronCheckpoint, shard_dirname
from megatron_fp4.models.hf_conversion import HFFolderSource, convert_megatron_to_hf
from megatron_fp4.models.loading import convert_hf_to_megatron, load_gpt

ATOL = 1e-4


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name in VARIANTS:
        make_hf_model(name, root / name)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def converted(hf_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron")
    cache = {}

    def get(name: str, tp: int = 1, pp: int = 1):
        key = (name, tp, pp)
        if key not in cache:
            cache[key] = root / f"{name}_tp{tp}_pp{pp}"
            convert_hf_to_megatron(hf_models[name], cache[key], tp, pp, progress=False)
        return cache[key]

    return get


def _hf_logits(path, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def _mg_logits(model, ids):
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return model(ids, pos, None).float()


def _ids(vocab, b=2, s=12, seed=0):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["qwen2_tied", "qwen2_untied", "llama"])
def test_logits_match_transformers_tp1(name, hf_models, converted):
    ckpt = converted(name, 1, 1)
    args = json.loads((ckpt / "release" / "args.json").read_text())
    assert args["tensor_model_parallel_size"] == 1 and args["model_args"]["params_dtype"] == "float32"
    ids = _ids(VARIANTS[name]["vocab"])
    ref = _hf_logits(hf_models[name], ids)
    assert ref.std() > 0.5  # O(1) logits: the tolerance is meaningful
    out = _mg_logits(load_gpt(ckpt), ids)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() <= ATOL


def test_load_gpt_merges_tp_pp_shards_and_reads_hf_folders(hf_models, converted):
    name = "qwen2_untied"
    ids = _ids(VARIANTS[name]["vocab"])
    ref = _hf_logits(hf_models[name], ids)
    ckpt = converted(name, 2, 2)
    assert sorted(p.name for p in (ckpt / "release").iterdir() if p.is_dir()) == sorted(
        shard_dirname(t, p) for t in range(2) for p in range(2))
    assert (_mg_logits(load_gpt(ckpt), ids) - ref).abs().max().item() <= ATOL
    assert (_mg_logits(load_gpt(hf_models[name]), ids) - ref).abs().max().item() <= ATOL


def test_padded_vocabulary_bf16(hf_models, converted):
    """Odd vocabulary at TP=2 is padded with zero rows; bf16 weights stay bf16 and logits follow transformers'."""
    name = "llama_bf16"
    ckpt = MegatronCheckpoint(converted(name, 2, 1))
    assert ckpt.model_args["vocab_size"] == 98 and ckpt.args["hf_vocab_size"] == 97
    emb = ckpt.full_tensor("embedding.word_embeddings.weight")
    assert emb.dtype == torch.bfloat16 and emb.shape[0] == 98 and not emb[97].any()
    ids = _ids(97)
    ref = _hf_logits(hf_models[name], ids)
    out = _mg_logits(load_gpt(ckpt.dir, params_dtype=torch.float32), ids)
    assert out.shape[-1] == 98
    assert (out[..., :97] - ref).abs().max().item() <= ATOL


@pytest.mark.parametrize("name,tp,pp", [("qwen2_tied", 2, 2), ("qwen2_untied", 2, 2), ("llama", 2, 1),
                                        ("llama_bf16", 2, 2), ("qwen2_untied", 1, 4)])
def test_roundtrip_is_bit_exact(name, tp, pp, hf_models, converted, tmp_path):
    out = convert_megatron_to_hf(converted(name, tp, pp), tmp_path / "hf", max_shard_bytes=64 * 1024,
                                 progress=False)
    a, b = HFFolderSource(hf_models[name]), HFFolderSource(out)
    assert sorted(a.keys()) == sorted(b.keys())
    for k in a.keys():
        x, y = a.get(k), b.get(k)
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert torch.equal(x.view(torch.uint8) if x.dtype == torch.bfloat16 else x,
                           y.view(torch.uint8) if y.dtype == torch.bfloat16 else y), k
    ca = json.loads((hf_models[name] / "config.json").read_text())
    cb = json.loads((out / "config.json").read_text())
    assert ca == cb
    assert (out / "generation_config.json").is_file()


def test_converted_back_loads_in_transformers(hf_models, converted, tmp_path):
    name = "qwen2_tied"
    out = convert_megatron_to_hf(converted(name, 2, 2), tmp_path / "hf", progress=False)
    ids = _ids(96)
    assert torch.equal(_hf_logits(out, ids), _hf_logits(hf_models[name], ids))


def test_cli_end_to_end(hf_models, tmp_path):
    name = "llama"
    r = run_tool("convert_hf_to_megatron.py", "--hf-path", str(hf_models[name]), "--save", str(tmp_path / "mg"),
                 "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2")
    assert r.returncode == 0, r.stderr
    assert "hf->megatron" in r.stderr  # progress bar
    assert (tmp_path / "mg" / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    assert (tmp_path / "mg" / "release" / "mp_rank_01_001" / "model.safetensors").is_file()
    r = run_tool("convert_megatron_to_hf.py", "--load", str(tmp_path / "mg"), "--save", str(tmp_path / "hf"),
                 "--max-shard-size", "50KB", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    a, b = HFFolderSource(hf_models[name]), HFFolderSource(tmp_path / "hf")
    assert all(torch.equal(a.get(k), b.get(k)) for k in a.keys())


# -- distributed: TP=2 and PP=2 under torchrun/gloo on CPU -----------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_logits_match_transformers_torchrun(tp, pp, hf_models, converted):
    names = ["qwen2_tied", "qwen2_untied", "llama"]
    # qwen2_untied is loaded from a checkpoint written at TP=PP=1 (resharded on load); the others natively
    args = []
    for n in names:
        ct, cp = (1, 1) if n == "qwen2_untied" else (tp, pp)
        args += ["--hf-path", str(hf_models[n]), "--load", str(converted(n, ct, cp))]
    r = run_tool("verify_conversion.py", "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size",
                 str(pp), "--atol", str(ATOL), *args, nproc=2)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    results = [json.loads(line[len("VERIFY "):]) for line in r.stdout.splitlines() if line.startswith("VERIFY ")]
    assert len(results) == len(names)
    for res in results:
        assert res["ok"] and res["tp"] == tp and res["pp"] == pp and res["max_abs_diff"] <= ATOL, res
        assert res["logit_std"] > 0.5


@pytest.mark.slow
def test_logits_match_transformers_torchrun_tp2_pp2_and_distributed_save(hf_models, converted, tmp_path):
    """TP=2 x PP=2 on 4 processes; each rank then saves its shard (save_model_checkpoint) and the saved
    checkpoint converts back to the original HF tensors bit for bit."""
    names = ["qwen2_tied", "llama"]
    args = []
    for n in names:
        args += ["--hf-path", str(hf_models[n]), "--load", str(converted(n, 2, 2))]
    r = run_tool("verify_conversion.py", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                 "--atol", str(ATOL), "--save", str(tmp_path / "saved"), *args, nproc=4)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    results = [json.loads(line[len("VERIFY "):]) for line in r.stdout.splitlines() if line.startswith("VERIFY ")]
    assert len(results) == len(names) and all(res["ok"] for res in results), results
    for i, n in enumerate(names):
        saved = tmp_path / "saved" / str(i)
        assert (saved / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
        assert (saved / "iter_0000001" / "mp_rank_01_001" / "model.safetensors").is_file()
        out = convert_megatron_to_hf(saved, tmp_path / f"hf{i}", progress=False)
        a, b = HFFolderSource(hf_models[n]), HFFolderSource(out)
        assert sorted(a.keys()) == sorted(b.keys())
        assert all(torch.equal(a.get(k), b.get(k)) for k in a.keys()), n


# -- errors ---------------------------------------------------------------------------------------------------------
def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_error_unsupported_architecture(hf_models, tmp_path):
    d = _copy(hf_models["llama"], tmp_path / "m")
    _edit_config(d, architectures=["MistralForCausalLM"], model_type="mistral")
    with pytest.raises(ValueError, match=r"unsupported architecture 'MistralForCausalLM'.*supported: "
                                         r"Qwen2ForCausalLM.*LlamaForCausalLM"):
        convert_hf_to_megatron(d, tmp_path / "out", progress=False)
    r = run_tool("convert_hf_to_megatron.py", "--hf-path", str(d), "--save", str(tmp_path / "out2"))
    assert r.returncode == 2 and r.stderr.startswith("convert_hf_to_megatron.py: error: ") and "Traceback" not in r.stderr
    assert f"{d / 'config.json'}: unsupported architecture 'MistralForCausalLM'" in r.stderr


def test_error_tp_does_not_divide_heads(hf_models, tmp_path):
    with pytest.raises(ValueError, match=r"--tensor-model-parallel-size 3 does not divide num_attention_heads=4"):
        convert_hf_to_megatron(hf_models["qwen2_tied"], tmp_path / "o", 3, 1, progress=False)
    with pytest.raises(ValueError, match=r"--tensor-model-parallel-size 4 does not divide num_key_value_heads=2"):
        convert_hf_to_megatron(hf_models["qwen2_tied"], tmp_path / "o", 4, 1, progress=False)
    with pytest.raises(ValueError, match=r"--pipeline-model-parallel-size 3 does not divide num_hidden_layers=2"):
        convert_hf_to_megatron(hf_models["qwen2_tied"], tmp_path / "o", 1, 3, progress=False)


def test_error_vocabulary_and_shape_mismatch(hf_models, tmp_path):
    d = _copy(hf_models["qwen2_tied"], tmp_path / "v")
    _edit_config(d, vocab_size=100)
    with pytest.raises(ValueError, match=r"vocabulary mismatch: model.embed_tokens.weight has 96 rows but "
                                         r"config.json vocab_size is 100"):
        convert_hf_to_megatron(d, tmp_path / "o", progress=False)
    d = _copy(hf_models["qwen2_tied"], tmp_path / "s")
    _edit_config(d, intermediate_size=128)
    with pytest.raises(ValueError, match=r"shape mismatch for model.layers.0.mlp.gate_proj.weight: \(96, 64\)"):
        convert_hf_to_megatron(d, tmp_path / "o", progress=False)


def test_error_missing_files_and_tensors(hf_models, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert_hf_to_megatron(tmp_path / "nowhere", tmp_path / "o", progress=False)
    d = _copy(hf_models["qwen2_untied"], tmp_path / "m")
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config.json not found"):
        convert_hf_to_megatron(d, tmp_path / "o", progress=False)
    d = _copy(hf_models["qwen2_untied"], tmp_path / "s")
    victim = sorted(d.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=r"lists shard files that are missing: .*" + victim.name):
        convert_hf_to_megatron(d, tmp_path / "o", progress=False)
    d = _copy(hf_models["qwen2_tied"], tmp_path / "u")
    _edit_config(d, tie_word_embeddings=False)
    with pytest.raises(KeyError, match=r"lm_head.weight is missing .*tie_word_embeddings=false"):
        convert_hf_to_megatron(d, tmp_path / "o", progress=False)
    with pytest.raises(FileNotFoundError, match=r"latest_checkpointed_iteration.txt not found"):
        convert_megatron_to_hf(hf_models["llama"], tmp_path / "o2", progress=False)


def test_error_missing_megatron_shard(converted, tmp_path):
    ckpt = _copy(converted("llama", 2, 1), tmp_path / "c")
    (ckpt / "release" / "mp_rank_01_000" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"checkpoint shard .*mp_rank_01_000/model.safetensors is missing"):
        convert_megatron_to_hf(ckpt, tmp_path / "o", progress=False)


def test_save_model_checkpoint_single_process_and_format_detection(converted, hf_models, tmp_path):
    from megatron_fp4.models.checkpoint_io import (
        checkpoint_tokenizer_dir,
        is_megatron_checkpoint,
        model_args_from_json,
        save_model_checkpoint,
    )

    ckpt = MegatronCheckpoint(converted("llama", 2, 2))
    model = load_gpt(ckpt.dir.parent)
    it_dir = save_model_checkpoint(model, tmp_path / "s", 5, model_args_from_json(ckpt.model_args), like=ckpt)
    assert it_dir.name == "iter_0000005"
    saved = MegatronCheckpoint(tmp_path / "s")
    assert saved.tp == 1 and saved.pp == 1 and saved.args["iteration"] == 5
    assert saved.args["hf_config"] == ckpt.args["hf_config"]
    for name in ("embedding.word_embeddings.weight", "decoder.layers.1.mlp.linear_fc1.weight",
                 "decoder.layers.0.self_attention.linear_qkv.weight", "output_layer.weight"):
        assert torch.equal(saved.full_tensor(name), ckpt.full_tensor(name)), name
    assert is_megatron_checkpoint(tmp_path / "s") and is_megatron_checkpoint(it_dir)
    assert not is_megatron_checkpoint(hf_models["llama"])
    rl = tmp_path / "rl"  # the RL driver's resume checkpoints share the tracker file name, not the format
    (rl / "iter_0000100").mkdir(parents=True)
    (rl / "iter_0000100" / "metadata.json").write_text("{}")
    (rl / "latest_checkpointed_iteration.txt").write_text("100\n")
    assert not is_megatron_checkpoint(rl)
    tok = checkpoint_tokenizer_dir(tmp_path / "s")
    assert tok is not None and (tok / "generation_config.json").is_file()


def test_checkpoint_without_hf_config_converts_to_a_loadable_hf_model(tmp_path):
    """A model trained from scratch (no source config.json): convert_megatron_to_hf synthesizes config.json."""
    from megatron_fp4.models import GPTModelArgs, build_gpt_model
    from megatron_fp4.models.checkpoint_io import save_model_checkpoint
    from megatron_fp4.parallel import initialize_parallel

    initialize_parallel(1, 1, seed=7)
    args = GPTModelArgs(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                        vocab_size=80, max_seq_len=64, add_qkv_bias=True, tie_embeddings=True, norm_epsilon=1e-5,
                        rotary_base=20000.0, init_method_std=0.15)
    model = build_gpt_model(args, parallel_output=False).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "layernorm" in n or n.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))
    save_model_checkpoint(model, tmp_path / "mg", 3, args)
    out = convert_megatron_to_hf(tmp_path / "mg", tmp_path / "hf", progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["tie_word_embeddings"] is True
    ids = _ids(80)
    assert (_hf_logits(out, ids) - _mg_logits(model, ids)).abs().max().item() <= ATOL


def test_load_into_model_with_other_vocab_padding(hf_models, converted):
    """The trainer may pad the vocabulary differently (e.g. to 16 x TP): padding rows are added or dropped."""
    from megatron_fp4.models import GPTModelArgs, build_gpt_model
    from megatron_fp4.models.checkpoint_io import (
        gpt_model_args_from_checkpoint,
        load_checkpoint_into_model,
        model_args_from_json,
    )
    from megatron_fp4.parallel import initialize_parallel

    initialize_parallel(1, 1)
    ckpt = MegatronCheckpoint(converted("llama_bf16", 2, 1))  # hf vocab 97, padded to 98
    margs = model_args_from_json(ckpt.model_args)
    built = gpt_model_args_from_checkpoint(ckpt.dir.parent, fp4_recipe=None, vocab_size=128)
    assert built.vocab_size == 128 and built.params_dtype == torch.bfloat16 and built.tie_embeddings
    ids = _ids(97)
    ref = _hf_logits(hf_models["llama_bf16"], ids)
    for vocab in (97, 128):
        model = build_gpt_model(GPTModelArgs(**dict(margs, vocab_size=vocab, params_dtype=torch.float32)),
                                parallel_output=False).eval()
        load_checkpoint_into_model(model, ckpt)
        assert not model.embedding.word_embeddings.weight[97:].any()
        assert (_mg_logits(model, ids)[..., :97] - ref).abs().max().item() <= ATOL
    small = build_gpt_model(GPTModelArgs(**dict(margs, vocab_size=96)), parallel_output=False)
    with pytest.raises(ValueError, match=r"vocabulary mismatch: model vocab_size=96 is smaller than the "
                                         r"checkpoint's vocabulary 97"):
        load_checkpoint_into_model(small, ckpt)


def test_refuses_to_overwrite_without_flag(hf_models, tmp_path):
    convert_hf_to_megatron(hf_models["llama"], tmp_path / "mg", 2, 1, progress=False)
    with pytest.raises(FileExistsError, match=r"release already exists; pass --overwrite"):
        convert_hf_to_megatron(hf_models["llama"], tmp_path / "mg", 1, 1, progress=False)
    convert_hf_to_megatron(hf_models["llama"], tmp_path / "mg", 1, 1, progress=False, overwrite=True)
    assert sorted(p.name for p in (tmp_path / "mg" / "release").iterdir()) == ["args.json", "mp_rank_00_000"]
    convert_megatron_to_hf(tmp_path / "mg", tmp_path / "hf", progress=False)
    r = run_tool("convert_megatron_to_hf.py", "--load", str(tmp_path / "mg"), "--save", str(tmp_path / "hf"))
    assert r.returncode == 2 and "already holds a model" in r.stderr
    convert_megatron_to_hf(tmp_path / "mg", tmp_path / "hf", max_shard_bytes=50_000, progress=False, overwrite=True)
    assert not (tmp_path / "hf" / "model.safetensors").exists()
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()


def test_numbered_iteration_and_bad_iteration(hf_models, tmp_path):
    it_dir = convert_hf_to_megatron(hf_models["llama"], tmp_path / "mg", iteration="20", progress=False)
    assert it_dir.name == "iter_0000020"
    assert MegatronCheckpoint(tmp_path / "mg").args["iteration"] == 20
    assert MegatronCheckpoint(tmp_path / "mg", iteration=20).dir == it_dir
    with pytest.raises(ValueError, match=r"iteration 'last' is not valid"):
        convert_hf_to_megatron(hf_models["llama"], tmp_path / "mg2", iteration="last", progress=False)
