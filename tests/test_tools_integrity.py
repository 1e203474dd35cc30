"""Converted checkpoints and the tools under bad input (issue 24): checksums in every safetensors shard, ownership of
output folders, and one error line per tool. Each case is recorded for the closing table (adversarial_record)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from adversarial_record import is_clear, one_error_line, record, run_cli_inprocess, tree_digest
from test_tools_helpers import REPO, make_hf_model, run_tool

from megatron_fp4.models.checkpoint_io import MegatronCheckpoint
from megatron_fp4.models.hf_conversion import HFFolderSource, convert_megatron_to_hf, iter_hf_tensors_from_megatron
from megatron_fp4.models.loading import convert_hf_to_megatron, load_gpt
from megatron_fp4.models.safetensors_io import CHECKSUMS_KEY, WRITER_KEY, SafetensorsFile
from megatron_fp4.ownership import OutputDirError

sys.path.insert(0, str(REPO / "tools"))
import convert_hf_to_megatron as tool_h2m  # noqa: E402
import convert_megatron_to_hf as tool_m2h  # noqa: E402
import export_fp4_checkpoint as tool_fp4  # noqa: E402

SUITE = "deterministic"


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "qwen2_tied"
    make_hf_model("qwen2_tied", path, seed=2)
    return path


@pytest.fixture(scope="module")
def conv(hf, tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "ckpt"
    convert_hf_to_megatron(hf, out, 2, 1, progress=False)
    return out


@pytest.fixture(scope="module")
def reference(conv):
    return dict(iter_hf_tensors_from_megatron(MegatronCheckpoint(conv)))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _all_tensors(path) -> dict:
    return dict(iter_hf_tensors_from_megatron(MegatronCheckpoint(path)))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _tensor_offset(path: Path, name: str) -> int:
    """Byte offset in a safetensors file of the middle of tensor ``name``'s data."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    begin, end = json.loads(raw[8:8 + n])[name]["data_offsets"]
    return 8 + n + (begin + end) // 2


def _flip(path: Path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x10
    path.write_bytes(bytes(raw))


def _expect_error(kind: str, fn, names, types=(ValueError, KeyError, OSError)) -> str:
    with pytest.raises(types) as e:
        fn()
    assert is_clear(e.value, names), str(e.value)
    record(SUITE, kind, "clear_error")
    return str(e.value)


# -- checksums --------------------------------------------------------------------------------------------------------
def test_converted_shards_record_checksums_writer_and_place(conv):
    args = json.loads((conv / "release" / "args.json").read_text())
    assert "convert_hf_to_megatron" in args["writer"]["writer"] and args["checksum"]["algorithm"] == "xxh3_128"
    for tp_rank in range(2):
        f = SafetensorsFile(conv / "release" / f"mp_rank_{tp_rank:02d}_000" / "model.safetensors")
        assert f.checksums is not None and set(f.checksums) == set(f.keys()) and CHECKSUMS_KEY in f.metadata
        assert "convert_hf_to_megatron" in f.writer["writer"]
        place = json.loads(f.metadata["megatron_fp4.shard"])
        assert place == {"checkpoint_id": args["checkpoint_id"], "tp_rank": tp_rank, "pp_rank": 0, "tp": 2, "pp": 1}


def test_a_flipped_byte_in_a_tensor_is_named_by_every_reader(conv, tmp_path):
    ckpt = _copy(conv, tmp_path / "c")
    shard = ckpt / "release" / "mp_rank_01_000" / "model.safetensors"
    name = "decoder.layers.1.mlp.linear_fc2.weight"
    _flip(shard, _tensor_offset(shard, name))
    msg = _expect_error("shard/flipped tensor byte", lambda: _all_tensors(ckpt), [shard])
    assert name in msg and "does not match its checksum" in msg
    _expect_error("shard/flipped tensor byte (load_gpt)", lambda: load_gpt(ckpt), [shard])
    code, err = run_cli_inprocess(tool_m2h, ["--load", str(ckpt), "--save", str(tmp_path / "hf"), "--no-progress"])
    line = one_error_line(tool_m2h.PROG, err)
    assert code == 2 and line is not None and str(shard) in line and name in line, err
    assert not (tmp_path / "hf" / "model.safetensors").exists()
    record(SUITE, "cli/convert_megatron_to_hf flipped shard", "clear_error")


def test_old_shards_without_checksums_still_load(conv, reference, tmp_path):
    from safetensors.torch import save_file

    ckpt = _copy(conv, tmp_path / "old")
    for shard in (ckpt / "release").glob("mp_rank_*/model.safetensors"):
        state = SafetensorsFile(shard).load_all()
        save_file(state, str(shard), metadata={"format": "pt"})  # as written before checksums existed
    args_file = ckpt / "release" / "args.json"
    args = json.loads(args_file.read_text())
    for key in ("checksum", "writer", "checkpoint_id"):
        args.pop(key)
    args_file.write_text(json.dumps(args))
    assert SafetensorsFile(shard).checksums is None
    assert _same(_all_tensors(ckpt), reference)
    record(SUITE, "shard/no checksums (older version)", "correct")


def test_edited_or_damaged_args_json_is_refused(conv, tmp_path):
    for kind, edit in (("rotary_base edited", lambda d: d["model_args"].update(rotary_base=20000.0)),
                       ("hf_vocab_size edited", lambda d: d.update(hf_vocab_size=90)),
                       ("checksum removed, field wrong", None)):
        ckpt = _copy(conv, tmp_path / kind.replace(" ", "_").replace(",", ""))
        f = ckpt / "release" / "args.json"
        doc = json.loads(f.read_text())
        if edit is None:
            doc.pop("checksum")
            doc["model_args"]["num_attention_heads"] = 3
        else:
            edit(doc)
        f.write_text(json.dumps(doc))
        msg = _expect_error(f"args.json/{kind}", lambda: MegatronCheckpoint(ckpt), [f])
        assert ("does not match its checksum" in msg) if edit else ("num_query_groups=2 does not divide" in msg)
    f = _copy(conv, tmp_path / "trunc") / "release" / "args.json"
    f.write_text(f.read_text()[:200])
    _expect_error("args.json/truncated", lambda: MegatronCheckpoint(f.parent.parent), [f])


def test_tokenizer_files_are_verified(conv, tmp_path):
    from megatron_fp4.models.checkpoint_io import checkpoint_tokenizer_dir, gpt_model_args_from_checkpoint

    ckpt = _copy(conv, tmp_path / "tok")
    assert json.loads((ckpt / "release" / "args.json").read_text())["hf_assets"]  # recorded with their checksums
    victim = ckpt / "hf_assets" / "generation_config.json"
    victim.write_text(victim.read_text().replace("}", ', "do_sample": true}'))
    for kind, fn in (("tokenizer folder", lambda: checkpoint_tokenizer_dir(ckpt)),
                     ("model args for the trainer", lambda: gpt_model_args_from_checkpoint(ckpt)),
                     ("HF export", lambda: convert_megatron_to_hf(ckpt, tmp_path / "hf", progress=False))):
        msg = _expect_error(f"hf_assets/edited file ({kind})", fn, [victim])
        assert "does not match its checksum" in msg
    assert not (tmp_path / "hf").exists()


def test_swapped_or_foreign_shards_are_refused(conv, hf, tmp_path):
    ckpt = _copy(conv, tmp_path / "swap")
    a, b = (ckpt / "release" / f"mp_rank_{r:02d}_000" / "model.safetensors" for r in (0, 1))
    tmp = a.with_name("x")
    a.rename(tmp), b.rename(a), tmp.rename(b)
    msg = _expect_error("shard/swapped TP ranks", lambda: _all_tensors(ckpt), [a, b])
    assert "belongs elsewhere" in msg
    other = convert_hf_to_megatron(hf, tmp_path / "other", 2, 1, progress=False)  # same model, another conversion
    ckpt = _copy(conv, tmp_path / "foreign")
    shutil.copy(other / "mp_rank_01_000" / "model.safetensors",
                ckpt / "release" / "mp_rank_01_000" / "model.safetensors")
    _expect_error("shard/copied from another conversion", lambda: _all_tensors(ckpt),
                  [ckpt / "release" / "mp_rank_01_000" / "model.safetensors"])


def test_hf_and_fp4_exports_carry_checksums_and_damage_is_named(conv, tmp_path):
    from megatron_fp4.models.fp4_checkpoint import export_fp4_checkpoint, load_fp4_checkpoint

    out = convert_megatron_to_hf(conv, tmp_path / "hf", progress=False)
    f = SafetensorsFile(out / "model.safetensors")
    assert f.checksums is not None and "convert_megatron_to_hf" in json.loads(f.metadata[WRITER_KEY])["writer"]
    fp4 = export_fp4_checkpoint(out, tmp_path / "fp4", "hif4", "2:4", progress=False)
    g = SafetensorsFile(fp4 / "model.safetensors")
    assert g.checksums is not None and "export_fp4_checkpoint" in g.writer["writer"]
    name = "model.layers.0.mlp.down_proj.weight_packed"
    _flip(fp4 / "model.safetensors", _tensor_offset(fp4 / "model.safetensors", name))
    msg = _expect_error("fp4 export/flipped packed byte", lambda: load_fp4_checkpoint(fp4),
                        [fp4 / "model.safetensors"])
    assert name in msg
    _flip(out / "model.safetensors", _tensor_offset(out / "model.safetensors", "model.norm.weight"))
    _expect_error("hf export/flipped byte (as an input)", lambda: HFFolderSource(out).get("model.norm.weight"),
                  [out / "model.safetensors"])


# -- ownership ---------------------------------------------------------------------------------------------------------
def _rl_run(path: Path, marker: bool = True) -> Path:
    from megatron_fp4.rl.checkpoint import WRITER_FILE, save_checkpoint

    save_checkpoint(path, 3, {"model": {"w": torch.ones(2)}, "step": 3})
    if not marker:
        (path / WRITER_FILE).unlink()
    return path


def _megatron_lm(path: Path) -> Path:
    """A Megatron-LM style checkpoint folder (another tool's tracker)."""
    (path / "iter_0000100" / "mp_rank_00").mkdir(parents=True)
    torch.save({"model": {}}, path / "iter_0000100" / "mp_rank_00" / "model_optim_rng.pt")
    (path / "latest_checkpointed_iteration.txt").write_text("100")
    return path


@pytest.mark.parametrize("kind", ["rl run", "rl run without marker", "megatron-lm tracker", "foreign files",
                                  "a file", "under a file"])
def test_converter_never_writes_into_a_folder_it_does_not_own(kind, hf, tmp_path):
    target = tmp_path / "t"
    if kind.startswith("rl run"):
        _rl_run(target, marker=kind == "rl run")
    elif kind == "megatron-lm tracker":
        _megatron_lm(target)
    elif kind == "foreign files":
        target.mkdir()
        (target / "notes.txt").write_text("mine")
    elif kind == "a file":
        target.write_text("x")
    else:
        (tmp_path / "f").write_text("x")
        target = tmp_path / "f" / "sub"
    before = tree_digest(tmp_path)
    for overwrite in (False, True):
        _expect_error(f"converter output/{kind} (overwrite={overwrite})",
                      lambda: convert_hf_to_megatron(hf, target, overwrite=overwrite, progress=False),
                      [target], (OutputDirError,))
    code, err = run_cli_inprocess(tool_h2m, ["--hf-path", str(hf), "--save", str(target), "--no-progress",
                                             "--overwrite"])
    assert code == 2 and one_error_line(tool_h2m.PROG, err) is not None and str(target) in err, err
    record(SUITE, f"cli/convert_hf_to_megatron output {kind}", "clear_error")
    assert tree_digest(tmp_path) == before  # nothing touched


@pytest.mark.parametrize("kind", ["rl run", "converted checkpoint", "megatron-lm tracker", "the input",
                                  "inside an iteration", "inside an rl iteration"])
def test_exporters_never_write_into_checkpoint_folders_or_their_input(kind, conv, hf, tmp_path):
    src = _copy(conv, tmp_path / "src")
    hf_src = _copy(hf, tmp_path / "hf_src")
    target = {"rl run": lambda: _rl_run(tmp_path / "t"), "converted checkpoint": lambda: _copy(conv, tmp_path / "t"),
              "megatron-lm tracker": lambda: _megatron_lm(tmp_path / "t"), "the input": lambda: src,
              "inside an iteration": lambda: src / "release" / "hf",
              "inside an rl iteration": lambda: _rl_run(tmp_path / "t") / "iter_0000003" / "hf"}[kind]()
    before = tree_digest(tmp_path)
    runs = [(tool_m2h, ["--load", str(src), "--save", str(target), "--overwrite", "--no-progress"], target),
            (tool_fp4, ["--load", str(src), "--save", str(target), "--format", "hif4", "--resq", "none",
                        "--overwrite", "--no-progress"], target)]
    if kind == "the input":  # an HF folder as input and output: --overwrite would delete what is being read
        runs.append((tool_fp4, ["--hf-path", str(hf_src), "--save", str(hf_src), "--format", "mxfp4", "--resq",
                                "none", "--overwrite", "--no-progress"], hf_src))
    for tool, argv, named in runs:
        code, err = run_cli_inprocess(tool, argv)
        assert code == 2 and one_error_line(tool.PROG, err) is not None and str(named) in err, err
        record(SUITE, f"cli/{tool.PROG} output {kind}", "clear_error")
    assert tree_digest(tmp_path) == before


def test_conversions_into_their_own_folder_keep_other_iterations(hf, tmp_path):
    convert_hf_to_megatron(hf, tmp_path / "c", iteration=10, progress=False)
    first = _all_tensors(tmp_path / "c")
    convert_hf_to_megatron(hf, tmp_path / "c", 2, 1, iteration=20, progress=False)
    assert (tmp_path / "c" / "latest_checkpointed_iteration.txt").read_text().strip() == "20"
    assert _same(_all_tensors(MegatronCheckpoint(tmp_path / "c", 10).dir), first)
    with pytest.raises(FileExistsError, match="iter_0000020 already exists"):
        convert_hf_to_megatron(hf, tmp_path / "c", iteration=20, progress=False)
    record(SUITE, "converter output/own folder, same iteration without --overwrite", "clear_error")


def test_an_interrupted_overwrite_loses_nothing(hf, conv, reference, tmp_path, monkeypatch):
    import megatron_fp4.models.hf_conversion as hc

    ckpt = _copy(conv, tmp_path / "c")
    before = tree_digest(ckpt)
    calls = []
    real = hc.save_safetensors

    def crash_on_second_shard(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*a, **k)

    monkeypatch.setattr(hc, "save_safetensors", crash_on_second_shard)
    with pytest.raises(OSError):
        convert_hf_to_megatron(hf, ckpt, 2, 1, overwrite=True, progress=False)
    monkeypatch.undo()
    assert tree_digest(ckpt, skip=lambda p: ".tmp_release" in p.parts) == before  # the old checkpoint is intact
    assert _same(_all_tensors(ckpt), reference)
    convert_hf_to_megatron(hf, ckpt, 1, 1, overwrite=True, progress=False)  # the next run cleans up
    assert not (ckpt / ".tmp_release").exists() and MegatronCheckpoint(ckpt).tp == 1
    record(SUITE, "converter/crash during --overwrite", "correct")


def test_an_hf_export_that_fails_leaves_the_folder_as_it_was(conv, tmp_path, monkeypatch):
    """The HF writers (convert_megatron_to_hf, export_fp4_checkpoint) write through ShardedSafetensorsWriter as a
    context: a failure after some files were written (here the disk filling at the second file) removes them and
    keeps the folder's earlier export; a folder the export created goes too; the same call then succeeds."""
    import megatron_fp4.models.hf_conversion as hc
    from megatron_fp4.models.fp4_checkpoint import export_fp4_checkpoint

    real = hc.save_safetensors

    def crash_on_second_file(*a, **k):
        if len(list(Path(a[1]).parent.glob("model-tmp-*"))) == 1:
            raise OSError(28, "No space left on device")
        return real(*a, **k)

    earlier = convert_megatron_to_hf(conv, tmp_path / "hf", max_shard_bytes=60_000, progress=False)
    before = tree_digest(earlier)
    monkeypatch.setattr(hc, "save_safetensors", crash_on_second_file)
    with pytest.raises(OSError, match="No space left"):
        convert_megatron_to_hf(conv, earlier, max_shard_bytes=60_000, overwrite=True, progress=False)
    assert tree_digest(earlier) == before  # the earlier export is intact, no temporary file left
    with pytest.raises(OSError, match="No space left"):
        export_fp4_checkpoint(conv, tmp_path / "new" / "fp4", format="hif4", max_shard_bytes=60_000, progress=False)
    assert not (tmp_path / "new" / "fp4").exists()  # created by the export, removed with it
    monkeypatch.undo()
    convert_megatron_to_hf(conv, earlier, max_shard_bytes=60_000, overwrite=True, progress=False)
    assert tree_digest(earlier) == before  # the same input writes the same bytes
    record(SUITE, "HF writers/crash mid-export", "correct")


def test_ownership_constants_are_the_writers_own_and_the_trainer_refuses_converted_folders(conv):
    from megatron_fp4 import ownership
    from megatron_fp4.models import checkpoint_io
    from megatron_fp4.rl import checkpoint as rl

    assert ownership.WRITER_FILE == rl.WRITER_FILE and ownership.TRACKER_FILE == rl.TRACKER_FILE
    assert ownership.RL_CHECKPOINT_FORMAT == rl._FORMAT == rl._WRITER["format"]
    assert ownership.CONVERTED_FORMAT == checkpoint_io.CHECKPOINT_FORMAT
    assert ownership.TRACKER_FILE == checkpoint_io.TRACKER_FILENAME
    with pytest.raises(rl.CheckpointError, match="converted model checkpoint"):
        rl.check_save_dir(conv)


# -- one error line per tool, end to end (subprocesses) ----------------------------------------------------------------
def test_every_tool_prints_one_error_line_for_damaged_input(hf, conv, tmp_path):
    bad_hf = _copy(hf, tmp_path / "bad_hf")
    (bad_hf / "config.json").write_text((bad_hf / "config.json").read_text()[:50])
    trunc = _copy(conv, tmp_path / "trunc")
    shard = trunc / "release" / "mp_rank_00_000" / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    runs = tmp_path / "runs" / "r1"
    runs.mkdir(parents=True)
    (runs / "results.json").write_text('{"row": "fp4_fp4", "format": "hif4", "seed": "one"}')
    cases = [
        ("convert_hf_to_megatron.py", ["--hf-path", str(bad_hf), "--save", str(tmp_path / "o1")],
         bad_hf / "config.json"),
        ("convert_megatron_to_hf.py", ["--load", str(trunc), "--save", str(tmp_path / "o2")], shard),
        ("export_fp4_checkpoint.py", ["--load", str(conv), "--save", str(_rl_run(tmp_path / "run")), "--format",
                                      "hif4", "--resq", "none"], tmp_path / "run"),
        ("verify_conversion.py", ["--hf-path", str(hf), "--load", str(tmp_path / "missing")], tmp_path / "missing"),
        ("plot_runs.py", ["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "r.md")], runs / "results.json"),
    ]
    for script, argv, named in cases:
        r = run_tool(script, *argv)
        line = one_error_line(script, r.stderr)
        assert r.returncode == 2 and line is not None and str(named) in line, (script, r.returncode, r.stderr)
        record(SUITE, f"cli subprocess/{script}", "clear_error")
    assert not os.path.exists(tmp_path / "o1") and not os.path.exists(tmp_path / "o2")
