"""GGUF files as a conversion input, read through transformers' own GGUF loader (``pip install gguf``).

    source = GGUFSource("pkg_dir", "SmolLM2-135M-Instruct.Q4_1.gguf")   # HF-named fp32 tensors + config.json dict
    source.write_assets("ckpt/hf_assets")                                # tokenizer, chat template, generation

transformers dequantizes the GGUF tensors (Q4_1, Q8_0, ... -> float) and undoes llama.cpp's Q/K row permutation,
so the result is an ordinary Hugging Face Llama / Qwen2 state dict; the converters then treat it like a folder.
Nothing is downloaded (``local_files_only``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

import torch

from megatron_fp4.models.hf_conversion import DictSource

__all__ = ["gguf_path", "GGUFSource"]

PathLike = Union[str, os.PathLike]


def gguf_path(folder: PathLike, gguf_file: str) -> Path:
    """The GGUF file ``gguf_file`` inside ``folder``; FileNotFoundError naming both when it is not there."""
    path = Path(folder) / gguf_file
    if not path.is_file():
        raise FileNotFoundError(f"--gguf-file {gguf_file} not found in --hf-path {folder}")
    return path


def _require_gguf() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        raise ImportError("reading GGUF files needs the gguf package: pip install gguf") from e


class GGUFSource(DictSource):
    """The HF-named tensors (dequantized) and config.json dict of a GGUF model file, with its tokenizer."""

    def __init__(self, folder: PathLike, gguf_file: str, dtype: torch.dtype = torch.float32) -> None:
        path = gguf_path(folder, gguf_file)
        _require_gguf()
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=gguf_file, dtype=dtype,
                                                         local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf_file, local_files_only=True)
        except ImportError:
            raise
        except Exception as e:  # the GGUF reader fails in many ways on a damaged or unsupported file
            text = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ValueError(f"{path}: cannot be read as a Llama / Qwen2 GGUF model ({type(e).__name__}: "
                             f"{text[:300]})") from None
        config = model.config.to_diff_dict()
        for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
            config.pop(key, None)
        config["architectures"] = [type(model).__name__]  # GGUF configs have none
        config["dtype"] = str(dtype).replace("torch.", "")
        state = {k: v.detach() for k, v in model.state_dict().items()}
        if config.get("tie_word_embeddings"):
            state.pop("lm_head.weight", None)  # the embedding, shared
        super().__init__(config, state)
        self.path = path
        self.config_where = str(path)
        self.generation_config = model.generation_config
        self.tokenizer = tokenizer

    def where(self, name: str) -> str:
        return str(self.path)

    def write_assets(self, dst: PathLike) -> list[str]:
        """Write the tokenizer (with its chat template) and the generation config as Hugging Face files into
        ``dst``; returns the names written."""
        dst = Path(dst)
        dst.mkdir(parents=True, exist_ok=True)
        before = set(os.listdir(dst))
        self.tokenizer.save_pretrained(str(dst))
        self.generation_config.save_pretrained(str(dst))
        return sorted(set(os.listdir(dst)) - before)
