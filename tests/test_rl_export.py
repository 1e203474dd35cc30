"""What GRPO trains leaves the project: a ``pretrain_rl.py --save RUN`` directory of a converted HF model exports with
``tools/convert_megatron_to_hf.py --load RUN`` (and ``tools/export_fp4_checkpoint.py --load RUN``) at TP=1 and TP=2,
and transformers' logits of the export equal the trained policy's (its master weights in fp32, no FP4 recipe);
a live TP=2 model exports collectively; checkpoints written before the model was recorded fail naming what they
lack."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from test_tools_helpers import REPO, free_port, make_hf_model, run_tool

pytest.importorskip("transformers")

ATOL = 1e-4
WORDS = ["<pad>", "<s>", "<unk>", "</s>"] + [str(i) for i in range(10)] + [
    "Question", ":", "Answer", "Let", "'", "s", "think", "step", "by", ".", "Tom", "has", "apples", "gets", "more",
    "How", "many", "does", "have", "?", "####", "+", "="]
CHAT_TEMPLATE = "{% for m in messages %}<s> {{ m['content'] }} </s> {% endfor %}"
# 2 warm-up iterations move the weights away from the converted model; GRPO steps of 4 prompts x 4 samples
RUN_ARGS = ["--eval-samples", "2", "--sft-iters", "2", "--global-batch-size", "4", "--group-size", "4",
            "--max-prompt-length", "32", "--max-response-length", "6", "--train-iters", "2", "--eval-interval", "100",
            "--save-interval", "1"]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A tiny HF Qwen2 (tied embeddings, vocab 96) with a word-level tokenizer and a chat template, converted with
    tools/; a GSM8K-format jsonl the tokenizer covers."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from megatron_fp4.models.loading import convert_hf_to_megatron

    root = tmp_path_factory.mktemp("rl_export")
    make_hf_model("qwen2_tied", root / "hf")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<pad>", chat_template=CHAT_TEMPLATE).save_pretrained(root / "hf")
    with open(root / "gsm8k.jsonl", "w") as f:
        for a in range(1, 8):
            f.write(json.dumps({"question": f"Tom has {a} apples . Tom gets 2 more . How many does Tom have ?",
                                "answer": f"{a} + 2 = {a + 2}\n#### {a + 2}"}) + "\n")
    convert_hf_to_megatron(root / "hf", root / "converted", progress=False)
    return root


@pytest.fixture(scope="module")
def runs(workdir):
    """pretrain_rl.py --save runs, made on first use: "tp1" (fp32), "tp2" (TP=2 under torchrun, --bf16) and "pp2"
    (PP=2 under torchrun, fp32)."""
    made = {}
    layouts = {"tp1": ["--save-hf", str(workdir / "run_tp1_hf")],
               "tp2": ["--tensor-model-parallel-size", "2", "--bf16"],
               "pp2": ["--pipeline-model-parallel-size", "2"]}

    def get(name: str):
        if name not in made:
            launcher = [sys.executable]
            extra = layouts[name]
            if extra:
                launcher += ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                             "--master-port", str(free_port())]
            run = workdir / f"run_{name}"
            r = subprocess.run([*launcher, str(REPO / "pretrain_rl.py"), "--load", str(workdir / "converted"),
                                "--dataset", f"gsm8k:{workdir / 'gsm8k.jsonl'}", *RUN_ARGS, *extra,
                                "--save", str(run)], env=_env(), cwd=str(REPO), capture_output=True, text=True,
                               timeout=600)
            assert r.returncode == 0, r.stderr[-3000:]
            made[name] = run
        return made[name]

    return get


def _ids(b: int = 2, s: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 96, (b, s), generator=torch.Generator().manual_seed(seed))


def _hf_logits(path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def _policy_logits(workdir, run, ids: torch.Tensor, iteration=None, master: bool = False) -> torch.Tensor:
    """Logits of the policy stored in an RL checkpoint, loaded by the trainer's resharding reader into an fp32
    megatron-core model built from the converted checkpoint's architecture, without an FP4 recipe. ``master``: then
    overwrite the parameters the optimizer keeps fp32 master copies of (``optimizer_named.main``) with those."""
    from megatron_fp4.models import build_gpt_model
    from megatron_fp4.models.checkpoint_io import (gpt_model_args_from_checkpoint, load_checkpoint_into_model,
                                                   rank_state)
    from megatron_fp4.parallel import initialize_parallel
    from megatron_fp4.rl.checkpoint_weights import TrainerCheckpointWeights

    initialize_parallel(1, 1)
    margs = gpt_model_args_from_checkpoint(workdir / "converted", fp4_recipe=None, params_dtype=torch.float32)
    model = build_gpt_model(margs, parallel_output=False).eval()
    load_checkpoint_into_model(model, TrainerCheckpointWeights(run, iteration))
    if master:
        main = TrainerCheckpointWeights(run, iteration, ("optimizer_named", "main"))
        names = main.shard_keys(0, 0)
        assert "decoder.layers.0.mlp.linear_fc2.weight" in names
        model.load_state_dict(rank_state(model, main, names=names), strict=False)
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1]).expand_as(ids), None).float()


@pytest.mark.slow
def test_rl_run_exports_to_transformers_tp1(workdir, runs, tmp_path):
    run = runs("tp1")
    r = run_tool("convert_megatron_to_hf.py", "--load", str(run), "--save", str(tmp_path / "hf"), "--no-progress")
    assert r.returncode == 0, r.stderr
    ids = _ids()
    got, want = _hf_logits(tmp_path / "hf", ids), _policy_logits(workdir, run, ids)
    assert want.std() > 0.5 and got.shape == want.shape == (2, 12, 96)
    print(f"TP=1 export: max |logit diff| {(got - want).abs().max().item():.2e} (logit std {want.std():.2f})")
    assert (got - want).abs().max().item() <= ATOL
    # the export is the trained policy, not the converted model it started from
    assert (got - _hf_logits(workdir / "hf", ids)).abs().max().item() > 1e-2
    # config.json and the tokenizer (with its chat template) come from the model the run started from
    from transformers import AutoTokenizer

    src = json.loads((workdir / "hf" / "config.json").read_text())
    out = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert out == src
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert len(tok) == len(WORDS) and tok.chat_template == CHAT_TEMPLATE
    assert tok.encode("Tom has 3 apples") == AutoTokenizer.from_pretrained(str(workdir / "hf")).encode(
        "Tom has 3 apples")

    # --iteration picks an earlier checkpoint; an iteration directory works as --load too
    r = run_tool("convert_megatron_to_hf.py", "--load", str(run), "--iteration", "1", "--save",
                 str(tmp_path / "hf1"), "--no-progress")
    assert r.returncode == 0, r.stderr
    assert (_hf_logits(tmp_path / "hf1", ids) - _policy_logits(workdir, run, ids, 1)).abs().max().item() <= ATOL
    from megatron_fp4.rl.export import export_hf

    export_hf(run / "iter_0000001", tmp_path / "hf1b")
    assert (tmp_path / "hf1b" / "model.safetensors").read_bytes() == (tmp_path / "hf1" / "model.safetensors"
                                                                        ).read_bytes()
    with pytest.raises(ValueError, match=r"--iteration 7: .* allowed values: \[1, 2\]"):
        export_hf(run, tmp_path / "x", iteration=7)


@pytest.mark.slow
def test_save_hf_writes_what_the_tool_exports(workdir, runs, tmp_path):
    """pretrain_rl.py --save-hf DIR writes, at the end of the run, the folder convert_megatron_to_hf.py makes of
    the run's last checkpoint: the same config, tokenizer and tensors."""
    from safetensors.torch import load_file

    run = runs("tp1")
    r = run_tool("convert_megatron_to_hf.py", "--load", str(run), "--save", str(tmp_path / "hf"), "--no-progress")
    assert r.returncode == 0, r.stderr
    driver = workdir / "run_tp1_hf"
    assert json.loads((driver / "config.json").read_text()) == json.loads((tmp_path / "hf" / "config.json").read_text())
    got, want = ({k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}
                 for d in (driver, tmp_path / "hf"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert (driver / "tokenizer_config.json").is_file()
    ids = _ids()
    assert (_hf_logits(driver, ids) - _policy_logits(workdir, run, ids)).abs().max().item() <= ATOL


def test_rl_run_exports_at_tp2_bf16_master_weights_and_fp4(workdir, runs, tmp_path):
    """A TP=2 --bf16 run: --dtype float32 exports the fp32 master weights (logits equal the master policy's);
    the default export holds the bf16 weights the run stored; the FP4 export of the run packs those."""
    from megatron_fp4.formats import get_format
    from megatron_fp4.models.fp4_checkpoint import load_fp4_checkpoint
    from megatron_fp4.models.hf_conversion import HFFolderSource

    run = runs("tp2")
    r = run_tool("convert_megatron_to_hf.py", "--load", str(run), "--save", str(tmp_path / "master"),
                 "--dtype", "float32", "--no-progress")
    assert r.returncode == 0, r.stderr
    ids = _ids()
    want = _policy_logits(workdir, run, ids, master=True)
    assert want.std() > 0.5
    diff = (_hf_logits(tmp_path / "master", ids) - want).abs().max().item()
    print(f"TP=2 --bf16 run, fp32 master export: max |logit diff| {diff:.2e} (logit std {want.std():.2f})")
    assert diff <= ATOL
    assert json.loads((tmp_path / "master" / "config.json").read_text())["dtype"] == "float32"

    r = run_tool("convert_megatron_to_hf.py", "--load", str(run), "--save", str(tmp_path / "bf16"), "--no-progress")
    assert r.returncode == 0, r.stderr
    bf16, master = HFFolderSource(tmp_path / "bf16"), HFFolderSource(tmp_path / "master")
    assert bf16.config["dtype"] == "bfloat16"
    for k in bf16.keys():  # the bf16 weights are the master weights rounded once (fp32 CPU norms too)
        assert bf16.get(k).dtype == torch.bfloat16 and torch.equal(bf16.get(k), master.get(k).bfloat16()), k

    r = run_tool("export_fp4_checkpoint.py", "--load", str(run), "--save", str(tmp_path / "fp4"), "--format", "hif4",
                 "--resq", "2:4", "--no-progress")
    assert r.returncode == 0, r.stderr
    fp4 = load_fp4_checkpoint(tmp_path / "fp4")
    assert fp4.quantization_config["resq"] == "2:4" and len(fp4.quantization_config["quantized_modules"]) == 14
    fmt = get_format("hif4")
    for k in bf16.keys():
        w = bf16.get(k)
        expect = fmt.fake_quantize(w, dim=-1) if k.replace(".weight", "") in fp4.quantization_config[
            "quantized_modules"] else w
        assert torch.equal(fp4.state_dict[k], expect), k
    assert (tmp_path / "fp4" / "tokenizer.json").is_file()


@pytest.mark.slow
def test_rl_run_exports_at_pp2(workdir, runs, tmp_path):
    """PP=2 (tied embeddings: the last stage's copy of the embedding is not exported as lm_head)."""
    run = runs("pp2")
    r = run_tool("convert_megatron_to_hf.py", "--load", str(run), "--save", str(tmp_path / "hf"), "--no-progress")
    assert r.returncode == 0, r.stderr
    ids = _ids()
    got, want = _hf_logits(tmp_path / "hf", ids), _policy_logits(workdir, run, ids)
    print(f"PP=2 export: max |logit diff| {(got - want).abs().max().item():.2e} (logit std {want.std():.2f})")
    assert want.std() > 0.5 and (got - want).abs().max().item() <= ATOL


@pytest.mark.slow
def test_live_tp2_model_exports_collectively(workdir, tmp_path):
    """export_hf(model) on both ranks of a TP=2 job: transformers' logits equal the live sharded model's."""
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                        "127.0.0.1", "--master-port", str(free_port()), str(REPO / "tests" / "dist" / "export_live.py"),
                        "--load", str(workdir / "converted"), "--save", str(tmp_path / "hf"), "--out",
                        str(tmp_path / "logits.pt")], env=_env(), cwd=str(REPO), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    d = torch.load(tmp_path / "logits.pt", weights_only=True)
    assert d["logits"].std() > 0.5
    diff = (_hf_logits(tmp_path / "hf", d["ids"]) - d["logits"]).abs().max().item()
    print(f"live TP=2 export: max |logit diff| {diff:.2e} (logit std {d['logits'].std():.2f})")
    assert diff <= ATOL
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "logits.pt"]  # the temporary shards are gone
    assert (tmp_path / "hf" / "tokenizer.json").is_file()


@pytest.mark.slow
def test_checkpoint_without_model_record_names_what_is_missing(runs, tmp_path):
    """RL checkpoints written before the layout record described the model: one error line naming the missing
    fields and what to do, exit status 2."""
    old = tmp_path / "old"
    shutil.copytree(runs("tp1"), old)
    from rl_helpers import rewrite_as_older_version

    def older(state):  # what older versions wrote
        lay = state["layout"]
        keep = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size", "tie_embeddings")
        lay["model_args"] = {k: lay["model_args"][k] for k in keep}
        lay.pop("hf", None)
        lay.pop("hf_assets", None)

    rewrite_as_older_version(old, older)
    for tool, extra in (("convert_megatron_to_hf.py", []), ("export_fp4_checkpoint.py", ["--format", "mxfp4",
                                                                                          "--resq", "none"])):
        r = run_tool(tool, "--load", str(old), "--save", str(tmp_path / tool), *extra)
        assert r.returncode == 2, r.stderr
        line = r.stderr.strip().splitlines()[-1]
        assert line.startswith(f"{tool}: error: ") and "Traceback" not in r.stderr
        assert "not num_query_groups, kv_channels, max_seq_len, add_qkv_bias" in line and "Resume the run" in line


def test_load_that_is_no_checkpoint_is_one_error_line(tmp_path):
    from megatron_fp4.rl.export import open_checkpoint

    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_checkpoint(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    r = run_tool("convert_megatron_to_hf.py", "--load", str(tmp_path / "empty"), "--save", str(tmp_path / "out"))
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("convert_megatron_to_hf.py: error: ")
    assert "is neither a pretrain_rl.py --save directory" in r.stderr


def test_live_bf16_model_exports_in_one_dtype(workdir, tmp_path):
    """A single-process bf16 model (its norms in bf16 too, as Megatron-LM's Float16Module casts them) exports every
    tensor in bf16, with the tokenizer of the checkpoint it was loaded from."""
    from megatron_fp4.models.hf_conversion import HFFolderSource
    from megatron_fp4.models.loading import load_gpt
    from megatron_fp4.rl.export import export_hf

    model = load_gpt(workdir / "converted", params_dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    export_hf(model, tmp_path / "hf")
    src = HFFolderSource(tmp_path / "hf")
    assert src.config["dtype"] == "bfloat16" and {src.get(k).dtype for k in src.keys()} == {torch.bfloat16}
    assert torch.equal(src.get("model.norm.weight"), model.decoder.final_layernorm.weight.bfloat16())
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    with pytest.raises(FileExistsError, match="--overwrite"):
        export_hf(model, tmp_path / "hf")
