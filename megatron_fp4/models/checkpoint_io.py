"""The megatron-fp4 model checkpoint format (TP/PP-sharded safetensors), loading into live models, ``load_gpt``.

Layout of a checkpoint directory (what ``tools/convert_hf_to_megatron.py`` writes and ``pretrain_rl.py --load``
reads)::

    CKPT/
      latest_checkpointed_iteration.txt      "release" (converted) or the iteration number, e.g. "100"
      release/  (or iter_0000100/)
        args.json                            model config + parallel layout (see below)
        mp_rank_{tp:02d}_{pp:03d}/model.safetensors
      hf_assets/                             tokenizer / generation_config files copied from the HF folder (optional)

``args.json``: ``{"format": "megatron_fp4.gpt", "format_version": 1, "iteration": ..., "model_args": {GPTModelArgs
fields, params_dtype as a string; vocab_size is the padded vocabulary the model is built with},
"tensor_model_parallel_size": T, "pipeline_model_parallel_size": P, "hf_vocab_size": V, "hf_architecture": ...,
"hf_config": {the source config.json or null}, "writer": {what wrote it}, "checkpoint_id": ..., "checksum":
{"algorithm": "xxh3_128", "digest": ...}}``. The checksum covers every other field (canonical JSON), so a damaged or
hand-edited args.json is refused instead of silently building another model; args.json without one (written
before checksums) is read unverified.

Each shard carries the checksums of its tensors and its place (``checkpoint_id``, TP/PP rank and size) in its
safetensors header (:mod:`megatron_fp4.models.safetensors_io`), verified on load: a damaged, truncated, swapped or
foreign shard is an error naming the file (and the tensor). An iteration is written into ``.tmp_<iteration>`` and
renamed into place, then the tracker is replaced atomically, so a crash never leaves a half-written checkpoint under
the final name and never loses the previous copy.

Each shard holds exactly the ``state_dict()`` of the megatron-core GPTModel on that (TP, PP) rank, without
``_extra_state`` entries: local layer indices (``decoder.layers.0`` is the first layer OF THE STAGE), megatron's
grouped QKV layout, ``linear_fc1`` = [gate_r; up_r] per TP rank. With tied embeddings and PP > 1 the last stage
also stores ``output_layer.weight`` (a copy of the embedding), as megatron-core's model has it there.
A checkpoint can be loaded at any TP/PP whose sizes divide the model (it is resharded on the fly).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Optional, Union

import torch

from megatron_fp4.models.safetensors_io import (CHECKSUM_ALGORITHM, SafetensorsFile, fsync_dir, save_safetensors,
                                               writer_record)
from megatron_fp4.models.safetensors_io import write_text_atomic as _write_text_atomic
from megatron_fp4.ownership import check_output_dir

__all__ = [
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_FORMAT_VERSION",
    "TRACKER_FILENAME",
    "MegatronCheckpoint",
    "ShardedWeights",
    "is_megatron_checkpoint",
    "checkpoint_tokenizer_dir",
    "asset_digests",
    "hf_asset_files",
    "copy_hf_assets",
    "hf_info_of",
    "iteration_dirname",
    "shard_dirname",
    "layer_offset",
    "stage_param_names",
    "tp_partition",
    "split_tp",
    "merge_tp",
    "to_global_name",
    "to_local_name",
    "model_args_to_json",
    "model_args_from_json",
    "write_checkpoint_metadata",
    "check_model_args",
    "expected_shard_shapes",
    "save_model_checkpoint",
    "load_checkpoint_into_model",
    "rank_state",
    "gpt_model_args_from_checkpoint",
]

CHECKPOINT_FORMAT = "megatron_fp4.gpt"
CHECKPOINT_FORMAT_VERSION = 1
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
ARGS_FILENAME = "args.json"
SHARD_FILENAME = "model.safetensors"
HF_ASSETS_DIRNAME = "hf_assets"

PathLike = Union[str, os.PathLike]

_LAYER_RE = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
#: File suffixes of model weights: never copied as tokenizer / config assets.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf", ".onnx", ".ckpt")


# -- names and layout ----------------------------------------------------------------------------------------------
def iteration_dirname(iteration: Union[int, str]) -> str:
    """Directory name of an iteration: "release" or ``iter_{:07d}``."""
    if iteration == "release":
        return "release"
    if isinstance(iteration, bool) or not str(iteration).isdigit():
        raise ValueError(f"iteration {iteration!r} is not valid; allowed values: \"release\" or a number >= 0")
    return f"iter_{int(iteration):07d}"


def shard_dirname(tp_rank: int, pp_rank: int) -> str:
    """Directory name of one (TP, PP) shard: ``mp_rank_{tp:02d}_{pp:03d}``."""
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def layer_offset(num_layers: int, pp_rank: int, pp_size: int) -> int:
    """Global index of the first layer of pipeline stage ``pp_rank`` (layers split evenly over the stages)."""
    if num_layers % pp_size:
        raise ValueError(f"pipeline-model-parallel-size {pp_size} does not divide num_layers={num_layers}; "
                         f"choose a size that divides the number of layers")
    return pp_rank * (num_layers // pp_size)


def to_global_name(local_name: str, offset: int) -> str:
    """Stage-local parameter name -> global name (layer index shifted by the stage's layer offset)."""
    m = _LAYER_RE.fullmatch(local_name)
    return f"decoder.layers.{int(m.group(1)) + offset}.{m.group(2)}" if m else local_name


def to_local_name(global_name: str, offset: int) -> str:
    """Global parameter name -> the name on the stage whose first layer is ``offset``."""
    m = _LAYER_RE.fullmatch(global_name)
    return f"decoder.layers.{int(m.group(1)) - offset}.{m.group(2)}" if m else global_name


def stage_param_names(model_args: dict, pp_rank: int, pp_size: int) -> list[str]:
    """Global names of the tensors a (TP-agnostic) shard of stage ``pp_rank`` holds, in state_dict order."""
    num_layers = model_args["num_layers"]
    offset = layer_offset(num_layers, pp_rank, pp_size)
    per_stage = num_layers // pp_size
    names = []
    if pp_rank == 0:
        names.append("embedding.word_embeddings.weight")
    for i in range(offset, offset + per_stage):
        p = f"decoder.layers.{i}."
        names.append(p + "input_layernorm.weight")
        names.append(p + "self_attention.linear_qkv.weight")
        if model_args.get("add_qkv_bias"):
            names.append(p + "self_attention.linear_qkv.bias")
        names.append(p + "self_attention.linear_proj.weight")
        names.append(p + "pre_mlp_layernorm.weight")
        names.append(p + "mlp.linear_fc1.weight")
        names.append(p + "mlp.linear_fc2.weight")
    if pp_rank == pp_size - 1:
        names.append("decoder.final_layernorm.weight")
        if not model_args.get("tie_embeddings") or pp_size > 1:
            names.append("output_layer.weight")
    return names


def tp_partition(global_name: str) -> Optional[tuple[int, int]]:
    """(dim, stride) along which a megatron parameter is split over TP ranks; None when it is replicated.

    stride 2 marks ``linear_fc1`` of SwiGLU: rank r holds [gate chunk r; up chunk r].
    """
    if global_name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return (0, 1)
    if global_name.endswith(("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")):
        return (0, 1)
    if global_name.endswith(("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")):
        return (0, 2)
    if global_name.endswith(("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")):
        return (1, 1)
    return None


def split_tp(global_name: str, full: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's piece of a full (TP=1) megatron tensor (a fresh, contiguous tensor)."""
    part = tp_partition(global_name)
    if part is None or tp_size == 1:
        return full.clone() if tp_size > 1 else full
    dim, stride = part
    if full.shape[dim] % (tp_size * stride):
        raise ValueError(f"{global_name}: dimension {dim} of size {full.shape[dim]} cannot be split over "
                         f"tensor-model-parallel-size {tp_size}" + (" (x2 for gate/up)" if stride == 2 else ""))
    chunks = full.chunk(tp_size * stride, dim=dim)
    return torch.cat([chunks[s * tp_size + tp_rank] for s in range(stride)], dim=dim).contiguous()


def merge_tp(global_name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`split_tp`: the full tensor from the pieces of all TP ranks (in rank order)."""
    part = tp_partition(global_name)
    if part is None or len(shards) == 1:
        return shards[0]
    dim, stride = part
    if stride == 1:
        return torch.cat(shards, dim=dim)
    pieces = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([pieces[r][s] for s in range(stride) for r in range(len(shards))], dim=dim)


# -- args.json ------------------------------------------------------------------------------------------------------
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16, etc."""
    return str(dtype).replace("torch.", "")


def dtype_from_name(name: str) -> torch.dtype:
    """torch dtype for "float32" / "bfloat16" / "float16" (also accepts "torch.bfloat16")."""
    key = str(name).replace("torch.", "")
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; allowed: {', '.join(_DTYPES)}")
    return _DTYPES[key]


def model_args_to_json(model_args: Any) -> dict:
    """GPTModelArgs (or a dict of its fields) -> a JSON-able dict (no recipe / attention backend / overrides, dtype as
    a string)."""
    d = dataclasses.asdict(model_args) if dataclasses.is_dataclass(model_args) else dict(model_args)
    d.pop("fp4_recipe", None)
    d.pop("attention_backend", None)  # how attention is computed, not what the model is
    d.pop("config_overrides", None)
    d.pop("hf_info", None)
    if isinstance(d.get("params_dtype"), torch.dtype):
        d["params_dtype"] = dtype_name(d["params_dtype"])
    return d


def model_args_from_json(d: dict) -> dict:
    """Inverse of :func:`model_args_to_json`: GPTModelArgs keyword arguments."""
    d = dict(d)
    if "params_dtype" in d:
        d["params_dtype"] = dtype_from_name(d["params_dtype"])
    return d


def _no_json_constant(name: str):
    """json ``parse_constant`` hook: NaN and Infinity are not JSON (Python's reader accepts them by default)."""
    raise ValueError(f"{name} is not a JSON value")


def _args_digest(doc: dict) -> str:
    """xxh3-128 of an args.json document without its ``checksum`` field (canonical JSON)."""
    import xxhash

    body = {k: v for k, v in doc.items() if k != "checksum"}
    return xxhash.xxh3_128_hexdigest(json.dumps(body, sort_keys=True, allow_nan=False).encode())


def checkpoint_args_doc(iteration: Union[int, str], model_args: Any, tp: int, pp: int,
                        hf_config: Optional[dict] = None, hf_vocab_size: Optional[int] = None,
                        hf_architecture: Optional[str] = None, extra: Optional[dict] = None,
                        checkpoint_id: Optional[str] = None, writer: Optional[dict] = None) -> dict:
    """The args.json document of an iteration, with its checksum."""
    margs = model_args_to_json(model_args)
    doc = {
        "format": CHECKPOINT_FORMAT,
        "format_version": CHECKPOINT_FORMAT_VERSION,
        "iteration": iteration,
        "model_args": margs,
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "hf_vocab_size": hf_vocab_size if hf_vocab_size is not None else margs["vocab_size"],
        "hf_architecture": hf_architecture,
        "hf_config": hf_config,
        "writer": writer or writer_record("megatron_fp4.models.checkpoint_io"),
        "checkpoint_id": checkpoint_id or uuid.uuid4().hex,
    }
    if extra:
        doc.update(extra)
    doc["checksum"] = {"algorithm": CHECKSUM_ALGORITHM, "digest": _args_digest(doc)}
    return doc


def _tmp_iteration_dir(save_dir: Path, iteration: Union[int, str]) -> Path:
    return save_dir / f".tmp_{iteration_dirname(iteration)}"


def _commit_iteration(save_dir: Path, iteration: Union[int, str], tmp: Path) -> Path:
    """Move a fully written ``tmp`` iteration directory into place (an existing copy is moved aside first and
    deleted only after), then point the tracker at it."""
    final = save_dir / iteration_dirname(iteration)
    aside = save_dir / f".del_{final.name}"
    fsync_dir(tmp)
    if aside.exists():
        shutil.rmtree(aside)
    if final.exists():
        os.replace(final, aside)
    os.replace(tmp, final)
    fsync_dir(save_dir)
    _write_text_atomic(save_dir / TRACKER_FILENAME, f"{iteration}\n")
    if aside.exists():
        shutil.rmtree(aside)
    return final


def write_checkpoint_metadata(save_dir: PathLike, iteration: Union[int, str], model_args: Any, tp: int, pp: int,
                              hf_config: Optional[dict] = None, hf_vocab_size: Optional[int] = None,
                              hf_architecture: Optional[str] = None, extra: Optional[dict] = None,
                              checkpoint_id: Optional[str] = None, writer: Optional[dict] = None) -> Path:
    """Write ``args.json`` of an iteration (with its checksum) and then the tracker file (written last, atomically:
    marks the checkpoint complete)."""
    save_dir = Path(save_dir)
    it_dir = save_dir / iteration_dirname(iteration)
    it_dir.mkdir(parents=True, exist_ok=True)
    doc = checkpoint_args_doc(iteration, model_args, tp, pp, hf_config, hf_vocab_size, hf_architecture, extra,
                              checkpoint_id, writer)
    _write_text_atomic(it_dir / ARGS_FILENAME, json.dumps(doc, indent=2) + "\n")
    _write_text_atomic(save_dir / TRACKER_FILENAME, f"{iteration}\n")
    return it_dir


def shard_metadata(checkpoint_id: str, tp_rank: int, pp_rank: int, tp: int, pp: int) -> dict[str, str]:
    """The safetensors metadata entry recording a shard's place: which checkpoint, which TP/PP rank of which
    sizes (checked on load: a swapped or foreign shard is refused)."""
    return {"megatron_fp4.shard": json.dumps({"checkpoint_id": checkpoint_id, "tp_rank": tp_rank, "pp_rank": pp_rank,
                                              "tp": tp, "pp": pp}, sort_keys=True)}


# -- validation of what a checkpoint says about the model --------------------------------------------------------------
_INT_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size", "max_seq_len")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_model_args(ma: Any, where: str) -> None:
    """ValueError naming ``where`` (the file) and the field when ``model_args`` cannot describe a model: missing or
    non-positive sizes, heads that do not divide, unknown dtype, non-finite or non-positive epsilon / RoPE base."""
    if not isinstance(ma, dict):
        raise ValueError(f"{where}: model_args is {type(ma).__name__}, expected an object of GPTModelArgs fields")
    for f in _INT_FIELDS:
        if f not in ma:
            raise ValueError(f"{where}: model_args has no {f!r}")
        if not _is_int(ma[f]) or ma[f] < 1:
            raise ValueError(f"{where}: model_args {f}={ma[f]!r} is not valid; expected an integer >= 1")
    for f in ("num_query_groups", "kv_channels"):
        v = ma.get(f)
        if v is not None and (not _is_int(v) or v < 1):
            raise ValueError(f"{where}: model_args {f}={v!r} is not valid; expected null or an integer >= 1")
    heads, groups = ma["num_attention_heads"], ma.get("num_query_groups") or ma["num_attention_heads"]
    if heads % groups:
        raise ValueError(f"{where}: model_args num_query_groups={groups} does not divide num_attention_heads="
                         f"{heads}")
    if ma.get("kv_channels") is None and ma["hidden_size"] % heads:
        raise ValueError(f"{where}: model_args num_attention_heads={heads} does not divide hidden_size="
                         f"{ma['hidden_size']} (and kv_channels is not given)")
    for f in ("add_qkv_bias", "tie_embeddings", "swiglu", "qk_layernorm"):
        if f in ma and not isinstance(ma[f], bool):
            raise ValueError(f"{where}: model_args {f}={ma[f]!r} is not valid; expected true or false")
    for f, positive in (("norm_epsilon", False), ("rotary_base", True), ("rotary_percent", True)):
        if f in ma:
            v = ma[f]
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0 or (
                    positive and v == 0):
                raise ValueError(f"{where}: model_args {f}={v!r} is not valid; expected a finite number "
                                 f"{'> 0' if positive else '>= 0'}")
    if "normalization" in ma and ma["normalization"] not in ("RMSNorm", "LayerNorm"):
        raise ValueError(f"{where}: model_args normalization={ma['normalization']!r} is not valid; allowed values: "
                         f"'RMSNorm', 'LayerNorm'")
    if "params_dtype" in ma:
        try:
            dtype_from_name(ma["params_dtype"])
        except ValueError as e:
            raise ValueError(f"{where}: model_args params_dtype: {e}") from None


def _qwen_llama_form(ma: dict) -> bool:
    return (ma.get("swiglu", True) is True and ma.get("normalization", "RMSNorm") == "RMSNorm"
            and not ma.get("qk_layernorm") and ma.get("rotary_percent", 1.0) == 1.0)


def expected_shard_shapes(model_args: dict, tp: int, pp: int, pp_rank: int) -> Optional[dict[str, tuple[int, ...]]]:
    """{stage-local name: shape} of every tensor one (TP, PP) shard of a Qwen2/Llama-form model holds (the same
    for every TP rank); None for other model forms (LayerNorm, GELU MLP, QK norm), whose layout is not checked."""
    ma = model_args
    if not _qwen_llama_form(ma):
        return None
    h, f, v = ma["hidden_size"], ma["ffn_hidden_size"], ma["vocab_size"]
    heads = ma["num_attention_heads"]
    groups = ma.get("num_query_groups") or heads
    d = ma.get("kv_channels") or h // heads
    full = {"embedding.word_embeddings.weight": (v, h), "output_layer.weight": (v, h),
            "decoder.final_layernorm.weight": (h,)}
    per_layer = {"input_layernorm.weight": (h,), "pre_mlp_layernorm.weight": (h,),
                 "self_attention.linear_qkv.weight": ((heads + 2 * groups) * d, h),
                 "self_attention.linear_qkv.bias": ((heads + 2 * groups) * d,),
                 "self_attention.linear_proj.weight": (h, heads * d),
                 "mlp.linear_fc1.weight": (2 * f, h), "mlp.linear_fc2.weight": (h, f)}
    offset = layer_offset(ma["num_layers"], pp_rank, pp)
    out = {}
    for g in stage_param_names(ma, pp_rank, pp):
        m = _LAYER_RE.fullmatch(g)
        shape = list(per_layer[m.group(2)] if m else full[g])
        part = tp_partition(g)
        if part is not None and tp > 1:
            dim, stride = part
            if shape[dim] % (tp * stride):
                return None  # cannot be split: check_model_args / the TP check reports it
            shape[dim] //= tp
        out[to_local_name(g, offset)] = tuple(shape)
    return out


def is_megatron_checkpoint(path: PathLike) -> bool:
    """Whether ``path`` holds a model checkpoint of this format: an iteration dir with an args.json of format
    ``megatron_fp4.gpt``, or a root whose tracker file points at one (the RL driver's resume checkpoints, which
    share the tracker file name, are not)."""
    path = Path(path)
    candidates = [path / ARGS_FILENAME]
    tracker = path / TRACKER_FILENAME
    if tracker.is_file():
        try:
            candidates.append(path / iteration_dirname(tracker.read_text().strip()) / ARGS_FILENAME)
        except ValueError:
            return False
    for c in candidates:
        if c.is_file():
            try:
                return json.loads(c.read_text()).get("format") == CHECKPOINT_FORMAT
            except (ValueError, OSError):
                return False
    return False


def hf_asset_files(folder: PathLike) -> list[Path]:
    """The non-weight files of an HF folder that travel with a model (tokenizer, chat template, generation config,
    ...): every regular file except weights, ``config.json`` and weight index files, sorted by name."""
    return [p for p in sorted(Path(folder).iterdir())
            if p.is_file() and p.suffix not in WEIGHT_SUFFIXES and p.name != "config.json"
            and not p.name.endswith(".index.json")]


def copy_hf_assets(src_dir: PathLike, dst_dir: PathLike) -> list[str]:
    """Copy the non-weight files of an HF folder (tokenizer, generation_config, ...) except config.json."""
    dst_dir = Path(dst_dir)
    copied = []
    for p in hf_asset_files(src_dir):
        dst_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy2(p, dst_dir / p.name)
        copied.append(p.name)
    return copied


def hf_info_of(ckpt: "ShardedWeights") -> dict:
    """``GPTModelArgs.hf_info`` for a model loaded from ``ckpt``: its HF config, architecture, unpadded vocabulary
    and tokenizer folder (None where the checkpoint has none)."""
    assets = getattr(ckpt, "hf_assets_dir", None)
    return {"config": ckpt.args.get("hf_config"), "architecture": ckpt.args.get("hf_architecture"),
            "vocab_size": ckpt.args.get("hf_vocab_size"), "assets_dir": str(assets) if assets else None}


def asset_digests(folder: PathLike) -> dict[str, str]:
    """{file name: xxh3-128 of its bytes} of the files in an ``hf_assets/`` folder (recorded in args.json)."""
    import xxhash

    folder = Path(folder)
    if not folder.is_dir():
        return {}
    return {p.name: xxhash.xxh3_128_hexdigest(p.read_bytes()) for p in sorted(folder.iterdir()) if p.is_file()}


def verify_assets(folder: Optional[Path], recorded: Any, args_file: Path) -> None:
    """The tokenizer files ``args_file`` recorded are in ``folder`` with the bytes it recorded; ValueError naming
    the file otherwise (damaged, or replaced by a later conversion of another model into the same folder)."""
    if not isinstance(recorded, dict):
        raise ValueError(f"{args_file}: hf_assets={str(recorded)[:60]!r} is not valid; expected an object")
    have = asset_digests(folder) if folder is not None else {}
    for name, digest in sorted(recorded.items()):
        if have.get(name) != digest:
            where = (folder / name) if folder is not None else f"hf_assets/{name}"
            what = "is missing" if name not in have else "does not match its checksum"
            raise ValueError(f"{where}: {what} in {args_file} (damaged, or replaced by a later conversion of "
                             f"another model into this folder)")


def checkpoint_tokenizer_dir(path: PathLike) -> Optional[Path]:
    """The ``hf_assets/`` folder (tokenizer files copied from the HF model) of a checkpoint, if it has one
    (verified against the checksums a converted checkpoint records)."""
    path = Path(path)
    if is_megatron_checkpoint(path):
        return MegatronCheckpoint(path).hf_assets_dir
    for d in (path / HF_ASSETS_DIRNAME, path.parent / HF_ASSETS_DIRNAME):
        if d.is_dir():
            return d
    return None


# -- reading ----------------------------------------------------------------------------------------------------------
class ShardedWeights:
    """A model's weights stored as (TP, PP) shards under stage-local names: the full (TP-merged) tensor of any
    global name, whatever layout they were saved with. Subclasses set ``dir`` (for messages), ``args`` (dict;
    ``hf_vocab_size`` = the real vocabulary when the stored one is padded), ``model_args`` (``num_layers``,
    ``vocab_size``, ``tie_embeddings``, and the sizes :func:`load_checkpoint_into_model` checks), ``tp``, ``pp``,
    and implement :meth:`shard_tensor` and :meth:`shard_keys`."""

    dir: Path
    args: dict
    model_args: dict
    tp: int
    pp: int

    def shard_tensor(self, tp_rank: int, pp_rank: int, local_name: str) -> torch.Tensor:
        raise NotImplementedError

    def shard_keys(self, tp_rank: int, pp_rank: int) -> list[str]:
        raise NotImplementedError

    def write_hf_assets(self, dst: PathLike) -> list[str]:
        """Write the tokenizer / generation-config files stored with the weights into ``dst``; the names written
        (none by default)."""
        return []

    def stage_of(self, global_name: str) -> int:
        """Pipeline stage whose shards hold ``global_name``."""
        m = _LAYER_RE.fullmatch(global_name)
        if m:
            return int(m.group(1)) // (self.model_args["num_layers"] // self.pp)
        if global_name.startswith("embedding."):
            return 0
        return self.pp - 1

    def full_tensor(self, global_name: str) -> torch.Tensor:
        """The full (TP-merged) tensor of a global megatron name (tied output layer falls back to the embedding)."""
        stage = self.stage_of(global_name)
        offset = layer_offset(self.model_args["num_layers"], stage, self.pp)
        local = to_local_name(global_name, offset)
        if global_name == "output_layer.weight" and local not in self.shard_keys(0, stage):
            if self.model_args.get("tie_embeddings"):
                return self.full_tensor("embedding.word_embeddings.weight")
        return merge_tp(global_name, [self.shard_tensor(r, stage, local) for r in range(self.tp)])


class MegatronCheckpoint(ShardedWeights):
    """Read access to one iteration of a checkpoint: args, shard files, full (TP-merged) tensors by global name.

    Shards are opened lazily (memory-mapped); :meth:`full_tensor` reads only the pieces of one tensor. Everything
    read is checked: args.json (its checksum and fields), each shard's place, tensor names and shapes when it is
    opened, and each tensor's checksum when it is read; a problem is a ValueError (or FileNotFoundError) naming
    the file.
    """

    def __init__(self, path: PathLike, iteration: Optional[Union[int, str]] = None, verify: bool = True) -> None:
        path = Path(path)
        self.verify = verify
        if not path.exists():
            raise FileNotFoundError(f"checkpoint directory {path} does not exist")
        if not path.is_dir():
            raise ValueError(f"checkpoint {path} is a file, not a checkpoint directory")
        if (path / ARGS_FILENAME).is_file() and iteration is None:
            it_dir = path  # an iteration directory was given directly
        else:
            if iteration is None:
                tracker = path / TRACKER_FILENAME
                if not tracker.is_file():
                    raise FileNotFoundError(
                        f"{tracker} not found: {path} is not a megatron-fp4 checkpoint (or it is incomplete); "
                        f"expected {TRACKER_FILENAME} and <iteration>/{ARGS_FILENAME}")
                try:
                    iteration = tracker.read_text().strip()
                    iteration_dirname(iteration)
                except (ValueError, UnicodeDecodeError, OSError):
                    raise ValueError(f"{tracker}: expected \"release\" or an iteration number; the tracker is "
                                     f"damaged") from None
            it_dir = path / iteration_dirname(iteration)
        args_file = it_dir / ARGS_FILENAME
        if not args_file.is_file():
            raise FileNotFoundError(f"{args_file} not found (checkpoint incomplete or wrong --iteration)")
        self.dir = it_dir
        self.args: dict = self._read_args(args_file)
        self.model_args: dict = self.args["model_args"]
        self.tp: int = int(self.args["tensor_model_parallel_size"])
        self.pp: int = int(self.args["pipeline_model_parallel_size"])
        self._handles: dict[tuple[int, int], SafetensorsFile] = {}

    def _read_args(self, args_file: Path) -> dict:
        """args.json parsed and checked: format, checksum, model_args fields, parallel sizes."""
        try:
            doc = json.loads(args_file.read_text(), parse_constant=_no_json_constant)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{args_file}: not valid JSON ({e}); the file is damaged") from None
        if not isinstance(doc, dict):
            raise ValueError(f"{args_file}: expected a JSON object, found {type(doc).__name__}")
        if doc.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{args_file}: format {doc.get('format')!r} is not {CHECKPOINT_FORMAT!r}")
        version = doc.get("format_version", 0)
        if not _is_int(version):
            raise ValueError(f"{args_file}: format_version {version!r} is not an integer")
        if version > CHECKPOINT_FORMAT_VERSION:
            raise ValueError(f"{args_file}: format_version {doc['format_version']} is newer than this "
                             f"reader ({CHECKPOINT_FORMAT_VERSION})")
        if "checksum" in doc and self.verify:
            c = doc["checksum"]
            if not isinstance(c, dict) or c.get("algorithm") != CHECKSUM_ALGORITHM:
                raise ValueError(f"{args_file}: its checksum record is damaged (expected algorithm "
                                 f"{CHECKSUM_ALGORITHM})")
            try:
                digest = _args_digest(doc)
            except ValueError:  # NaN / infinity in the document
                digest = None
            if c.get("digest") != digest:
                raise ValueError(f"{args_file}: does not match its checksum: the file was damaged or edited by "
                                 f"hand (its model arguments cannot be trusted); restore it or convert the model "
                                 f"again")
        check_model_args(doc.get("model_args"), str(args_file))
        for f in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            if not _is_int(doc.get(f)) or doc[f] < 1:
                raise ValueError(f"{args_file}: {f}={doc.get(f)!r} is not valid; expected an integer >= 1")
        ma = doc["model_args"]
        if ma["num_layers"] % doc["pipeline_model_parallel_size"]:
            raise ValueError(f"{args_file}: pipeline_model_parallel_size={doc['pipeline_model_parallel_size']} "
                             f"does not divide model_args num_layers={ma['num_layers']}")
        hv = doc.get("hf_vocab_size")
        if hv is not None and (not _is_int(hv) or not 1 <= hv <= ma["vocab_size"]):
            raise ValueError(f"{args_file}: hf_vocab_size={hv!r} is not valid; expected an integer in [1, "
                             f"model_args vocab_size={ma['vocab_size']}]")
        if doc.get("hf_config") is not None and not isinstance(doc["hf_config"], dict):
            raise ValueError(f"{args_file}: hf_config is {type(doc['hf_config']).__name__}, expected an object "
                             f"or null")
        return doc

    @property
    def hf_assets_dir(self) -> Optional[Path]:
        """``hf_assets/`` beside the iteration directories (tokenizer files), if present; the files args.json
        recorded are verified against their checksums."""
        found = None
        for d in (self.dir.parent / HF_ASSETS_DIRNAME, self.dir / HF_ASSETS_DIRNAME):
            if d.is_dir():
                found = d
                break
        if self.verify and HF_ASSETS_DIRNAME in self.args:
            verify_assets(found, self.args[HF_ASSETS_DIRNAME], self.dir / ARGS_FILENAME)
        return found

    def write_hf_assets(self, dst: PathLike) -> list[str]:
        """Copy the files of :attr:`hf_assets_dir` into ``dst``."""
        src = self.hf_assets_dir
        return [] if src is None else copy_hf_assets(src, dst)

    def shard_path(self, tp_rank: int, pp_rank: int) -> Path:
        """Path of the safetensors file of shard (tp_rank, pp_rank)."""
        return self.dir / shard_dirname(tp_rank, pp_rank) / SHARD_FILENAME

    def _handle(self, tp_rank: int, pp_rank: int) -> SafetensorsFile:
        key = (tp_rank, pp_rank)
        if key not in self._handles:
            p = self.shard_path(tp_rank, pp_rank)
            if not 0 <= tp_rank < self.tp or not 0 <= pp_rank < self.pp:
                raise ValueError(f"shard (TP rank {tp_rank}, PP rank {pp_rank}) does not exist in {self.dir} "
                                 f"(written with TP={self.tp}, PP={self.pp})")
            if not p.is_file():
                raise FileNotFoundError(f"checkpoint shard {p} is missing (checkpoint written with "
                                        f"TP={self.tp}, PP={self.pp})")
            f = SafetensorsFile(p, verify=self.verify)
            self._check_shard(f, tp_rank, pp_rank)
            self._handles[key] = f
        return self._handles[key]

    def _check_shard(self, f: SafetensorsFile, tp_rank: int, pp_rank: int) -> None:
        """The shard is the one this args.json describes (its recorded place) with the tensors, shapes and dtypes
        the model arguments imply."""
        place = f.metadata.get("megatron_fp4.shard")
        if place is not None and self.verify and ("checksum" not in self.args or "checkpoint_id" not in self.args):
            raise ValueError(f"{self.dir / ARGS_FILENAME}: has no checksum or checkpoint_id, but its shards were "
                             f"written with them ({f.path}): args.json was edited or damaged; restore it or convert "
                             f"the model again")
        if place is not None and self.verify:
            want = {"checkpoint_id": self.args.get("checkpoint_id"), "tp_rank": tp_rank, "pp_rank": pp_rank,
                    "tp": self.tp, "pp": self.pp}
            try:
                got = json.loads(place)
            except ValueError:
                got = None
            if not isinstance(got, dict) or any(got.get(k) != v for k, v in want.items()
                                                if v is not None or k != "checkpoint_id"):
                raise ValueError(f"{f.path}: this shard belongs elsewhere (it records {place}, {self.dir} expects "
                                 f"{json.dumps(want, sort_keys=True)}): a shard was moved, swapped or copied from "
                                 f"another checkpoint")
        expected = expected_shard_shapes(self.model_args, self.tp, self.pp, pp_rank)
        keys = f.keys()
        if expected is not None:
            missing = [k for k in expected if k not in keys and not (
                k == "output_layer.weight" and self.model_args.get("tie_embeddings") and self.pp == 1)]
            unexpected = [k for k in keys if k not in expected]
            if missing or unexpected:
                raise ValueError(f"{f.path}: holds other tensors than {self.dir / ARGS_FILENAME} implies: missing "
                                 f"{missing[:4]}, unexpected {unexpected[:4]}")
            for k in keys:
                if f.shape(k) != expected[k]:
                    raise ValueError(f"{f.path}: tensor {k} has shape {f.shape(k)}, {self.dir / ARGS_FILENAME} "
                                     f"implies {expected[k]}")
        for k in keys:
            if not f.dtype(k).is_floating_point:
                raise ValueError(f"{f.path}: tensor {k} has dtype {dtype_name(f.dtype(k))}; model weights are "
                                 f"floating point")

    def close(self) -> None:
        """Drop the open shard handles."""
        self._handles.clear()

    def check_shards(self) -> None:
        """Open every shard: headers, places, names and shapes checked (tensor data is verified when read)."""
        for pp_rank in range(self.pp):
            for tp_rank in range(self.tp):
                self._handle(tp_rank, pp_rank)

    def shard_tensor(self, tp_rank: int, pp_rank: int, local_name: str) -> torch.Tensor:
        """One tensor of one shard, by its stage-local name (verified against its checksum)."""
        h = self._handle(tp_rank, pp_rank)
        if local_name not in h:
            raise KeyError(f"{local_name} not found in {self.shard_path(tp_rank, pp_rank)}")
        return h.get(local_name)

    def shard_keys(self, tp_rank: int, pp_rank: int) -> list[str]:
        """Stage-local names stored in one shard."""
        return self._handle(tp_rank, pp_rank).keys()

    def load_shard(self, tp_rank: int, pp_rank: int) -> dict[str, torch.Tensor]:
        """The whole state dict of one shard (stage-local names)."""
        return self._handle(tp_rank, pp_rank).load_all()


# -- live models ------------------------------------------------------------------------------------------------------
def _unwrap(model: Any) -> torch.nn.Module:
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise NotImplementedError("virtual pipeline parallelism (a list of model chunks) is not supported "
                                      "by the checkpoint loader; pass a single model")
        model = model[0]
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def _model_layer_offset(module: torch.nn.Module) -> int:
    decoder = getattr(module, "decoder", None)
    layers = getattr(decoder, "layers", None)
    if layers is None or len(layers) == 0:
        return 0
    return int(layers[0].layer_number) - 1


def _parallel_ranks() -> tuple[int, int, int, int]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1, 0, 1, 0
    return (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
            ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank())


def _expected_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in module.state_dict().items()
            if not k.endswith("_extra_state") and isinstance(v, torch.Tensor)}


def load_checkpoint_into_model(model: Any, load_dir: Union[PathLike, ShardedWeights],
                               iteration: Optional[Union[int, str]] = None, strict: bool = True) -> ShardedWeights:
    """Load this rank's part of a checkpoint into a built megatron-core GPTModel (DDP/Float16 wrappers unwrapped).

    Reads only this rank's shard when the checkpoint's TP/PP equal the current ones; otherwise reshards (reads
    the pieces of each needed tensor from the checkpoint's shards and splits them for this rank). A model whose
    vocabulary is padded differently (but holds the checkpoint's real vocabulary) gets zero padding rows.
    A model whose config has ``pipeline_model_parallel_size`` 1 holds every layer (megatron-core builds it that
    way whatever parallel_state says) and is loaded as the full model, e.g. the rollout copy of a PP > 1 run.
    ``load_dir``: a checkpoint directory of this format, or any :class:`ShardedWeights` (e.g. an RL checkpoint).
    """
    module = _unwrap(model)
    ckpt = load_dir if isinstance(load_dir, ShardedWeights) else MegatronCheckpoint(load_dir, iteration)
    state = rank_state(module, ckpt, strict=strict)
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if strict and (missing or unexpected):
        raise KeyError(f"load_state_dict: missing {missing[:8]}, unexpected {unexpected[:8]}")
    return ckpt


def rank_state(model: Any, ckpt: ShardedWeights, names: Optional[list[str]] = None,
               strict: bool = True) -> dict[str, torch.Tensor]:
    """{local name: this rank's tensor} of ``ckpt`` for the built ``model`` (its state-dict names, or ``names``,
    e.g. only the parameters for optimizer state), resharded when the checkpoint's TP/PP differ (see
    :func:`load_checkpoint_into_model`)."""
    module = _unwrap(model)
    tp_size, tp_rank, pp_size, pp_rank = _parallel_ranks()
    if getattr(getattr(module, "config", None), "pipeline_model_parallel_size", pp_size) == 1:
        pp_size, pp_rank = 1, 0  # a full-depth model (e.g. the rollout copy) under a PP > 1 parallel_state
    expected = _expected_state(module)
    if names is not None:
        expected = {k: expected[k] for k in names}
    offset = _model_layer_offset(module)
    _check_model_matches(ckpt, module)
    vocab = getattr(module, "vocab_size", None)
    same_vocab = vocab is None or vocab == ckpt.model_args["vocab_size"]
    real = int(ckpt.args.get("hf_vocab_size") or ckpt.model_args["vocab_size"])
    if ckpt.tp == tp_size and ckpt.pp == pp_size and same_vocab:
        stored = set(ckpt.shard_keys(tp_rank, pp_rank))
        missing = sorted(set(expected) - stored)
        unexpected = sorted(stored - set(expected)) if names is None else []
        if strict and (missing or unexpected):
            raise KeyError(f"checkpoint {ckpt.dir} shard (TP rank {tp_rank}, PP rank {pp_rank}) does not match "
                           f"the model: missing {missing[:8]}, unexpected {unexpected[:8]}")
        state = {k: ckpt.shard_tensor(tp_rank, pp_rank, k) for k in expected if k in stored}
    else:
        state = {}
        for local in expected:
            g = to_global_name(local, offset)
            state[local] = split_tp(g, _fit_vocab(g, ckpt.full_tensor(g), vocab, real), tp_size, tp_rank)
    for k, v in state.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            hint = (" (vocabulary size differs: build the model with the checkpoint's model_args.vocab_size)"
                    if "word_embeddings" in k or "output_layer" in k else "")
            raise ValueError(f"shape mismatch for {k}: checkpoint {tuple(v.shape)} vs model "
                             f"{tuple(expected[k].shape)}{hint}")
    return state


def _check_model_matches(ckpt: MegatronCheckpoint, module: torch.nn.Module) -> None:
    cfg = getattr(module, "config", None)
    if cfg is None:
        return
    ma = ckpt.model_args
    for field, ours in (("num_layers", cfg.num_layers), ("hidden_size", cfg.hidden_size),
                        ("num_attention_heads", cfg.num_attention_heads),
                        ("ffn_hidden_size", cfg.ffn_hidden_size)):
        if field in ma and ma[field] != ours:
            raise ValueError(f"model does not match checkpoint {ckpt.dir}: {field}={ours} in the model, "
                             f"{ma[field]} in the checkpoint")
    vocab = getattr(module, "vocab_size", None)
    real = int(ckpt.args.get("hf_vocab_size") or ma["vocab_size"])
    if vocab is not None and vocab < real:
        raise ValueError(f"vocabulary mismatch: model vocab_size={vocab} is smaller than the checkpoint's "
                         f"vocabulary {real} ({ckpt.dir}); build the model with vocab_size >= {real} (the "
                         f"checkpoint's model_args.vocab_size is {ma['vocab_size']})")


def _fit_vocab(global_name: str, full: torch.Tensor, vocab: Optional[int], real: int) -> torch.Tensor:
    """Embedding / output rows padded with zeros or stripped of padding to the model's vocabulary size."""
    if vocab is None or global_name not in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return full
    if full.shape[0] > vocab:
        if vocab < real:
            raise ValueError(f"vocabulary mismatch: {global_name} has {real} real rows, model vocab_size={vocab}")
        return full[:vocab]
    if full.shape[0] < vocab:
        return torch.cat([full, full.new_zeros(vocab - full.shape[0], *full.shape[1:])], dim=0)
    return full


def save_model_checkpoint(model: Any, save_dir: PathLike, iteration: Union[int, str], model_args: Any,
                          hf_config: Optional[dict] = None, hf_vocab_size: Optional[int] = None,
                          hf_architecture: Optional[str] = None, copy_hf_assets_from: Optional[PathLike] = None,
                          like: Optional[MegatronCheckpoint] = None) -> Path:
    """Save the model weights of every (TP, PP) rank in this format (collective over all ranks; DP rank 0 writes).

    ``like``: the checkpoint the model was loaded from; its HF config, vocabulary, architecture and tokenizer files
    are carried over (explicit arguments win). Rank 0 writes args.json and the tracker file after all shards.
    Returns the iteration directory.
    """
    if like is not None:
        hf_config = hf_config if hf_config is not None else like.args.get("hf_config")
        hf_vocab_size = hf_vocab_size if hf_vocab_size is not None else like.args.get("hf_vocab_size")
        hf_architecture = hf_architecture or like.args.get("hf_architecture")
        copy_hf_assets_from = copy_hf_assets_from or like.hf_assets_dir

    iteration_dirname(iteration)  # validates
    save_dir = Path(save_dir)
    check_output_dir(save_dir, "converted", arg="save_dir")  # every rank: the same answer, before anyone writes
    module = _unwrap(model)
    tp_size, tp_rank, pp_size, pp_rank = _parallel_ranks()
    dist = torch.distributed.is_available() and torch.distributed.is_initialized()
    rank0 = not dist or torch.distributed.get_rank() == 0
    dp_rank = 0
    if dist:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            dp_rank = ps.get_data_parallel_rank()
    box = [uuid.uuid4().hex]
    if dist:
        torch.distributed.broadcast_object_list(box, src=0)
    checkpoint_id = box[0]
    writer = writer_record("megatron_fp4.models.checkpoint_io.save_model_checkpoint")
    tmp = _tmp_iteration_dir(save_dir, iteration)
    if rank0 and tmp.exists():
        shutil.rmtree(tmp)  # left by an interrupted save
    if dist:
        torch.distributed.barrier()
    if dp_rank == 0:
        shard = tmp / shard_dirname(tp_rank, pp_rank)
        shard.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to("cpu").contiguous().clone() for k, v in _expected_state(module).items()}
        save_safetensors(state, shard / SHARD_FILENAME, shard_metadata(checkpoint_id, tp_rank, pp_rank, tp_size,
                                                                       pp_size), writer=writer)
    if dist:
        torch.distributed.barrier()
    if rank0:
        if copy_hf_assets_from is not None:
            src = Path(copy_hf_assets_from)
            if src.is_dir() and src.resolve() != (save_dir / HF_ASSETS_DIRNAME).resolve():
                shutil.copytree(src, save_dir / HF_ASSETS_DIRNAME, dirs_exist_ok=True)
        assets = asset_digests(save_dir / HF_ASSETS_DIRNAME)
        doc = checkpoint_args_doc(iteration, model_args, tp_size, pp_size, hf_config=hf_config,
                                  hf_vocab_size=hf_vocab_size, hf_architecture=hf_architecture,
                                  checkpoint_id=checkpoint_id, writer=writer,
                                  extra={HF_ASSETS_DIRNAME: assets} if assets else None)
        _write_text_atomic(tmp / ARGS_FILENAME, json.dumps(doc, indent=2) + "\n")
        _commit_iteration(save_dir, iteration, tmp)
    if dist:
        torch.distributed.barrier()
    return save_dir / iteration_dirname(iteration)


def gpt_model_args_from_checkpoint(path: PathLike, iteration: Optional[Union[int, str]] = None, **changes: Any):
    """The ``GPTModelArgs`` a checkpoint was written with (``changes`` override fields, e.g. ``fp4_recipe``,
    ``params_dtype``, a larger ``vocab_size``). Build with ``build_gpt_model`` at any TP/PP, then
    :func:`load_checkpoint_into_model` (before the optimizer is built: it copies the params)."""
    from megatron_fp4.models.gpt import GPTModelArgs

    ckpt = path if isinstance(path, MegatronCheckpoint) else MegatronCheckpoint(path, iteration)
    return GPTModelArgs(**{**model_args_from_json(ckpt.model_args), "hf_info": hf_info_of(ckpt), **changes})
