"""Tokenizers behind one small interface: a sentencepiece model built on the fly for synthetic tasks, or a
Hugging Face tokenizer loaded from a local folder (converted checkpoints)."""

from __future__ import annotations

import io
import os
from typing import Iterable, Optional, Sequence


class Tokenizer:
    """What the RL loop needs from a tokenizer: encode, decode, vocabulary size and the end-of-sequence id."""

    vocab_size: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model (from a file or serialized bytes); pad = eos when the model has no pad piece."""

    def __init__(self, model_file: Optional[str] = None, model_proto: Optional[bytes] = None) -> None:
        import sentencepiece as spm

        if (model_file is None) == (model_proto is None):
            raise ValueError("give exactly one of model_file or model_proto")
        if model_file is not None and not os.path.isfile(model_file):
            raise FileNotFoundError(f"--tokenizer-model: no such file: {model_file}")
        self.sp = spm.SentencePieceProcessor(model_file=model_file, model_proto=model_proto)
        self.vocab_size = self.sp.get_piece_size()
        self.eos_id = self.sp.eos_id()
        self.pad_id = self.sp.pad_id() if self.sp.pad_id() >= 0 else self.eos_id
        self.model_proto = self.sp.serialized_model_proto()

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.sp.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size and int(i) != self.eos_id])

    def save(self, path: str) -> None:
        """Write the model file (so a checkpoint can be reloaded without rebuilding it)."""
        with open(path, "wb") as f:
            f.write(self.model_proto)


def build_sentencepiece(texts: Iterable[str], vocab_size: int = 32) -> SentencePieceTokenizer:
    """Train a small BPE sentencepiece model on ``texts`` (digits split into single tokens), deterministically."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(list(texts)), model_writer=buf, vocab_size=vocab_size, model_type="bpe",
        split_digits=True, character_coverage=1.0, bos_id=-1, eos_id=1, unk_id=0, pad_id=2,
        add_dummy_prefix=False, num_threads=1, minloglevel=2, hard_vocab_limit=False)
    return SentencePieceTokenizer(model_proto=buf.getvalue())


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer from a local folder (no downloads)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        if not os.path.isdir(path):
            raise FileNotFoundError(f"--tokenizer-model: no such directory: {path}")
        self.path = path
        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.vocab_size = len(self.tok)
        self.eos_id = self.tok.eos_token_id
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False,
                            add_generation_prompt: bool = True) -> str:
        """The chat-formatted prompt text of ``messages`` (the tokenizer's own template; --apply-chat-template)."""
        if not getattr(self.tok, "chat_template", None):
            raise ValueError(f"--apply-chat-template: the tokenizer in {self.path} has no chat template "
                             f"(tokenizer_config.json has no 'chat_template')")
        return self.tok.apply_chat_template(messages, tokenize=tokenize, add_generation_prompt=add_generation_prompt)
