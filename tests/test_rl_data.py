"""Tests for megatron_fp4.rl.data: jsonl errors, templates, the resumable sampler, splits, synthetic tasks."""

import json

import pytest

from megatron_fp4.rl.data import (TEMPLATES, PromptSampler, check_arith_steps, format_prompt, load_dataset,
                                  load_gsm8k, load_jsonl, load_math_jsonl, make_addition_examples,
                                  make_arith_examples, split_heldout)
from megatron_fp4.rl.rewards import score
from data_helpers import gsm8k_file


def test_load_jsonl_errors_name_file_and_line(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_jsonl(missing)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "#### 1"}\n\n{"question": "q2", "answer": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: invalid JSON"):
        load_jsonl(bad)
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"question": "q", "answer": "#### 1"}\n{"question": "q"}\n')
    with pytest.raises(ValueError, match=r"nofield\.jsonl:2: missing field\(s\) \['answer'\]"):
        load_jsonl(nofield)
    notobj = tmp_path / "list.jsonl"
    notobj.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"list\.jsonl:1: expected a JSON object"):
        load_jsonl(notobj)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no records"):
        load_jsonl(empty)


def test_gsm8k_loading_and_template():
    path = gsm8k_file("test")
    ex = load_gsm8k(path)
    assert len(ex) == 1319
    assert ex[0].prompt.startswith("Question: Janet") and ex[0].prompt.endswith("\nAnswer: Let's think step by step.")
    assert ex[0].kind == "gsm8k" and ex[0].reference.endswith("#### 18")
    assert all(score(e.target, e.reference, e.kind) == 1.0 for e in ex)
    assert "<<" not in ex[0].target and ex[0].target.startswith(" Janet sells 16 - 3 - 4 = 9 duck eggs")
    assert len(load_dataset(f"gsm8k:{path}")) == 1319


def test_math_jsonl_and_templates(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text(json.dumps({"problem": "What is 1/2 + 1/4?", "answer": "\\frac{3}{4}"}) + "\n"
                 + json.dumps({"question": "2+2?", "solution": "so \\boxed{4}"}) + "\n")
    ex = load_math_jsonl(p)
    assert ex[0].kind == "math" and "\\boxed{}" in ex[0].prompt and ex[0].prompt.startswith("Problem: What is")
    assert score("\\boxed{0.75}", ex[0].reference, "math") == 1.0
    assert score("\\boxed{4}", ex[1].reference, "math") == 1.0
    assert format_prompt("  hi ", "plain") == "hi"
    assert format_prompt("x", "Q: {question}\nA:") == "Q: x\nA:"
    assert set(TEMPLATES) >= {"gsm8k", "math", "plain"}
    with pytest.raises(ValueError, match="template"):
        format_prompt("x", "no placeholder")


def test_chat_template_hook():
    class FakeTokenizer:  # the transformers tokenizer interface: apply_chat_template(messages, ...)
        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert tokenize is False and add_generation_prompt is True
            return "".join(f"<|{m['role']}|>{m['content']}" for m in messages) + "<|assistant|>"

    assert format_prompt("2+2?", "plain", FakeTokenizer()) == "<|user|>2+2?<|assistant|>"
    assert format_prompt("2+2?", "plain", lambda t: f"[INST]{t}[/INST]") == "[INST]2+2?[/INST]"
    with pytest.raises(TypeError):
        format_prompt("x", "plain", 42)


def test_sampler_is_deterministic_and_resumes_exactly():
    a = PromptSampler(10, seed=3)
    first = [a.next_indices(4) for _ in range(2)]
    state = a.state_dict()
    assert a.position == (0, 8)
    rest = [a.next_indices(4) for _ in range(5)]  # crosses epoch boundaries
    # one epoch visits every index exactly once
    assert sorted(first[0] + first[1] + rest[0][:2]) == list(range(10))
    b = PromptSampler(10, seed=3)
    b.load_state_dict(state)
    assert [b.next_indices(4) for _ in range(5)] == rest
    c = PromptSampler(10, seed=3)
    assert [c.next_indices(4) for _ in range(7)] == first + rest
    assert PromptSampler(10, seed=4).next_indices(10) != PromptSampler(10, seed=3).next_indices(10)
    assert PromptSampler(5, shuffle=False).next_indices(7) == [0, 1, 2, 3, 4, 0, 1]
    with pytest.raises(ValueError, match="seed"):
        PromptSampler(10, seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="num_examples"):
        PromptSampler(11, seed=3).load_state_dict(state)
    assert all(isinstance(v, (int, bool)) for v in state.values())


def test_split_heldout_is_deterministic_and_disjoint():
    ex = make_addition_examples(200, digits=3, seed=0)
    tr, ho = split_heldout(ex, 0.1, seed=1)
    assert len(ho) == 20 and len(tr) == 180
    assert not {e.prompt for e in tr} & {e.prompt for e in ho}
    assert split_heldout(ex, 0.1, seed=1) == (tr, ho)
    assert split_heldout(ex, 0.1, seed=2)[1] != ho
    assert len(split_heldout(ex, 7)[1]) == 7
    with pytest.raises(ValueError, match="heldout"):
        split_heldout(ex, 0)
    with pytest.raises(ValueError, match="heldout"):
        split_heldout(ex, 1.5)


def test_synthetic_addition():
    ex = make_addition_examples(500, digits=(2, 4), seed=7)
    assert len({e.prompt for e in ex}) == 500
    for e in ex:
        a, b = e.prompt[:-1].split("+")
        assert 2 <= len(a) <= 4 and 2 <= len(b) <= 4 and e.prompt.endswith("=")
        assert e.reference == str(int(a) + int(b)) == e.target and e.kind == "math_rule"
        assert score(e.target, e.reference, e.kind) == 1.0
        assert score(str(int(e.reference) + 1), e.reference, e.kind) == 0.0
    assert make_addition_examples(50, digits=3, seed=7) == make_addition_examples(50, digits=3, seed=7)
    assert len(make_addition_examples(5, digits=2, num_operands=3)[0].prompt.split("+")) == 3
    with pytest.raises(ValueError, match="digits"):
        make_addition_examples(5, digits=0)
    with pytest.raises(ValueError, match="too many"):
        make_addition_examples(100, digits=1)
    assert load_dataset("synthetic:add", num_examples=20, seed=7, digits=3) == make_addition_examples(20, 3, 7)


def test_synthetic_arith_and_checker():
    ex = make_arith_examples(200, steps=(2, 4), seed=0)
    assert len({e.question for e in ex}) == 200
    for e in ex:
        assert e.kind == "gsm8k" and e.prompt.startswith("Question: ") and e.question.endswith("have now?")
        assert check_arith_steps(e.target)
        assert score(e.target, e.reference, e.kind) == 1.0
    assert check_arith_steps("3 + 4 = 7\n7 * 2 = 14\n#### 14")
    assert not check_arith_steps("3 + 4 = 8\n8 * 2 = 16\n#### 16")  # a wrong step
    assert not check_arith_steps("3 + 4 = 7\n#### 8")  # final answer differs from the last step
    assert not check_arith_steps("no equations\n#### 8")
    assert load_dataset("synthetic:arith", num_examples=10, seed=0)[0] == make_arith_examples(10, seed=0)[0]


def test_load_dataset_spec_errors():
    with pytest.raises(ValueError, match="gsm8k:PATH"):
        load_dataset("gsm8k")
    with pytest.raises(ValueError, match="valid: gsm8k, math, synthetic"):
        load_dataset("hf:foo")
    with pytest.raises(ValueError, match="valid: add, arith"):
        load_dataset("synthetic:mul")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_dataset("gsm8k:/nonexistent/missing.jsonl")


# ---------------------------------------------------------------- slime-style prompt files (datasets library)


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl", ".json"])
def test_prompt_data_files_with_custom_keys(tmp_path, suffix):
    pytest.importorskip("datasets")
    from rl_helpers import addition_rows, write_records

    from megatron_fp4.rl.data import load_prompt_data

    rows = addition_rows(5, input_key="problem_text", label_key="gold")
    for r in rows:  # number labels: the reference is their text, the label stays as stored
        r["gold"] = int(r["gold"])
    path = write_records(tmp_path / f"p{suffix}", rows)
    ex = load_prompt_data(path, input_key="problem_text", label_key="gold")
    assert [e.prompt for e in ex] == [r["problem_text"] for r in rows]  # raw text without a chat template
    assert [e.reference for e in ex] == [str(r["gold"]) for r in rows] and ex[0].label == rows[0]["gold"]
    assert ex[1].kind == "math" and ex[1].metadata == rows[1]["metadata"] and ex[1].target == ""
    with pytest.raises(ValueError, match=r"record 1 has no 'answer' \(--label-key\)"):
        load_prompt_data(path, input_key="problem_text", label_key="answer")
    with pytest.raises(ValueError, match=r"record 1 has no 'input' \(--input-key\); keys: \['gold', 'metadata', "
                                         r"'problem_text'\]"):
        load_prompt_data(path)
    assert load_prompt_data(path, "problem_text", "answer", require_label=False)[0].reference == ""


def test_chat_template_from_a_tiny_tokenizer(tmp_path):
    pytest.importorskip("datasets")
    from rl_helpers import make_chat_tokenizer, write_records

    from megatron_fp4.rl.data import load_prompt_data
    from megatron_fp4.rl.tokenizer import HFTokenizer

    make_chat_tokenizer(tmp_path / "tok")
    tok = HFTokenizer(str(tmp_path / "tok"))
    text = write_records(tmp_path / "p.parquet", [{"input": "What is 1 + 2 ?", "label": "3"}])
    path = write_records(tmp_path / "m.jsonl", [  # slime's other form: the prompt as OpenAI-style messages
        {"input": [{"role": "system", "content": "the answer is"}, {"role": "user", "content": "What is 3 + 4 ?"}],
         "label": "7"}])
    ex = load_prompt_data(text, chat_template=tok) + load_prompt_data(path, chat_template=tok)
    assert ex[0].prompt == "<|im_start|>user\nWhat is 1 + 2 ?<|im_end|>\n<|im_start|>assistant\n"
    assert ex[1].prompt == ("<|im_start|>system\nthe answer is<|im_end|>\n<|im_start|>user\nWhat is 3 + 4 ?<|im_end|>\n"
                            "<|im_start|>assistant\n")
    assert tok.encode(ex[0].prompt)[0] == tok.tok.convert_tokens_to_ids("<|im_start|>")  # a special token, one id
    # the --dataset loaders take the same template; a message list needs one
    gsm = tmp_path / "g.jsonl"
    gsm.write_text(json.dumps({"question": "What is 1 + 2 ?", "answer": "#### 3"}) + "\n")
    assert load_dataset(f"gsm8k:{gsm}", chat_template=tok)[0].prompt.startswith("<|im_start|>user\nQuestion: What")
    with pytest.raises(ValueError, match="record 1: a prompt given as chat messages needs a chat template"):
        load_prompt_data(path)
    make_chat_tokenizer(tmp_path / "plain", chat_template=None)
    with pytest.raises(ValueError, match="has no chat template"):
        load_prompt_data(text, chat_template=HFTokenizer(str(tmp_path / "plain")))
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        (tmp_path / "p.csv").write_text("a,b\n")
        load_prompt_data(tmp_path / "p.csv")


def test_prompt_jsonl_without_the_datasets_library(tmp_path, monkeypatch):
    """JSON lines read the same without ``datasets`` (a GPU image that lacks it); other formats still need it."""
    from megatron_fp4.rl.data import read_records

    rows = [{"prompt": [{"role": "user", "content": "1 + 2?"}], "label": "3"}, {"prompt": "x", "label": 4}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)  # import datasets -> ImportError
    assert read_records(path) == rows
    (tmp_path / "p.parquet").write_bytes(b"")
    with pytest.raises(ImportError, match="needs the datasets library"):
        read_records(tmp_path / "p.parquet")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no records"):
        read_records(tmp_path / "empty.jsonl")
