"""Test fixtures of the RL tests: a tiny HF tokenizer with a chat template, a tiny Qwen2 HF model with the
tokenizer's vocabulary, and prompt files (jsonl / json / parquet) with custom keys, all written into tmp_path; and
a run directory rewritten as an older version wrote it (:func:`rewrite_as_older_version`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

SPECIALS = ["<pad>", "<unk>", "</s>", "<|im_start|>", "<|im_end|>"]
#: What the tokenizer is trained on: the chat template's words and the addition prompts of :func:`addition_rows`.
CORPUS = ["user assistant system", "What is 1 + 2 ?", "What is 3 + 4 ?", "0 1 2 3 4 5 6 7 8 9", "the answer is"]

#: A ChatML-style template (the shape of SmolLM2-Instruct's and Qwen2's), as a tokenizer_config.json string.
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_chat_tokenizer(path: Path, chat_template: str | None = CHAT_TEMPLATE) -> int:
    """A small byte-level BPE tokenizer (trained on :data:`CORPUS`; about 50 tokens) with ``chat_template``, saved to
    ``path``; returns its size. Byte-level BPE is what Qwen2/SmolLM2 folders hold, so transformers reads it the
    same beside a Qwen2 config.json (as Qwen2Tokenizer) and without one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = sorted({c for line in CORPUS for c in line.replace(" ", "\u0120")} | {"\u010a"})  # Ġ, Ċ
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=64, special_tokens=SPECIALS,
                                                        initial_alphabet=alphabet, show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(path))
    return len(fast)


def make_tiny_qwen2(path: Path, vocab_size: int = 64, seed: int = 0) -> None:
    """A 2-layer Qwen2 (hidden 64, tied embeddings) with random O(1)-logit weights, saved to ``path``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from test_tools_helpers import randomize_hf_weights

    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rms_norm_eps=1e-5,
                      max_position_embeddings=64, rope_theta=10000.0)
    model = Qwen2ForCausalLM(cfg)
    randomize_hf_weights(model, seed)
    model.eval().save_pretrained(str(path))


def write_records(path: Path, rows: list[dict]) -> Path:
    """``rows`` as a .jsonl, .json (a list) or .parquet file (by suffix)."""
    path = Path(path)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), str(path))
    else:
        raise ValueError(f"unsupported suffix {path.suffix}")
    return path


def addition_rows(n: int, input_key: str = "problem", label_key: str = "answer", seed: int = 0) -> list[dict]:
    """``n`` one-digit addition prompts ("What is 2 + 3 ?", label "5") under the given keys."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        a, b = (int(v) for v in torch.randint(0, 5, (2,), generator=g))
        rows.append({input_key: f"What is {a} + {b} ?", label_key: str(a + b), "metadata": {"a": a, "b": b}})
    return rows


def rewrite_as_older_version(run_dir: Path, edit) -> None:
    """Rewrite every rank file of a ``pretrain_rl.py --save`` directory as a version from before checksums wrote
    it: ``edit(state)`` changes each rank's state in place (what that version stored differently); the checksum
    table goes, and so does metadata.json's note that the rank files carry one (else the files read as damaged)."""
    for f in Path(run_dir).glob("iter_*/rank_*.pt"):
        state = torch.load(f, weights_only=True)
        edit(state)
        state.pop("checksums", None)
        torch.save(state, f)
    for m in Path(run_dir).glob("iter_*/metadata.json"):
        meta = json.loads(m.read_text())
        meta.pop("checksums", None)
        m.write_text(json.dumps(meta))
