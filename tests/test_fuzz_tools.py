"""Fuzzing what a user or a filesystem can damage on the tools' side: safetensors files, converted checkpoints, HF
and FP4 exports, config.json fields, and the tools' command lines and output folders.

The property everywhere (as in tests/test_fuzz.py): a clear error (one of the library's input-error types whose
message names the file, folder or flag; for a command line, one ``prog: error: ...`` line and status 2) or a
correct result (equal to the reference), and nothing lost (files the run was not asked to replace are unchanged).
Every example is recorded for the closing table (adversarial_record). Deterministic (derandomized) so CI always
runs the same cases; about a minute on 2 CPU cores."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from adversarial_record import (input_error_types, is_clear, one_error_line, record, run_cli_inprocess,  # noqa: E402
                                tree_digest)
from test_tools_helpers import REPO, make_hf_model  # noqa: E402

from megatron_fp4.models.checkpoint_io import MegatronCheckpoint  # noqa: E402
from megatron_fp4.models.fp4_checkpoint import export_fp4_checkpoint, load_fp4_checkpoint  # noqa: E402
from megatron_fp4.models.hf_conversion import (HFFolderSource, convert_megatron_to_hf,  # noqa: E402
                                               iter_hf_tensors_from_megatron)
from megatron_fp4.models.loading import convert_hf_to_megatron, load_gpt, open_source  # noqa: E402
from megatron_fp4.models.safetensors_io import SafetensorsFile, save_safetensors  # noqa: E402

sys.path.insert(0, str(REPO / "tools"))
import convert_hf_to_megatron as tool_h2m  # noqa: E402
import convert_megatron_to_hf as tool_m2h  # noqa: E402
import export_fp4_checkpoint as tool_fp4  # noqa: E402
import plot_runs as tool_plot  # noqa: E402
import verify_conversion as tool_verify  # noqa: E402


#: MEGATRON_FP4_FUZZ_SCALE=10 MEGATRON_FP4_FUZZ_RANDOM=1: a longer exploratory run with fresh random cases (CI runs the
#: derandomized default: the same cases every time).
_SCALE = float(os.environ.get("MEGATRON_FP4_FUZZ_SCALE", "1"))
_RANDOM = os.environ.get("MEGATRON_FP4_FUZZ_RANDOM", "0") == "1"


def _settings(n: int):
    return settings(max_examples=max(1, int(n * _SCALE)), deadline=None, derandomize=not _RANDOM, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large])


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)


# -- fixtures: one tiny model, its conversion (TP=2, PP=2) and its exports ---------------------------------------------
@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz_world")
    hf = root / "hf"
    make_hf_model("qwen2_tied", hf, seed=3)
    conv = root / "conv"
    convert_hf_to_megatron(hf, conv, 2, 2, progress=False)
    hf_export = convert_megatron_to_hf(conv, root / "hf_export", max_shard_bytes=60_000, progress=False)
    fp4 = export_fp4_checkpoint(hf, root / "fp4", "hif4", "2:4", max_shard_bytes=60_000, progress=False)
    from megatron_fp4.rl.checkpoint import save_checkpoint

    run = root / "rl_run"
    save_checkpoint(run, 2, {"model": {"w": torch.ones(3)}, "step": 2})
    return _World(root=root, hf=hf, conv=conv, hf_export=hf_export, fp4=fp4, run=run,
                  conv_tensors=dict(iter_hf_tensors_from_megatron(MegatronCheckpoint(conv))),
                  conv_args=MegatronCheckpoint(conv).args, conv_assets=_assets(conv / "hf_assets"),
                  hf_tensors={k: HFFolderSource(hf).get(k) for k in HFFolderSource(hf).keys()},
                  fp4_state=load_fp4_checkpoint(fp4).state_dict)


class _World(dict):
    """The fixture's folders and reference tensors (a short repr in hypothesis' failure reports)."""

    def __repr__(self) -> str:
        return f"<world {self['root']}>"


# -- damage ------------------------------------------------------------------------------------------------------------
_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 300), st.sampled_from(
    [0.0, -1.0, 1e-5, 1e6, float("nan"), float("inf"), 64, 2, "64", "silu", "gelu", "bfloat16", "default",
     "LlamaForCausalLM", "MistralForCausalLM", "qwen2", "llama"]),
    st.text(max_size=6), st.lists(st.integers(0, 4), max_size=2), st.just({"rope_type": "linear", "factor": 2.0}),
    st.just({}))


def _json_edit(data, doc: dict, fields: list[str]) -> tuple[dict, str]:
    """``doc`` with one (possibly nested, dotted) field set to a drawn value or deleted."""
    field = data.draw(st.sampled_from(fields))
    doc = json.loads(json.dumps(doc))
    parent, key = doc, field
    if "." in field:
        head, key = field.split(".", 1)
        parent = doc.setdefault(head, {})
        if not isinstance(parent, dict):
            return doc, field
    if data.draw(st.booleans()) and key in parent:
        del parent[key]
    else:
        parent[key] = data.draw(_VALUES)
    return doc, field


def _damage_bytes(data, raw: bytes) -> tuple[bytes, str]:
    kind = data.draw(st.sampled_from(["truncate", "flip", "garbage", "header flip", "empty"]))
    if kind == "empty" or not raw:
        return b"", "empty"
    at = data.draw(st.integers(0, len(raw) - 1))
    if kind == "header flip":  # inside the safetensors header (or a JSON file's first bytes)
        at = data.draw(st.integers(0, min(len(raw) - 1, 8 + int.from_bytes(raw[:8], "little") if len(raw) > 8
                                       else len(raw) - 1)))
    if kind == "truncate":
        return raw[:at], kind
    if kind == "garbage":
        junk = data.draw(st.binary(min_size=1, max_size=32))
        return raw[:at] + junk + raw[at + len(junk):], kind
    b = bytearray(raw)
    b[at] ^= 1 << data.draw(st.integers(0, 7))
    return bytes(b), "flip" if kind == "flip" else kind


def _judge(suite: str, kind: str, fn, names, check) -> None:
    """Run ``fn``; an input error must name one of ``names``; a result must pass ``check`` (else silent wrong)."""
    try:
        result = fn()
    except input_error_types() as e:
        assert is_clear(e, names), f"{kind}: unclear error {type(e).__name__}: {e}"
        record(suite, kind, "clear_error")
        return
    ok = check(result)
    record(suite, kind, "correct" if ok else "silent_wrong")
    assert ok, f"{kind}: a different result without an error"


# -- 1. safetensors files ----------------------------------------------------------------------------------------------
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8)


@_settings(300)
@given(data=st.data())
def test_damaged_safetensors_files_read_correctly_or_fail_naming_the_file(tmp_path_factory, data):
    names = data.draw(st.lists(st.sampled_from(["a", "b.weight", "layers.0.x", "z" * 40, "é"]), min_size=1,
                               max_size=4, unique=True))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 100)))
    state = {}
    for n in names:
        shape = data.draw(st.lists(st.integers(0, 9), max_size=3))
        dtype = data.draw(st.sampled_from(_DTYPES))
        state[n] = (torch.randn(shape, generator=g) * 50).to(dtype)
    path = tmp_path_factory.mktemp("st") / "f.safetensors"
    save_safetensors(state, path, writer={"writer": "fuzz"})
    raw, kind = _damage_bytes(data, path.read_bytes())
    path.write_bytes(raw)
    _judge("safetensors reader", f"safetensors/{kind}", lambda: SafetensorsFile(path).load_all(), [path],
           lambda out: _same(out, state))


# -- 2. converted checkpoints, HF exports, FP4 exports -----------------------------------------------------------------
def _assets(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir())} if folder is not None else {}


def _converted_reader(root: Path):
    """What a converted checkpoint gives its users: args, every tensor, the tokenizer files."""
    ck = MegatronCheckpoint(root)
    return ck.args, dict(iter_hf_tensors_from_megatron(ck)), _assets(ck.hf_assets_dir)


def _restore(files: dict[Path, bytes]) -> None:
    for p, b in files.items():
        p.write_bytes(b)


@_settings(300)
@given(data=st.data())
def test_damaged_converted_checkpoints_load_correctly_or_fail_naming_the_file(world, data):
    root = world["conv"]
    files = sorted(p for p in root.rglob("*") if p.is_file())
    target = data.draw(st.sampled_from(files))
    saved = {p: p.read_bytes() for p in files}
    try:
        if target.name == "args.json" and data.draw(st.booleans()):
            doc = json.loads(saved[target])
            fields = ["format", "format_version", "iteration", "tensor_model_parallel_size",
                      "pipeline_model_parallel_size", "hf_vocab_size", "hf_config", "checksum", "checkpoint_id"] + [
                f"model_args.{k}" for k in doc["model_args"]] + [f"hf_config.{k}" for k in doc["hf_config"]]
            doc, field = _json_edit(data, doc, fields)
            target.write_text(json.dumps(doc))
            kind = f"args.json/edit {field.split('.')[0]}"
        elif target.name == "latest_checkpointed_iteration.txt":
            target.write_text(data.draw(st.sampled_from(["", "release ", "0", "20", "-1", "iter", "\x00", "release\n\n",
                                                         "99999999999"])))
            kind = "tracker/rewritten"
        elif data.draw(st.integers(0, 9)) == 0:
            target.unlink()
            kind = f"{target.suffix or target.name}/deleted"
        else:
            raw, how = _damage_bytes(data, saved[target])
            target.write_bytes(raw)
            kind = f"{'shard' if target.suffix == '.safetensors' else target.name}/{how}"

        def check(result) -> bool:
            args, tensors, assets = result
            return (args == world["conv_args"] and _same(tensors, world["conv_tensors"])
                    and assets == world["conv_assets"])

        _judge("converted checkpoint reader", kind, lambda: _converted_reader(root), [root], check)
    finally:
        for p in files:
            if not p.exists() or p.read_bytes() != saved[p]:
                p.write_bytes(saved[p])


@_settings(200)
@given(data=st.data())
def test_damaged_hf_and_fp4_exports_load_correctly_or_fail_naming_the_file(world, data):
    which = data.draw(st.sampled_from(["hf_export", "fp4"]))
    root = world[which]
    files = sorted(p for p in root.iterdir() if p.suffix == ".safetensors" or p.name.endswith(".index.json")
                   or (which == "fp4" and p.name == "config.json"))
    target = data.draw(st.sampled_from(files))
    saved = {p: p.read_bytes() for p in files}
    try:
        if target.name == "config.json":  # the quantization_config fields that say how to read the weights
            doc = json.loads(saved[target])
            qc = doc["quantization_config"]
            module = data.draw(st.sampled_from(sorted(qc["quantized_modules"])))
            edit = data.draw(st.sampled_from(["format", "block_size", "shape", "dtype", "drop module", "version"]))
            if edit in ("format", "block_size", "version"):
                qc[edit] = data.draw(st.sampled_from(["mxfp4", "nvfp4", "hif4", 32, 64, 16, 2, None, "x"]))
            elif edit == "drop module":
                del qc["quantized_modules"][module]
            else:
                info = qc["quantized_modules"][module]
                info[edit] = data.draw(st.sampled_from([[96, 64], [64, 96], [1, 1], "bfloat16", "float16", "int8", 3]))
            target.write_text(json.dumps(doc))
            kind = f"fp4 config.json/{edit}"
        else:
            raw, how = _damage_bytes(data, saved[target])
            target.write_bytes(raw)
            kind = f"{which} {'index' if target.suffix == '.json' else 'file'}/{how}"
        if which == "fp4":
            _judge("export readers", kind, lambda: load_fp4_checkpoint(root).state_dict, [root],
                   lambda state: _same(state, world["fp4_state"]))
        else:
            def read():
                src = HFFolderSource(root)
                src.model_args()
                return {k: src.get(k) for k in src.keys()}

            _judge("export readers", kind, read, [root], lambda t: _same(t, world["hf_tensors"]))
    finally:
        _restore(saved)


# -- 3. config.json fields of an HF input ------------------------------------------------------------------------------
_CONFIG_FIELDS = ["architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "intermediate_size", "vocab_size", "head_dim", "tie_word_embeddings",
                  "rope_theta", "rms_norm_eps", "hidden_act", "rope_scaling", "max_position_embeddings",
                  "use_sliding_window", "torch_dtype", "dtype", "quantization_config", "attention_bias",
                  "layer_types", "rope_parameters", "rope_parameters.rope_theta", "rope_parameters.rope_type",
                  "attention_dropout", "sliding_window"]


_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta", "attention_dropout", "initializer_range")
#: The config.json fields megatron_fp4.models.hf_conversion.model_args_from_hf_config reads.
_READ_FIELDS = {"architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size", "vocab_size", "head_dim", "tie_word_embeddings",
                "rope_theta", "rope_parameters", "rope_scaling", "rms_norm_eps", "hidden_act",
                "max_position_embeddings", "use_sliding_window", "attention_bias", "mlp_bias", "layer_types", "torch_dtype", "dtype",
                "quantization_config"}


def _hf_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


@_settings(100)
@given(data=st.data())
def test_config_json_fields_convert_faithfully_or_fail_naming_the_field(world, tmp_path_factory, data):
    scratch = tmp_path_factory.mktemp("cfg")
    hf = Path(shutil.copytree(world["hf"], scratch / "hf"))
    cfg = json.loads((hf / "config.json").read_text())
    if data.draw(st.integers(0, 5)) == 0:
        raw, how = _damage_bytes(data, (hf / "config.json").read_bytes())
        (hf / "config.json").write_bytes(raw)
        kind, field = f"config.json/{how}", None
    else:
        edits = data.draw(st.integers(1, 2))
        for _ in range(edits):
            cfg, field = _json_edit(data, cfg, _CONFIG_FIELDS)
        (hf / "config.json").write_text(json.dumps(cfg))
        kind = f"config.json/edit {field}" + (" +1" if edits > 1 else "")
    out = scratch / "out"
    ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(0))

    def convert_and_run():
        convert_hf_to_megatron(hf, out, progress=False)
        model = load_gpt(out, params_dtype=torch.float32)
        with torch.no_grad():
            return model(ids, torch.arange(8)[None], None).float()

    def faithful(logits) -> bool:
        """transformers reads the same folder the same way. Where its stricter config validation refuses the
        folder, the fields the converter does not read (dropout, ...) are restored from the unedited config and
        integers in float fields written as floats (the same numbers), which cannot change what the converter
        built; if transformers still refuses, the converter must have built the unedited model (so a field it
        reads and transformers refuses must be refused by the converter too)."""
        try:
            ref = _hf_logits(hf, ids)
        except Exception as e:
            ref = None
            if field is not None:  # (a raw byte damage has no edited dict to repair)
                original = json.loads((world["hf"] / "config.json").read_text())
                repaired = {k: v for k, v in cfg.items() if k in _READ_FIELDS}
                repaired.update({k: v for k, v in original.items() if k not in _READ_FIELDS})
                repaired.update({k: float(v) for k, v in repaired.items() if k in _FLOAT_FIELDS and type(v) is int})
                (hf / "config.json").write_text(json.dumps(repaired))
                try:
                    ref = _hf_logits(hf, ids)
                except Exception:
                    pass
            if ref is None:
                print(f"transformers refuses {kind} ({type(e).__name__}: {e}); comparing with the unedited model")
                ref = _hf_logits(world["hf"], ids)
        vocab = ref.shape[-1]
        return bool(torch.isfinite(ref).all()) and (logits[..., :vocab] - ref).abs().max().item() <= 1e-4

    _judge("config.json fields", kind, convert_and_run, [hf / "config.json", hf], faithful)


# -- 4. the tools' command lines and output folders --------------------------------------------------------------------
def _scratch(world, tmp_path_factory) -> dict[str, Path]:
    """Fresh copies of every kind of folder a tool may be pointed at."""
    s = tmp_path_factory.mktemp("cli")
    p = {"hf": Path(shutil.copytree(world["hf"], s / "hf")), "conv": Path(shutil.copytree(world["conv"], s / "conv")),
         "run": Path(shutil.copytree(world["run"], s / "run")),
         "hf_export": Path(shutil.copytree(world["hf_export"], s / "hf_export")),
         "fp4": Path(shutil.copytree(world["fp4"], s / "fp4")), "missing": s / "missing", "file": s / "afile",
         "under_file": s / "afile" / "sub", "new": s / "new", "empty": s / "empty", "foreign": s / "foreign"}
    p["file"].write_text("x")
    p["empty"].mkdir()
    p["foreign"].mkdir()
    (p["foreign"] / "notes.txt").write_text("mine")
    bad = Path(shutil.copytree(world["conv"], s / "bad_conv"))
    shard = bad / "release" / "mp_rank_01_001" / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-7])
    p["bad_conv"] = bad
    p["inside_conv"] = s / "conv" / "release" / "sub"  # inside an iteration: replaced as a whole by its writer
    return p


_INTS = st.sampled_from(["1", "2", "0", "-1", "3", "x", "4", "1.5"])


def _replaceable(kind: str, overwrite: bool, argv: list[str]):
    """Which existing files of the output folder a successful run may change: for a converted checkpoint its
    tracker, tokenizer files and (--overwrite) the iteration written; for an HF folder the tokenizer / generation
    files copied from the source and (--overwrite) the weights, index and config.json."""
    if kind == "converted":
        it = argv[argv.index("--iteration") + 1] if "--iteration" in argv else "release"
        it_dir = "release" if it == "release" else f"iter_{int(it):07d}"
        return lambda f: (f == "latest_checkpointed_iteration.txt" or f.startswith("hf_assets")
                          or (overwrite and (f == it_dir or f.startswith(it_dir + "/"))))
    weights = lambda f: f.endswith(".safetensors") or f in ("config.json", "model.safetensors.index.json")  # noqa
    return lambda f: "/" not in f and ((overwrite and weights(f)) or not weights(f))


def _cli_case(world, tmp_path_factory, data, tool, out_kind, sources, outputs, extra):
    """Run ``tool`` on drawn arguments; judge exit status, stderr and what happened to every folder."""
    p = _scratch(world, tmp_path_factory)
    src_key = data.draw(st.sampled_from(sources))
    out_key = data.draw(st.sampled_from(outputs))
    argv = list(extra(p, src_key, out_key))
    overwrite = data.draw(st.booleans())
    argv += ["--no-progress"] + (["--overwrite"] if overwrite else [])
    before = {k: tree_digest(v) for k, v in p.items() if v.exists()}
    code, err = run_cli_inprocess(tool, argv)
    after = {k: tree_digest(v) for k, v in p.items() if v.exists()}
    kind = f"cli/{tool.PROG} {src_key} -> {out_key}"
    may_change = _replaceable(out_kind, overwrite, argv) if code == 0 else (lambda f: False)
    lost = [f"{k}/{f}" for k, files in before.items() for f, h in files.items()
            if after.get(k, {}).get(f) != h and not (k == out_key and may_change(f))]
    if code != 0:
        line = one_error_line(tool.PROG, err)
        assert code == 2 and line is not None, f"{argv}: status {code}, stderr {err!r}"
        named = [a for a in argv if a.startswith("--") or "/" in a]
        assert any(a in line for a in named), f"the error names no argument or path: {line}"
    record("tool command lines", kind, "data_loss" if lost else "clear_error" if code else "correct")
    assert not lost, f"{argv} (status {code}) changed or removed {lost[:5]}"
    return None if code else (p, src_key, out_key)


@_settings(80)
@given(data=st.data())
def test_convert_hf_to_megatron_command_lines(world, tmp_path_factory, data):
    def extra(p, src, out):
        argv = ["--hf-path", str(p[src]), "--save", str(p[out])]
        for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--iteration"):
            if data.draw(st.booleans()):
                argv += [flag, data.draw(_INTS | st.just("release"))]
        return argv

    res = _cli_case(world, tmp_path_factory, data, tool_h2m, "converted",
                    ["hf", "hf", "hf_export", "fp4", "missing", "file", "conv"],
                    ["new", "new", "empty", "conv", "conv", "run", "foreign", "file", "under_file", "hf",
                     "inside_conv"], extra)
    if res is not None:  # the conversion holds the source model exactly
        p, src, out = res
        back = dict(iter_hf_tensors_from_megatron(MegatronCheckpoint(p[out])))
        source = open_source(p[src])
        want = {k: source.get(k) for k in back}
        assert _same(back, want)


@_settings(80)
@given(data=st.data())
def test_convert_megatron_to_hf_command_lines(world, tmp_path_factory, data):
    def extra(p, src, out):
        argv = ["--load", str(p[src]), "--save", str(p[out])]
        if data.draw(st.booleans()):
            argv += ["--iteration", data.draw(st.sampled_from(["2", "release", "0", "x", "-1"]))]
        if data.draw(st.booleans()):
            argv += ["--max-shard-size", data.draw(st.sampled_from(["40KB", "0", "1", "5GB", "-3MB", "many"]))]
        if data.draw(st.booleans()):
            argv += ["--dtype", data.draw(st.sampled_from(["float32", "bfloat16", "int8"]))]
        return argv

    res = _cli_case(world, tmp_path_factory, data, tool_m2h, "hf",
                    ["conv", "conv", "conv", "bad_conv", "run", "hf", "missing", "file"],
                    ["new", "new", "empty", "hf_export", "hf_export", "conv", "run", "foreign", "file", "under_file",
                     "inside_conv"], extra)
    if res is not None:
        p, src, out = res
        src_hf = HFFolderSource(p[out])
        got = {k: src_hf.get(k) for k in src_hf.keys()}
        assert got.keys() == world["conv_tensors"].keys()
        assert all(torch.equal(got[k].float(), world["conv_tensors"][k].float().to(got[k].dtype).float())
                   for k in got)


@_settings(60)
@given(data=st.data())
def test_export_fp4_checkpoint_command_lines(world, tmp_path_factory, data):
    def extra(p, src, out):
        flag = "--load" if src in ("conv", "bad_conv", "run") or data.draw(st.booleans()) else "--hf-path"
        argv = [flag, str(p[src]), "--save", str(p[out]),
                "--format", data.draw(st.sampled_from(["hif4", "mxfp4", "nvfp4"])),
                "--resq", data.draw(st.sampled_from(["none", "2:4", "3:4"]))]
        if data.draw(st.booleans()):
            argv += [data.draw(st.sampled_from(["--high-precision-first-layers", "--high-precision-last-layers"])),
                     data.draw(_INTS)]
        if data.draw(st.booleans()):
            argv += ["--resq-combine", data.draw(st.sampled_from(["exact", "bf16", "fp8"]))]
        return argv

    res = _cli_case(world, tmp_path_factory, data, tool_fp4, "hf",
                    ["hf", "hf", "conv", "conv", "bad_conv", "fp4", "missing", "run"],
                    ["new", "new", "empty", "hf_export", "hf_export", "conv", "run", "foreign", "file", "hf",
                     "inside_conv"], extra)
    if res is not None:
        p, src, out = res
        load_fp4_checkpoint(p[out])  # verified on load (checksums, recorded quantization, packed shapes)


@_settings(40)
@given(data=st.data())
def test_verify_conversion_bad_command_lines(world, tmp_path_factory, data):
    p = _scratch(world, tmp_path_factory)
    bad = data.draw(st.sampled_from(["load", "hf", "tp", "atol", "save", "pairs", "batch"]))
    argv = ["--hf-path", str(p["hf"]), "--load", str(p["conv"])]
    if bad == "load":
        argv[3] = str(p[data.draw(st.sampled_from(["missing", "bad_conv", "hf", "run", "file"]))])
    elif bad == "hf":
        argv[1] = str(p[data.draw(st.sampled_from(["missing", "conv", "file", "empty"]))])
    elif bad == "tp":
        argv += ["--tensor-model-parallel-size", data.draw(st.sampled_from(["0", "-2", "x"]))]
    elif bad == "atol":
        argv += ["--atol", data.draw(st.sampled_from(["nan", "-1", "inf", "x"]))]
    elif bad == "save":  # (SAVE/<pair index> is written: under a file, or inside a checkpoint iteration)
        argv += ["--save", str(data.draw(st.sampled_from([p["file"], p["under_file"], p["run"] / "iter_0000002",
                                                          p["conv"] / "release"])))]
    elif bad == "pairs":
        argv += ["--hf-path", str(p["hf"])]
    else:
        argv += ["--batch-size", data.draw(st.sampled_from(["0", "-1", "two"]))]
    before = {k: tree_digest(v) for k, v in p.items() if v.exists()}
    code, err = run_cli_inprocess(tool_verify, argv)
    line = one_error_line(tool_verify.PROG, err)
    assert code == 2 and line is not None, f"{argv}: {code} {err!r}"
    after = {k: tree_digest(v) for k, v in p.items() if v.exists()}
    assert after == before
    record("tool command lines", f"cli/verify_conversion.py bad {bad}", "clear_error")


_ROWS = ["fp4_fp4", "bf16_bf16", "fp4_bf16", "nope", 3]


@_settings(40)
@given(data=st.data())
def test_plot_runs_inputs(world, tmp_path_factory, data):
    s = tmp_path_factory.mktemp("plot")
    run = s / "runs" / "r"
    run.mkdir(parents=True)
    rec = {"row": "fp4_fp4", "format": "hif4", "seed": 1, "final": {"accuracy": 0.5},
           "warm_start": {"accuracy": 0.25}, "command": "python pretrain_rl.py --eval-samples 64", "grpo_steps": 2}
    if data.draw(st.booleans()):
        rec, field = _json_edit(data, rec, ["row", "format", "seed", "final", "warm_start", "command",
                                            "final.accuracy", "warm_start.accuracy"])
        kind = f"cli/plot_runs.py results.json edit {field}"
    else:
        kind = "cli/plot_runs.py train.jsonl"
    (run / "results.json").write_text(json.dumps(rec))
    rows = [{"kind": "train", "step": i, "reward_mean": 0.1 * i, "logp_abs_diff_mean": 0.01} for i in range(3)]
    lines = [json.dumps(r) for r in rows]
    if kind.endswith("train.jsonl"):
        at = data.draw(st.integers(0, 2))
        lines[at] = data.draw(st.sampled_from([
            "{", "[]", '{"kind": "train", "step": "x"}', '{"kind": "train", "step": 1, "reward_mean": "high"}',
            '{"kind": "underflow", "step": 1, "decoder.layers.0.x/fp4": null}', "\ufffd", '{"kind": 5}']))
    (run / "train.jsonl").write_text("\n".join(lines) + "\n")
    out = data.draw(st.sampled_from([s / "report.md", s / "runs", s / "runs" / "r" / "results.json" / "x.md"]))
    before = tree_digest(s / "runs")
    code, err = run_cli_inprocess(tool_plot, ["--runs", str(s / "runs"), "--out", str(out)])
    if code == 0:
        assert Path(out).is_file() and "Mini precision table" in Path(out).read_text()
        record("tool command lines", kind, "correct")
    else:
        assert code == 2 and one_error_line(tool_plot.PROG, err) is not None, err
        record("tool command lines", kind, "clear_error")
    assert tree_digest(s / "runs") == before


def test_the_fuzz_judges_by_value_not_by_luck():
    """The oracles above detect a wrong result: a tensor changed by one bit is not 'the same'."""
    a = {"w": torch.tensor([1.0, 2.0])}
    b = {"w": torch.nextafter(a["w"], torch.tensor(3.0))}
    assert _same(a, {"w": a["w"].clone()}) and not _same(a, b)
