"""Report of the mini precision table (examples/mini_table/run_mini_table.py): reads every run's results.json and
train.jsonl under --runs and writes a markdown report with the accuracy table (mean +- std over seeds and its 95%
interval, HiF4 and MXFP4 columns as in SPEC §1), reward curves and per-layer rollout underflow plots (PNG), the
train-rollout logprob mismatch per configuration, every run's own numbers, and a comparison with the paper's
findings computed from the numbers. The same for the table on SmolLM2-135M-Instruct (run_mini_table.py --preset
smollm2).

    python tools/plot_runs.py --runs runs/mini_table --out docs/results/mini_table.md
    python tools/plot_runs.py --runs runs/real_table --out docs/results/real_table.md
"""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "mini_table"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import run_cli, tool_parser  # noqa: E402
from run_mini_table import ROWS, accuracy_of, micro_batching  # noqa: E402  (the rows and their labels: one source of truth)

PROG = "plot_runs.py"

FORMATS = ("hif4", "mxfp4")
NAMES = {"hif4": "HiF4", "mxfp4": "MXFP4"}
# SPEC §1 (Qwen2.5-3B, GSM8K mean@1): row id -> (HiF4, MXFP4)
PAPER = {"bf16_bf16": (86.96, 86.96), "fp4_bf16": (86.88, 86.20), "fp4_w4a16": (85.22, 81.57),
         "fp4_w16a4": (84.30, 77.71), "fp4_fp4": (82.03, 73.31), "bf16_fp4": (78.01, 50.57),
         "fp4_fp4_resq_2of4": (85.90, 81.65)}


# ---------------------------------------------------------------------------------------------------- loading
def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_log_row(r, where: str) -> None:
    """A train.jsonl row has the fields the report reads, with their types (ValueError naming the line)."""
    if not isinstance(r, dict):
        raise ValueError(f"{where}: expected a JSON object, found {type(r).__name__}")
    if "kind" in r and not isinstance(r["kind"], str):
        raise ValueError(f"{where}: kind={r['kind']!r} is not a string")
    if "step" in r and (not isinstance(r["step"], int) or isinstance(r["step"], bool)):
        raise ValueError(f"{where}: step={r['step']!r} is not an integer")
    for k, v in r.items():
        numeric = k in ("reward_mean", "logp_abs_diff_mean") or (
            r.get("kind") == "underflow" and k.endswith(("/fp4", "/resq")))
        if numeric and not _number(v):
            raise ValueError(f"{where}: {k}={v!r} is not a number")
    if r.get("kind") == "underflow" and not isinstance(r.get("sparsity", ""), str):
        raise ValueError(f"{where}: sparsity={r['sparsity']!r} is not a string")


def read_jsonl(path: str) -> list[dict]:
    """Rows of a jsonl file; a resumed run's repeated (kind, step) rows keep the last one. A line that is not a
    JSON object with the fields the report reads is a ValueError naming the file and line."""
    if not os.path.isfile(path):
        return []
    rows: dict[tuple, dict] = {}
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            lines = f.readlines()
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text ({e})") from None
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                r = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{number}: not valid JSON ({e})") from None
            _check_log_row(r, f"{path}:{number}")
            rows[(r.get("kind"), r.get("step"))] = r
    return sorted(rows.values(), key=lambda r: (r.get("step", 0), str(r.get("kind"))))


def _check_record(rec, path: str) -> None:
    """A results.json of a table run has the fields the report reads, with their types (ValueError naming the
    file and the field)."""
    if not isinstance(rec, dict):
        raise ValueError(f"{path}: expected a JSON object, found {type(rec).__name__}")
    rows = {row.id for row in ROWS}
    if not isinstance(rec["row"], str) or rec["row"] not in rows:
        raise ValueError(f"{path}: row={rec['row']!r} is not a row of the table; allowed values: "
                         f"{', '.join(sorted(rows))}")
    if not isinstance(rec.get("format"), str) or rec.get("format") not in FORMATS + ("bf16",):
        raise ValueError(f"{path}: format={rec.get('format')!r} is not valid; allowed values: "
                         f"{', '.join(FORMATS + ('bf16',))}")
    if not isinstance(rec.get("seed"), int) or isinstance(rec.get("seed"), bool):
        raise ValueError(f"{path}: seed={rec.get('seed')!r} is not an integer")
    for key in ("final", "warm_start"):
        v = rec.get(key, {})
        if not isinstance(v, dict) or any(not _number(x) for k, x in v.items()
                                          if k == "accuracy" or k.endswith("/accuracy")):
            raise ValueError(f"{path}: {key}={v!r} is not valid; expected an object with a numeric accuracy")
    command = rec.get("command", "")
    if not isinstance(command, str):
        raise ValueError(f"{path}: command={command!r} is not a string")
    try:
        samples = flag_value(command, "--eval-samples", 256)
        shlex.split(command)
    except ValueError as e:
        raise ValueError(f"{path}: command cannot be parsed ({e})") from None
    if not str(samples).isdigit():
        raise ValueError(f"{path}: command has --eval-samples {samples!r}, not an integer")


def load_runs(runs_dir: str) -> list[dict]:
    """Every finished run (results.json present) with its jsonl rows under key 'log'."""
    if not os.path.isdir(runs_dir):
        raise FileNotFoundError(f"--runs {runs_dir}: no such directory")
    out = []
    for dirpath, _, files in sorted(os.walk(runs_dir)):
        if "results.json" not in files or os.path.basename(dirpath) == "warm":
            continue
        path = os.path.join(dirpath, "results.json")
        try:
            with open(path, encoding="utf-8") as f:
                rec = json.load(f)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(rec, dict) or "row" not in rec:
            continue
        _check_record(rec, path)
        rec["log"] = read_jsonl(os.path.join(dirpath, "train.jsonl"))
        rec["dir"] = dirpath
        out.append(rec)
    return out


def flag_value(command: str, flag: str, default=None):
    parts = shlex.split(command or "")
    return parts[parts.index(flag) + 1] if flag in parts[:-1] else default


def micro_batches(command: str) -> str:
    """How a run's update and log-prob passes were cut (:func:`run_mini_table.micro_batching` decides which kind):
    packs of up to N tokens or micro-batches of sequences."""
    parts = shlex.split(command or "")
    kind = micro_batching(parts)
    if kind != "sequences":  # "tokens N"
        return f"packs of up to {kind.split()[1]} tokens"
    how = "packed" if "--pack-sequences" in parts else "padded"
    return f"{flag_value(command, '--micro-batch-size', '1')} sequences {how} per micro-batch"


def micro_batches_line(runs: list[dict], runs_dir: str) -> list[str]:
    """A line saying which runs (under ``runs_dir``) took which micro-batches, where they differ (none where all are
    alike)."""
    kinds: dict[str, list[str]] = {}
    for r in runs:
        kinds.setdefault(micro_batches(r.get("command", "")), []).append(os.path.relpath(r["dir"], runs_dir))
    if len(kinds) < 2:
        return []
    which = "; ".join(f"{k}: {', '.join(sorted(v))}" for k, v in sorted(kinds.items()))
    return [f"Micro-batches differ between runs (packs give BF16 training the same loss and gradients; FP4 training's "
            f"wgrad quantizes blocks along the tokens, which packs group differently): {which}.", ""]


# ---------------------------------------------------------------------------------------------------- statistics
def mean_std(xs: list[float]) -> tuple[float, float, int]:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return float("nan"), float("nan"), 0
    m = sum(xs) / len(xs)
    s = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else float("nan")
    return m, s, len(xs)


def fmt_ms(m: float, s: float, n: int, scale: float = 100.0, digits: int = 1) -> str:
    if n == 0:
        return "-"
    if n == 1 or math.isnan(s):
        return f"{m * scale:.{digits}f} (n=1)"
    return f"{m * scale:.{digits}f} ± {s * scale:.{digits}f} (n={n})"


# two-sided 95% quantiles of Student's t by degrees of freedom (30 and more: 2.042 down to the normal's 1.96)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def t975(df: int) -> float:
    return T975[max(k for k in T975 if k <= df)] if df < 30 else 2.042 if df < 60 else 1.96


def wilson95(p: float, n: int) -> tuple[float, float]:
    """The 95% Wilson interval of a proportion ``p`` measured on ``n`` trials."""
    z = 1.96
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def ci95(xs: list[float], n_eval: int | None = None,
         bounds: tuple[float, float] = (-math.inf, math.inf)) -> tuple[float, float, float, int]:
    """(mean, low, high, k) over the k finite values: Student's t 95% interval of the mean over seeds for k >= 2,
    clipped to ``bounds``, the values' possible range (an accuracy's is (0, 1)); for one seed, the Wilson interval
    of its held-out accuracy over ``n_eval`` problems when given (else NaNs)."""
    m, s, k = mean_std(xs)
    if k >= 2:
        half = t975(k - 1) * s / math.sqrt(k)
        return m, max(bounds[0], m - half), min(bounds[1], m + half), k
    if k == 1 and n_eval:
        return (m, *wilson95(m, n_eval), 1)
    return m, float("nan"), float("nan"), k


def fmt_ci(xs: list[float], n_eval: int | None = None, scale: float = 100.0, digits: int = 1,
           bounds: tuple[float, float] = (-math.inf, math.inf)) -> str:
    """'mean ± std [95% interval] (n=k)' of a table cell."""
    m, lo, hi, k = ci95(xs, n_eval, bounds)
    if k == 0:
        return "-"
    s = mean_std(xs)[1]
    spread = "" if math.isnan(s) else f" ± {s * scale:.{digits}f}"
    interval = "" if math.isnan(lo) else f" [{lo * scale:.{digits}f}, {hi * scale:.{digits}f}]"
    return f"{m * scale:.{digits}f}{spread}{interval} (n={k})"


def cell(runs: list[dict], row_id: str, fmt: str) -> list[dict]:
    """The runs of one table cell (the format-free BF16/BF16 row fills both columns)."""
    return [r for r in runs if r["row"] == row_id and (r["format"] == fmt or r["format"] == "bf16")]


def final_acc(r: dict) -> float:
    """The run's final held-out accuracy in its rollout precision (``accuracy``, or ``SET/accuracy`` of a run with
    --eval-prompt-data SET FILE)."""
    return accuracy_of(r.get("final", {}))


def mean_mismatch(r: dict) -> float:
    vals = [x["logp_abs_diff_mean"] for x in r["log"] if x.get("kind") == "train" and "logp_abs_diff_mean" in x]
    return sum(vals) / len(vals) if vals else float("nan")


def runs_table(runs: list[dict], runs_dir: str) -> list[str]:
    """One line per finished run, in the table's row order: what the cells above average over, with what explains
    a run (its answers truncated at the length limit, steps whose update was skipped because no answer counted,
    wall time, micro-batches)."""
    lines = ["## Every run", "",
             "Held-out accuracy in % at the start and after GRPO, in the run's rollout precision (after GRPO also in "
             "BF16); mean train-rollout mismatch and truncated share of the answers over the steps; steps whose "
             "update was skipped (no answer counted, e.g. all truncated under the overlong filter); wall time of "
             "the run summed over its calls.", "",
             "| run | training / rollout | start | after GRPO (BF16) | mismatch | truncated | skipped steps | "
             "wall s | micro-batches |",
             "|---|---|---|---|---|---|---|---|---|"]
    order = {row.id: i for i, row in enumerate(ROWS)}
    row_of = {row.id: row for row in ROWS}

    def pct(x: float) -> str:
        return "-" if x != x else f"{x * 100:.1f}"

    for r in sorted(runs, key=lambda r: (order[r["row"]], r["format"], r["seed"])):
        train = [x for x in r["log"] if x.get("kind") == "train"]
        trunc = [x["truncated_ratio"] for x in train if _number(x.get("truncated_ratio"))]
        row = row_of[r["row"]]
        bf16 = accuracy_of(r.get("final", {}), "accuracy_bf16")
        after = pct(final_acc(r)) + ("" if bf16 != bf16 else f" ({pct(bf16)})")
        mm = mean_mismatch(r)
        lines.append(f"| {os.path.relpath(r['dir'], runs_dir)} | {row.training} / {row.rollout} | "
                     f"{pct(accuracy_of(r.get('warm_start', {})))} | {after} | {'-' if mm != mm else f'{mm:.3f}'} | "
                     f"{pct(sum(trunc) / len(trunc)) + '%' if trunc else '-'} | "
                     f"{sum(1 for x in train if x.get('skipped'))} | {r.get('seconds', float('nan')):.0f} | "
                     f"{micro_batches(r.get('command', ''))} |")
    return lines + [""]


# ---------------------------------------------------------------------------------------------------- plots
def plot_rewards(runs: list[dict], path: str, smooth: int = 5) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(FORMATS), figsize=(7 * len(FORMATS), 4.5), sharey=True)
    for ax, fmt in zip(axes, FORMATS):
        for row in ROWS:
            rs = cell(runs, row.id, fmt)
            if not rs:
                continue
            per_step: dict[int, list[float]] = defaultdict(list)
            for r in rs:
                for x in r["log"]:
                    if x.get("kind") == "train" and "reward_mean" in x:
                        per_step[x["step"]].append(x["reward_mean"])
            steps = sorted(per_step)
            ys = [sum(per_step[s]) / len(per_step[s]) for s in steps]
            ys = [sum(ys[max(0, i - smooth + 1):i + 1]) / len(ys[max(0, i - smooth + 1):i + 1]) for i in range(len(ys))]
            ax.plot(steps, ys, label=f"{row.training} / {row.rollout}")
        ax.set_title(f"{NAMES[fmt]}: reward (mean over seeds, moving average {smooth})")
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("reward mean")
    labelled = [ax for ax in axes if ax.get_legend_handles_labels()[0]]
    if labelled:
        labelled[-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def underflow_by_layer(runs: list[dict], row_id: str, fmt: str, which: str) -> tuple[dict, dict, str]:
    """Layer -> mean rate (over seeds) of the first and of the last underflow row of the cell's runs."""
    first: dict[str, list[float]] = defaultdict(list)
    last: dict[str, list[float]] = defaultdict(list)
    sparsity = ""
    for r in cell(runs, row_id, fmt):
        rows = [x for x in r["log"] if x.get("kind") == "underflow"]
        if not rows:
            continue
        sparsity = rows[-1].get("sparsity", "")
        for target, x in ((first, rows[0]), (last, rows[-1])):
            for k, v in x.items():
                if k.endswith("/" + which):
                    target[k[: -len(which) - 1]].append(v)
    avg = lambda d: {k: sum(v) / len(v) for k, v in d.items()}  # noqa: E731
    return avg(first), avg(last), sparsity


def short_layer(name: str) -> str:
    return name.replace("decoder.layers.", "L").replace(".self_attention.", ".").replace(".mlp.", ".")


def plot_underflow(runs: list[dict], path: str, row_id: str = "fp4_fp4") -> bool:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(FORMATS), 1, figsize=(12, 4 * len(FORMATS)))
    drew = False
    for ax, fmt in zip(axes, FORMATS):
        _, fp4, sp = underflow_by_layer(runs, row_id, fmt, "fp4")
        _, resq, _ = underflow_by_layer(runs, row_id, fmt, "resq")
        if not fp4:
            ax.set_visible(False)
            continue
        drew = True
        names = sorted(fp4, key=lambda n: [int(t) if t.isdigit() else t for t in n.replace(".", " ").split()])
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [fp4[n] * 100 for n in names], width=0.4, label=f"{NAMES[fmt]} W4A4")
        ax.bar([x + 0.2 for x in xs], [resq.get(n, float("nan")) * 100 for n in names], width=0.4,
               label=f"+ ResQ {sp}")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([short_layer(n) for n in names], rotation=70, fontsize=7)
        ax.set_ylabel("nonzero inputs -> 0 (%)")
        ax.set_title(f"{NAMES[fmt]}: per-layer rollout activation underflow at the end of the FP4/FP4 run")
        ax.legend()
        ax.grid(axis="y", alpha=0.3)
    if drew:
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return drew


# ---------------------------------------------------------------------------------------------------- findings
def _acc_stats(runs, row_id, fmt):
    return mean_std([final_acc(r) for r in cell(runs, row_id, fmt)])


def by_seed(runs: list[dict], row_id: str, fmt: str) -> dict[int, float]:
    return {r["seed"]: final_acc(r) for r in cell(runs, row_id, fmt)}


def compare(a: dict[int, float], b: dict[int, float], se_run: float) -> tuple[float, float, bool]:
    """(mean over seeds of a - b, its noise scale, whether the difference exceeds twice the noise). Paired by
    seed (both rows start from that seed's warm start); noise: the larger of the paired standard error over
    seeds and the binomial standard error of a difference of two held-out accuracies averaged over the seeds."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return float("nan"), float("nan"), False
    diffs = [a[s] - b[s] for s in seeds]
    d = sum(diffs) / len(diffs)
    paired = (math.sqrt(sum((x - d) ** 2 for x in diffs) / (len(diffs) - 1) / len(diffs))
              if len(diffs) > 1 else 0.0)
    noise = max(paired, se_run * math.sqrt(2 / len(seeds)))
    return d, noise, abs(d) > 2 * noise


def verdict(holds: bool, significant: bool) -> str:
    if not significant:
        return "**inconclusive** (difference within 2x noise)"
    return "**agrees**" if holds else "**disagrees**"


def findings(runs: list[dict], n_eval: int) -> list[str]:
    out = []
    for fmt in FORMATS:
        s = {row.id: _acc_stats(runs, row.id, fmt) for row in ROWS}
        b = {row.id: by_seed(runs, row.id, fmt) for row in ROWS}
        F = NAMES[fmt]

        def have(*ids):
            return all(s[i][2] > 0 for i in ids)

        # the table's reference without rollout quantization: FP4/BF16 (the same FP4 training, BF16 rollout); a
        # table without that row (the real-model table) has BF16/BF16, which has no FP4 training either
        ref = "fp4_bf16" if have("fp4_bf16") else "bf16_bf16"
        p = s[ref][0]  # a held-out accuracy's binomial standard error, at the reference's accuracy
        se = math.sqrt(max(p, 0.01) * max(1 - p, 0.01) / max(n_eval, 1)) if not math.isnan(p) else 0.05

        def pts(x):
            return f"{x * 100:+.1f}"

        out.append(f"#### {F}")
        if have("fp4_w4a16", "fp4_w16a4", "fp4_bf16"):
            d, n, sig = compare(b["fp4_w4a16"], b["fp4_w16a4"], se)
            out.append(f"- (a) Rollout activation quantization hurts more than weight quantization: W4A16 - W16A4 = "
                       f"{pts(d)} points (noise {n * 100:.1f}); FP4/BF16 -> W4A16 "
                       f"{pts(s['fp4_w4a16'][0] - s['fp4_bf16'][0])}, FP4/BF16 -> W16A4 "
                       f"{pts(s['fp4_w16a4'][0] - s['fp4_bf16'][0])}. Paper: W16A4 below W4A16. "
                       f"{verdict(d > 0, sig)}.")
        if have("fp4_fp4", "bf16_fp4"):
            d, n, sig = compare(b["fp4_fp4"], b["bf16_fp4"], se)
            mm = {rid: mean_std([mean_mismatch(r) for r in cell(runs, rid, fmt)])[0] for rid in ("fp4_fp4", "bf16_fp4")}
            out.append(f"- (b) BF16 training + FP4 rollout is worse than full FP4: FP4/FP4 - BF16/FP4 = {pts(d)} "
                       f"points (noise {n * 100:.1f}); mean |logp_train - logp_rollout| {mm['fp4_fp4']:.4f} (FP4/FP4) "
                       f"vs {mm['bf16_fp4']:.4f} (BF16/FP4). Paper: BF16/FP4 below FP4/FP4. {verdict(d > 0, sig)}.")
        if have("fp4_fp4", "fp4_fp4_resq_2of4", ref):
            seeds = set(b[ref]) & set(b["fp4_fp4"]) & set(b["fp4_fp4_resq_2of4"])  # all three paired by seed
            ref_acc, fp4, resq = ({k: b[r][k] for k in seeds} for r in (ref, "fp4_fp4", "fp4_fp4_resq_2of4"))
            gap, n, sig = compare(ref_acc, fp4, se)
            gain, n_gain, _ = compare(resq, fp4, se)
            R = next(row for row in ROWS if row.id == ref)
            name = f"{R.training}/{R.rollout}" + ("" if ref == "fp4_bf16" else
                                                  " (this table has no FP4/BF16 row; BF16/BF16 has no FP4 training "
                                                  "either)")
            on = f"seeds {sorted(seeds)}"
            if not sig or gap <= 0:
                out.append(f"- (c) ResQ 2:4 recovers most of the FP4 rollout gap: the gap {name} - FP4/FP4 is "
                           f"{pts(gap)} points (noise {n * 100:.1f}; {on}), so there is no measurable gap to recover "
                           f"here (ResQ 2:4 changes FP4/FP4 by {pts(gain)}). **inconclusive**.")
            else:
                frac = gain / gap
                i = FORMATS.index(fmt)
                paper = (PAPER["fp4_fp4_resq_2of4"][i] - PAPER["fp4_fp4"][i]) / (PAPER[ref][i] - PAPER["fp4_fp4"][i])
                # "most" = more than half the gap, judged with the noise of ResQ's own gain
                lo, hi = gain - 2 * n_gain, gain + 2 * n_gain
                judged = ("**agrees**" if lo > gap / 2 else "**disagrees**" if hi < gap / 2 else
                          f"**inconclusive** (half the gap, {pts(gap / 2)}, is within 2x the gain's noise, "
                          f"{n_gain * 100:.1f})")
                out.append(f"- (c) ResQ 2:4 recovers most of the FP4 rollout gap: gap {name} - FP4/FP4 "
                           f"{pts(gap)} points (noise {n * 100:.1f}; {on}), ResQ 2:4 recovers {pts(gain)} "
                           f"({frac * 100:.0f}% of it; paper, to the same row: {F} {paper * 100:.0f}%). {judged}.")
        others = [r for r in ("fp4_fp4_resq_channel", "fp4_fp4_resq_tile32x64", "fp4_fp4_resq_dense") if have(r)]
        if others and have("fp4_fp4"):
            parts = ", ".join(f"{r.split('_')[-1]} {pts(s[r][0] - s['fp4_fp4'][0])}" for r in others)
            out.append(f"- ResQ sparsities vs plain FP4/FP4 (points): {parts} (dense is the upper bound by design).")
    rows_both = [row.id for row in ROWS if not row.format_free and row.id != "fp4_bf16"
                 and all(_acc_stats(runs, row.id, f)[2] for f in FORMATS)]
    if rows_both:
        p = mean_std([final_acc(r) for r in runs])[0]
        se = math.sqrt(max(p, 0.01) * max(1 - p, 0.01) / max(n_eval, 1))
        wins, sig_wins, sig_losses = 0, 0, 0
        for rid in rows_both:
            d, n, sig = compare(by_seed(runs, rid, "hif4"), by_seed(runs, rid, "mxfp4"), se)
            wins += d > 0
            sig_wins += sig and d > 0
            sig_losses += sig and d < 0
        holds = wins > len(rows_both) / 2
        out.append("#### HiF4 vs MXFP4")
        out.append(f"- (d) HiF4 beats MXFP4: HiF4 is higher in {wins} of {len(rows_both)} FP4 rows "
                   f"({sig_wins} beyond 2x noise; MXFP4 higher beyond noise in {sig_losses}). Paper: HiF4 higher in "
                   f"every row. " + ("**agrees**" if holds and sig_wins > sig_losses else
                                     "**disagrees**" if sig_losses > sig_wins else
                                     "**inconclusive** (differences mostly within noise)") + ".")
    return out


# ---------------------------------------------------------------------------------------------------- report
def short_command(cmd: str) -> str:
    """A run's command without the machine's interpreter and checkout paths: ``python pretrain_rl.py ...``."""
    parts = shlex.split(cmd or "")
    if len(parts) > 1 and parts[1].endswith("pretrain_rl.py"):
        parts = ["python", "pretrain_rl.py", *parts[2:]]
    return shlex.join(parts)


def _read_notes(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().rstrip()
    except UnicodeDecodeError as e:
        raise ValueError(f"--notes {path}: not UTF-8 text ({e})") from None


def write_report(runs_dir: str, out_md: str, command: str, notes: str | None = None) -> str:
    runs = load_runs(runs_dir)
    if not runs:
        raise FileNotFoundError(f"--runs {runs_dir}: no finished runs (results.json) under it")
    out_dir = os.path.dirname(os.path.abspath(out_md))
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.splitext(os.path.basename(out_md))[0]
    ex = runs[0]
    n_eval = int(ex.get("n_eval") or flag_value(ex.get("command"), "--eval-samples", 256))
    seeds = sorted({r["seed"] for r in runs})
    real = ex.get("model")  # a pretrained model (run_mini_table.py --preset smollm2): no warm-up, its own task
    se50 = f"{100 * math.sqrt(0.25 / max(n_eval, 1)):.1f}"
    if real:
        title = f"# Precision table on {real} ({ex.get('preset', '?')} preset)"
        about = (f"Runs: {len(runs)} finished under `{runs_dir}`; seeds {seeds}; {ex.get('grpo_steps', '?')} GRPO "
                 f"steps per run, every run starting from the pretrained {real} (converted from its GGUF; no "
                 f"warm-up); task: the GSM8K-style chat problems of examples/smollm2/run_grpo.py (`--rm-type "
                 f"{flag_value(ex.get('command'), '--rm-type')}`), "
                 f"{flag_value(ex.get('command'), '--rollout-batch-size')} prompts x "
                 f"{flag_value(ex.get('command'), '--n-samples-per-prompt')} samples per step; held-out greedy "
                 f"accuracy on the same {n_eval} problems for every run (one run's binomial standard error at 50% is "
                 f"{se50} points). Example run command:")
        start = ("the start is the pretrained model, the same for every run, evaluated in each row's rollout "
                 "precision before GRPO")
    else:
        title = f"# Mini precision table ({ex.get('preset', '?')} preset)"
        about = (f"Runs: {len(runs)} finished under `{runs_dir}`; seeds {seeds}; {ex.get('grpo_steps', '?')} GRPO "
                 f"steps per run from one supervised warm start per seed; dataset "
                 f"`{flag_value(ex.get('command'), '--dataset')}`; held-out greedy accuracy on {n_eval} problems (one "
                 f"run's binomial standard error at 50% is {se50} points). Model: "
                 f"{flag_value(ex.get('command'), '--num-layers')} layers x "
                 f"{flag_value(ex.get('command'), '--hidden-size')} hidden, random init. Example run command:")
        start = ("the warm start is the same weights for every row of a seed, evaluated in that row's rollout "
                 "precision before GRPO")
    lines = [title, "", "Produced by:", "", "```bash", command, "```", "", about,
             "", "```bash", short_command(ex.get("command", "")), "```", "", *micro_batches_line(runs, runs_dir),
             *([_read_notes(notes), ""] if notes else []),
             "## Accuracy (held-out greedy accuracy in %, mean ± std over seeds [95% interval], after GRPO)", "",
             f"Evaluated greedily in each run's own rollout precision; {start}. The 95% interval is Student's t "
             f"interval of the mean over seeds, clipped to 0-100% (with one seed: the Wilson interval of that run's "
             f"accuracy on the {n_eval} held-out problems). Paper = SPEC §1 (Qwen2.5-3B, GSM8K mean@1).", "",
             f"| training | rollout | HiF4 | MXFP4 | {'start' if real else 'warm start'} HiF4 / MXFP4 | paper HiF4 | "
             f"paper MXFP4 |",
             "|---|---|---|---|---|---|---|"]
    ran = [row for row in ROWS if any(r["row"] == row.id for r in runs)]  # rows left out of the plan: no line
    for row in ran:
        cells = [fmt_ci([final_acc(r) for r in cell(runs, row.id, f)], n_eval, bounds=(0.0, 1.0)) for f in FORMATS]
        warm = [fmt_ms(*mean_std([accuracy_of(r.get("warm_start", {}))
                                  for r in cell(runs, row.id, f)])).split(" (n=")[0] for f in FORMATS]
        paper = PAPER.get(row.id, ("-", "-"))
        lines.append(f"| {row.training} | {row.rollout} | {cells[0]} | {cells[1]} | {warm[0]} / {warm[1]} | "
                     f"{paper[0]} | {paper[1]} |")
    lines += ["", "## Train-rollout logprob mismatch", "",
              "Mean over GRPO steps of the token-mean |logp_train - logp_rollout| (`logp_abs_diff_mean`), mean ± std "
              "over seeds [95% t interval]; and the mean reward over the last 20% of steps.", "",
              "| training | rollout | HiF4 mismatch | MXFP4 mismatch | HiF4 late reward | MXFP4 late reward |",
              "|---|---|---|---|---|---|"]
    for row in ran:
        mm = [fmt_ci([mean_mismatch(r) for r in cell(runs, row.id, f)], scale=1.0, digits=4, bounds=(0.0, math.inf))
              for f in FORMATS]
        late = []
        for f in FORMATS:
            vals = []
            for r in cell(runs, row.id, f):
                tr = [x["reward_mean"] for x in r["log"] if x.get("kind") == "train" and "reward_mean" in x]
                k = max(1, len(tr) // 5)
                vals.append(sum(tr[-k:]) / k if tr else float("nan"))
            late.append(fmt_ms(*mean_std(vals), scale=1.0, digits=3))
        lines.append(f"| {row.training} | {row.rollout} | {mm[0]} | {mm[1]} | {late[0]} | {late[1]} |")

    lines += ["", *runs_table(runs, runs_dir)]
    reward_png = f"{stem}_rewards.png"
    plot_rewards(runs, os.path.join(out_dir, reward_png))
    lines += ["## Reward curves", "", f"![reward curves]({reward_png})", ""]
    under_png = f"{stem}_underflow.png"
    if plot_underflow(runs, os.path.join(out_dir, under_png)):
        lines += ["## Per-layer rollout activation underflow", "",
                  "Fraction of nonzero rollout linear inputs that FP4 quantization turns into zero, without and with "
                  "the ResQ residual, measured on held-out prompts at the end of the FP4/FP4 run (mean over seeds).",
                  "", f"![underflow]({under_png})", "",
                  "| format | layer with the most underflow | W4A4 | + ResQ | mean over layers W4A4 | + ResQ |",
                  "|---|---|---|---|---|---|"]
        for f in FORMATS:
            _, fp4, sp = underflow_by_layer(runs, "fp4_fp4", f, "fp4")
            _, resq, _ = underflow_by_layer(runs, "fp4_fp4", f, "resq")
            if fp4:
                worst = max(fp4, key=fp4.get)
                lines.append(f"| {NAMES[f]} | {short_layer(worst)} | {fp4[worst] * 100:.1f}% | "
                             f"{resq.get(worst, float('nan')) * 100:.1f}% ({sp}) | "
                             f"{sum(fp4.values()) / len(fp4) * 100:.1f}% | "
                             f"{sum(resq.values()) / max(len(resq), 1) * 100:.1f}% |")
        lines.append("")
    lines += ["## Agreement with the paper's findings", "",
              "Generated from the numbers above. Differences are paired by seed (every row of a seed starts from the "
              "same warm start) and count only when they exceed twice their noise: the larger of the paired "
              "standard error over seeds and the binomial standard error of the held-out accuracies. (a), (b) and "
              "(d) are SPEC §1's lessons (a), (b) and (c); (c) is Rollout-ResQ's claim (SPEC §4). A finding is "
              "listed only where the table has its rows.", ""]
    lines += findings(runs, n_eval)
    lines.append("")
    text = "\n".join(lines)
    with open(out_md, "w") as f:
        f.write(text)
    return text


def main(argv=None) -> int:
    p = tool_parser(PROG, __doc__.split("\n")[0])
    p.add_argument("--runs", default="runs/mini_table", help="the --out directory of run_mini_table.py")
    p.add_argument("--out", default="docs/results/mini_table.md", help="markdown report (PNGs beside it)")
    p.add_argument("--notes", default=None, help="a markdown file inserted after the header (how the runs were made, "
                                                   "what to read into them)")
    a = p.parse_args(argv)
    if a.notes is not None and not os.path.isfile(a.notes):
        raise FileNotFoundError(f"--notes {a.notes}: no such file")
    _check_output_file("--out", a.out)
    command = "python tools/plot_runs.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    write_report(a.runs, a.out, command, a.notes)
    print(f"wrote {a.out}")
    return 0


def _check_output_file(flag: str, path: str) -> None:
    """``path`` can be written (not a directory; its folder exists or can be created), before any work."""
    p = os.path.abspath(path)
    if os.path.isdir(p):
        raise ValueError(f"{flag} {path}: is a directory; expected a file path")
    parent = os.path.dirname(p)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: cannot be written ({parent} is not a writable directory)")


if __name__ == "__main__":
    run_cli(main, PROG)
