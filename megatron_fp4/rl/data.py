"""RL prompt data: jsonl loading, slime-style prompt files (jsonl/json/parquet through the ``datasets`` library, with
chosen input/label keys and an optional chat template), prompt templates, a resumable deterministic sampler,
held-out splits and synthetic verifiable tasks (synthetic:add, synthetic:arith) for the tiny CPU run.

Every example carries the `reference` and reward `kind` that `megatron_fp4.rl.rewards.score` takes, and, where
one is known, a supervised `target` completion (used by the driver's short warm-up phase).
"""

from __future__ import annotations

import json
import os
import random
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["Example", "TEMPLATES", "load_jsonl", "format_prompt", "load_gsm8k", "load_math_jsonl", "read_records",
           "load_prompt_data",
           "make_addition_examples", "make_arith_examples", "check_arith_steps", "load_dataset", "DATASET_KINDS",
           "PromptSampler", "split_heldout"]


@dataclass(frozen=True)
class Example:
    """One RL prompt: the text fed to the model and what the reward needs to check a response."""

    prompt: str          # formatted prompt (template and optional chat template applied)
    reference: str       # the dataset's answer field, passed to rewards.score
    kind: str            # reward kind for rewards.score ("gsm8k", "math" or "math_rule")
    question: str = ""   # the raw question
    target: str = ""     # a correct completion for supervised warm-up, "" when unknown
    label: Any = None    # the record's label as stored (a --custom-rm-path function gets it; None: the reference)
    metadata: Any = None  # the record's metadata dict (--metadata-key), for --custom-rm-path


# ----------------------------------------------------------------------------------------------- jsonl + prompts

def load_jsonl(path: str | Path, required_fields: Sequence[str] = ("question", "answer")) -> list[dict]:
    """Records of a jsonl file (blank lines skipped); errors name the file and the 1-based line number."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"dataset file not found: {p}")
    rows = []
    with p.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{p}:{lineno}: expected a JSON object, got {type(row).__name__}")
            missing = [k for k in required_fields if k not in row]
            if missing:
                raise ValueError(f"{p}:{lineno}: missing field(s) {missing}; present: {sorted(row)}")
            for k in required_fields:
                if not isinstance(row[k], str):
                    raise ValueError(f"{p}:{lineno}: field {k!r} must be a string, got {type(row[k]).__name__}")
            rows.append(row)
    if not rows:
        raise ValueError(f"{p}: no records")
    return rows


TEMPLATES: dict[str, str] = {
    "gsm8k": "Question: {question}\nAnswer: Let's think step by step.",
    "math": "Problem: {question}\nPlease reason step by step, and put your final answer within \\boxed{{}}.\n"
            "Solution:",
    "plain": "{question}",
}

ChatTemplate = Callable[[str], str]


def format_prompt(question: str, template: str = "gsm8k", chat_template: ChatTemplate | Any | None = None) -> str:
    """Prompt text for a question: a TEMPLATES name or a format string with {question}, then the chat hook.

    chat_template: None (raw text), a callable str -> str, or a tokenizer with `apply_chat_template` (the text
    becomes one user message, with the generation prompt added).
    """
    fmt = TEMPLATES.get(template, template)
    if "{question}" not in fmt:
        raise ValueError(f"template must be one of {sorted(TEMPLATES)} or contain '{{question}}', got {template!r}")
    return _chat(fmt.format(question=question.strip()), chat_template)


def _chat(prompt: str | list, chat_template: ChatTemplate | Any | None) -> str:
    """A prompt (text, or a list of chat messages) through the chat hook (see :func:`format_prompt`)."""
    if chat_template is None:
        if not isinstance(prompt, str):
            raise ValueError("a prompt given as chat messages needs a chat template (--apply-chat-template)")
        return prompt
    if hasattr(chat_template, "apply_chat_template"):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return chat_template.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if callable(chat_template) and isinstance(prompt, str):
        return chat_template(prompt)
    raise TypeError("chat_template must be None, a callable, or a tokenizer with apply_chat_template")


# ----------------------------------------------------------------------------------------------- slime-style files

def read_records(path: str | Path) -> list[dict]:
    """The records of a local .jsonl, .json or .parquet file, read with the ``datasets`` library (nothing is
    downloaded: HF_DATASETS_OFFLINE is set; its Arrow cache lives in a temporary directory); .jsonl without it
    where it is not installed."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"dataset file not found: {p}")
    builders = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
    if p.suffix not in builders:
        raise ValueError(f"{p}: unsupported file type {p.suffix!r}; allowed: {', '.join(builders)}")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        if p.suffix == ".jsonl":  # plain JSON lines need no library (a GPU image without datasets)
            return load_jsonl(p, required_fields=())
        raise ImportError(f"reading {p} needs the datasets library: pip install datasets pyarrow (or pip install "
                          f"-e .[rl])") from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory(prefix="megatron_fp4_datasets_") as cache:
        ds = datasets.load_dataset(builders[p.suffix], data_files=str(p), split="train", cache_dir=cache)
        rows = ds.to_list()
    if not rows:
        raise ValueError(f"{p}: no records")
    return rows


def load_prompt_data(path: str | Path, input_key: str = "input", label_key: str | None = "label",
                     metadata_key: str = "metadata", kind: str = "math",
                     chat_template: ChatTemplate | Any | None = None, require_label: bool = True) -> list[Example]:
    """Examples of a slime-style prompt file: the prompt in ``input_key`` (text, or a list of chat messages), the
    reference answer in ``label_key``, optional ``metadata_key``; scored with reward ``kind``. With
    ``chat_template`` (a tokenizer with apply_chat_template) every prompt goes through the chat template."""
    rows = read_records(path)
    out = []
    for i, r in enumerate(rows):
        if input_key not in r or r[input_key] is None:
            raise ValueError(f"{path}: record {i + 1} has no {input_key!r} (--input-key); keys: {sorted(r)}")
        prompt = r[input_key]
        if not isinstance(prompt, str) and not (isinstance(prompt, list) and all(
                isinstance(m, dict) and "role" in m and "content" in m for m in prompt)):
            raise ValueError(f"{path}: record {i + 1}: {input_key!r} must be text or a list of "
                             f"{{'role', 'content'}} messages, got {type(prompt).__name__}")
        label = r.get(label_key) if label_key else None
        if label is None and require_label:
            raise ValueError(f"{path}: record {i + 1} has no {label_key!r} (--label-key), the reference answer the "
                             f"reward needs; keys: {sorted(r)}")
        try:
            text = _chat(prompt, chat_template)
        except ValueError as e:
            raise ValueError(f"{path}: record {i + 1}: {e}") from None
        question = prompt if isinstance(prompt, str) else json.dumps(prompt)
        meta = r.get(metadata_key)
        out.append(Example(prompt=text, reference="" if label is None else str(label), kind=kind, question=question,
                           label=label, metadata=meta if isinstance(meta, dict) else {}))
    return out


def load_gsm8k(path: str | Path, template: str = "gsm8k", chat_template: ChatTemplate | Any | None = None
               ) -> list[Example]:
    """GSM8K jsonl ({"question", "answer"} with the final answer after '####') as reward-kind 'gsm8k' examples;
    the warm-up target is the solution without its <<calculator>> annotations."""
    rows = load_jsonl(path, ("question", "answer"))
    out = []
    for i, r in enumerate(rows):
        if "####" not in r["answer"]:
            raise ValueError(f"{path}: record {i + 1}: GSM8K answer has no '#### <final answer>'")
        out.append(Example(prompt=format_prompt(r["question"], template, chat_template), reference=r["answer"],
                           kind="gsm8k", question=r["question"],
                           target=" " + re.sub(r"<<[^<>]*>>", "", r["answer"]).strip()))
    return out


def load_math_jsonl(path: str | Path, template: str = "math", chat_template: ChatTemplate | Any | None = None
                    ) -> list[Example]:
    """MATH-style jsonl: question in "problem" or "question"; reference in "answer" (else "solution")."""
    rows = load_jsonl(path, ())
    out = []
    for i, r in enumerate(rows):
        q = r.get("problem", r.get("question"))
        ref = r.get("answer", r.get("solution"))
        if not isinstance(q, str) or not isinstance(ref, (str, int, float)):
            raise ValueError(f"{path}: record {i + 1}: needs a string 'problem'/'question' and an 'answer'/'solution'")
        out.append(Example(prompt=format_prompt(q, template, chat_template), reference=str(ref), kind="math",
                           question=q))
    return out


# ----------------------------------------------------------------------------------------------- synthetic tasks

def _digits_range(digits: int | tuple[int, int]) -> tuple[int, int]:
    lo, hi = (1, digits) if isinstance(digits, int) else digits
    if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi <= 18):
        raise ValueError(f"digits must be an int in 1..18 or a (min, max) pair within it, got {digits!r}")
    return lo, hi


def make_addition_examples(n: int, digits: int | tuple[int, int] = 3, seed: int = 0, num_operands: int = 2
                           ) -> list[Example]:
    """n distinct addition prompts like '12+345=' with reference/target '357' (reward kind 'math_rule': exact).

    digits: the most digits per operand (or a (min, max) pair); the digit count is drawn uniformly first, so
    short operands are as common as long ones.
    """
    lo, hi = _digits_range(digits)
    if num_operands < 2:
        raise ValueError(f"num_operands must be >= 2, got {num_operands}")
    space = (10 ** hi - (10 ** (lo - 1) if lo > 1 else 0)) ** num_operands
    if n > space // 2:
        raise ValueError(f"n={n} is too many distinct problems for digits={digits!r} (at most {space // 2})")
    rng = random.Random(f"synthetic:add:{seed}")
    seen: set[tuple[int, ...]] = set()
    out = []
    while len(out) < n:
        ops = []
        for _ in range(num_operands):
            d = rng.randint(lo, hi)
            ops.append(rng.randint(10 ** (d - 1) if d > 1 else 0, 10 ** d - 1))
        key = tuple(ops)
        if key in seen:
            continue
        seen.add(key)
        q = "+".join(map(str, ops)) + "="
        ans = str(sum(ops))
        out.append(Example(prompt=q, reference=ans, kind="math_rule", question=q, target=ans))
    return out


_NAMES = ["Tom", "Mia", "Ravi", "Lena", "Omar", "Sara", "Ken", "Ada", "Luis", "Nora", "Ivan", "Zoe"]
_ITEMS = ["apples", "marbles", "stickers", "books", "coins", "pencils", "cookies", "cards"]


def make_arith_examples(n: int, steps: int | tuple[int, int] = (2, 3), max_start: int = 50, seed: int = 0,
                        template: str = "gsm8k") -> list[Example]:
    """n multi-step arithmetic word problems (reward kind 'gsm8k') with step-by-step GSM8K-style solutions.

    Each step adds, removes or multiplies; intermediate counts stay non-negative. The target/reference is
    'a + b = c' lines followed by '#### answer'; check_arith_steps verifies such a solution's arithmetic.
    """
    lo, hi = (steps, steps) if isinstance(steps, int) else steps
    if not 1 <= lo <= hi:
        raise ValueError(f"steps must be >= 1 (or a (min, max) pair), got {steps!r}")
    if max_start < 2:
        raise ValueError(f"max_start must be >= 2, got {max_start}")
    rng = random.Random(f"synthetic:arith:{seed}")
    seen: set[str] = set()
    out = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(f"could not make {n} distinct problems with steps={steps!r}, max_start={max_start}")
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        value = rng.randint(2, max_start)
        sentences = [f"{name} has {value} {item}."]
        lines = []
        for k in range(rng.randint(lo, hi)):
            op = rng.choice(["add", "sub", "mul"] if value <= 100 else ["add", "sub"])
            subject = name if k == 0 else f"Then {name}"
            if op == "add":
                b = rng.randint(1, 20)
                sentences.append(f"{subject} gets {b} more.")
                lines.append(f"{value} + {b} = {value + b}")
                value += b
            elif op == "sub" and value > 1:
                b = rng.randint(1, value - 1)
                sentences.append(f"{subject} gives away {b}.")
                lines.append(f"{value} - {b} = {value - b}")
                value -= b
            else:
                b = rng.randint(2, 3)
                sentences.append(f"{subject} {'doubles' if b == 2 else 'triples'} the {item}.")
                lines.append(f"{value} * {b} = {value * b}")
                value *= b
        sentences.append(f"How many {item} does {name} have now?")
        q = " ".join(sentences)
        if q in seen:
            continue
        seen.add(q)
        solution = "\n".join(lines) + f"\n#### {value}"
        out.append(Example(prompt=format_prompt(q, template), reference=solution, kind="gsm8k", question=q,
                           target=" " + solution))
    return out


_STEP_RE = re.compile(r"^\s*(-?\d+)\s*([-+*x/])\s*(-?\d+)\s*=\s*(-?\d+)\s*$")


def check_arith_steps(solution: str) -> bool:
    """True when every 'a op b = c' line of a solution is arithmetically correct and a '####' answer follows
    that equals the last step's result (lines that are not equations are ignored)."""
    last = None
    for line in solution.splitlines():
        m = _STEP_RE.match(line)
        if not m:
            continue
        a, op, b, c = int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))
        got = {"+": a + b, "-": a - b, "*": a * b, "x": a * b, "/": a / b if b else None}[op]
        if got != c:
            return False
        last = c
    m = re.search(r"####\s*(-?\d+)\s*$", solution.strip())
    return m is not None and last is not None and int(m.group(1)) == last


DATASET_KINDS = ("gsm8k", "math", "synthetic")


def load_dataset(spec: str, *, seed: int = 0, num_examples: int = 2000, template: str | None = None,
                 chat_template: ChatTemplate | Any | None = None, **task_kwargs: Any) -> list[Example]:
    """Examples for a --dataset spec: 'gsm8k:PATH', 'math:PATH', 'synthetic:add' or 'synthetic:arith'.

    Synthetic tasks take num_examples, seed and their own keyword arguments (digits=..., steps=...).
    """
    kind, sep, arg = spec.partition(":")
    if not sep or not arg:
        raise ValueError(f"--dataset must be gsm8k:PATH, math:PATH, synthetic:add or synthetic:arith; got {spec!r}")
    if kind == "gsm8k":
        return load_gsm8k(arg, template or "gsm8k", chat_template)
    if kind == "math":
        return load_math_jsonl(arg, template or "math", chat_template)
    if kind == "synthetic":
        if arg == "add":
            return make_addition_examples(num_examples, seed=seed, **task_kwargs)
        if arg == "arith":
            return make_arith_examples(num_examples, seed=seed, template=template or "gsm8k", **task_kwargs)
        raise ValueError(f"unknown synthetic task {arg!r}; valid: add, arith")
    raise ValueError(f"unknown dataset kind {kind!r} in {spec!r}; valid: {', '.join(DATASET_KINDS)}")


# ----------------------------------------------------------------------------------------------- sampling + splits

class PromptSampler:
    """Deterministic epoch-wise sampler over range(num_examples) with an explicit, restorable (epoch, index).

    Epoch e visits the permutation numpy.random.default_rng([seed, e]).permutation(n) (identity when
    shuffle=False); a batch may span an epoch boundary. state_dict() after k batches + load_state_dict() on a
    fresh sampler gives exactly the batches an uninterrupted sampler would give next.
    """

    def __init__(self, num_examples: int, seed: int = 0, shuffle: bool = True) -> None:
        if num_examples < 1:
            raise ValueError(f"num_examples must be >= 1, got {num_examples}")
        self.num_examples, self.seed, self.shuffle = int(num_examples), int(seed), bool(shuffle)
        self.epoch, self.index = 0, 0
        self._perm_epoch, self._perm = -1, None

    def _order(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            if self.shuffle:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)
            else:
                self._perm = np.arange(self.num_examples)
            self._perm_epoch = epoch
        return self._perm

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, index within the epoch) of the next example."""
        return self.epoch, self.index

    def next_indices(self, k: int) -> list[int]:
        """The next k example indices, advancing the position."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        out: list[int] = []
        while len(out) < k:
            order = self._order(self.epoch)
            take = min(k - len(out), self.num_examples - self.index)
            out.extend(int(i) for i in order[self.index:self.index + take])
            self.index += take
            if self.index == self.num_examples:
                self.epoch, self.index = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict[str, int | bool]:
        """Plain ints/bools (safe for weights_only checkpoints)."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "num_examples": self.num_examples,
                "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        """Restore a position; the dataset size, seed and shuffle must match the saved ones."""
        for key in ("seed", "num_examples", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]!r} but this sampler has "
                                 f"{key}={getattr(self, key)!r}; resume with the same dataset and seed")
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index < self.num_examples:
            raise ValueError(f"invalid sampler position (epoch={epoch}, index={index}) for {self.num_examples}")
        self.epoch, self.index = epoch, index


def split_heldout(examples: Sequence[Example], heldout: int | float, seed: int = 0
                  ) -> tuple[list[Example], list[Example]]:
    """(train, heldout): a deterministic random split; heldout is a count or a fraction in (0, 1)."""
    n = len(examples)
    k = int(round(heldout * n)) if isinstance(heldout, float) else int(heldout)
    if isinstance(heldout, float) and not 0.0 < heldout < 1.0:
        raise ValueError(f"heldout fraction must be in (0, 1), got {heldout}")
    if not 0 < k < n:
        raise ValueError(f"heldout={heldout!r} leaves {k} of {n} examples held out; need 0 < k < {n}")
    perm = np.random.default_rng([seed, 0x5EED]).permutation(n)
    held = set(int(i) for i in perm[:k])
    return ([e for i, e in enumerate(examples) if i not in held], [e for i, e in enumerate(examples) if i in held])

