"""Leaderboards: every evaluated target of a dataset side by side, next to the papers' figures.

The stage that writes them is :mod:`xmc_steps.stages.leaderboard` (its CLI flags are named below).

Per dataset (``--results``: the results files of :mod:`xmc_steps.stages.evaluate`, whichever exist) it
writes ``leaderboard.md`` and ``leaderboard.csv`` (one row per target: P@1/3/5, nDCG@1/3/5,
PSP@1/3/5, R@10/20/100, training time, end-to-end prediction ms/document, model size, device and
machine, each metric's gain over Parabel on the same data as X-Transformer's Table 6 gives it
(``(ours - parabel) / parabel``), and the paper's P@1/3/5 for the same dataset and target with its
source, its note (e.g. another split) and whether the run used the paper's settings) and three figures: ``leaderboard.png`` (P@1/3/5 bars), ``leaderboard_recall.png``
(recall@k for k = 1..100 of every target; targets evaluated before the curve was recorded show
their R@10/20/100 points) and ``leaderboard_deciles.png`` (each target's recall@100 split over the
label-frequency deciles, head first, ELIAS Fig. 5 right).  Rows are sorted by P@1, best first.
With ``--tables`` it writes the cross-dataset table (one block per dataset, the main columns).

The paper's settings (``--paper-config config.yaml config.paper.yaml``): a row with a paper figure is
marked ``paper settings: yes`` only when its results file's effective settings are those of the two
files merged for its dataset and method and config.paper.yaml has that method's section for the
dataset (:func:`paper_settings`), with what paper mode itself still runs that is not the paper's
(``paper_departures``, ``workflow/paper_departures.json``); otherwise ``no``, with the reason under the
table, so that no paper figure stands unmarked beside a run of other settings (config.yaml's debtags-sized defaults,
another encoder, an override).

Run-to-run noise: with ``seeds: [0, 1, 2]`` in a dataset's settings, ``results/<dataset>/seeds/<method>.json``
(rule ``seed_summary``, ``--summarise``) holds the target's metrics over its seed replicas
(:func:`xmc_steps.config.replica_of`) as mean and standard deviation; the leaderboard, given such
summaries (``--seeds``), shows P@1 as mean +- std and marks a target within that noise of the one
above it (:func:`add_seed_columns`).
"""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from . import io
from . import config as xcfg
from . import registry
from .registry import split_method
from .papers import paper_mode_departures, select_reported

METRICS = ["p_at_1", "p_at_3", "p_at_5", "ndcg_at_1", "ndcg_at_3", "ndcg_at_5", "psp_at_1", "psp_at_3", "psp_at_5",
           "recall_at_10", "recall_at_20", "recall_at_100"]
HEAD = {"p_at_1": "P@1", "p_at_3": "P@3", "p_at_5": "P@5", "ndcg_at_1": "nDCG@1", "ndcg_at_3": "nDCG@3",
        "ndcg_at_5": "nDCG@5", "psp_at_1": "PSP@1", "psp_at_3": "PSP@3", "psp_at_5": "PSP@5", "recall_at_10": "R@10",
        "recall_at_20": "R@20", "recall_at_100": "R@100"}
BASELINE = "parabel"


def _machine(res: Mapping[str, Any]) -> str:
    ms = res.get("machines") or []
    gpus = sorted({m["gpu"] for m in ms if m.get("gpu")})
    if gpus:
        return "GPU " + ", ".join(gpus)
    cpus = sorted({f"{m.get('cpu')} ({m.get('cores')} cores)" for m in ms})
    return "CPU " + ", ".join(cpus) if cpus else str(res.get("device", ""))


#: the config.paper.yaml section of each method (a variant's is its method's)
PAPER_SECTIONS = {name: spec.section for name, spec in registry.METHODS.items()}


def _normal(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Settings as JSON has them (tuples as lists), less ``threads`` (the machine's, not the method's)."""
    import json

    return {k: v for k, v in json.loads(json.dumps(settings)).items() if k != "threads"}


def _differences(got: Any, want: Any, where: str = "") -> list[str]:
    if isinstance(got, dict) and isinstance(want, dict):
        out = []
        for k in sorted(set(got) | set(want)):
            out += _differences(got.get(k), want.get(k), f"{where}.{k}" if where else k)
        return out
    return [] if got == want else [f"{where} {got!r} (paper: {want!r})"]


def paper_settings(result: Mapping[str, Any], base: Mapping[str, Any], paper: Mapping[str, Any]) -> tuple[bool, str | None]:
    """Whether a results document ran the paper's settings: ``(True, None)``, or ``(False, why)``.

    The paper's settings of a dataset and method are ``base`` (config.yaml) with ``paper``
    (config.paper.yaml) merged in, as ``snakemake --configfile config.yaml config.paper.yaml`` runs
    them; a dataset without the method's section in ``paper`` has none (the run would train with
    config.yaml's defaults).  Compared: the results file's effective settings (``config.settings``,
    :func:`xmc_steps.config.method_settings`) less ``threads``."""
    dataset, method = result["dataset"], result["method"]
    section = PAPER_SECTIONS.get(split_method(method)[0])
    own = ((paper.get("datasets") or {}).get(dataset) or {})
    if section is None or section not in own:
        return False, f"config.paper.yaml has no {section or method} section for {dataset}: not the paper's settings"
    got = (result.get("config") or {}).get("settings")
    if not isinstance(got, Mapping):
        return False, "the results file records no effective settings"
    try:
        want = xcfg.method_settings(xcfg.deep_merge(base, paper), dataset, method)
    except (KeyError, TypeError, ValueError) as e:
        return False, f"the paper's settings for {dataset} cannot be resolved: {e}"
    diff = _differences(_normal(got), _normal(want))
    diff.sort(key=lambda d: not d.startswith(section + "."))     # the method's own section first
    if diff:
        more = f" and {len(diff) - 3} more" if len(diff) > 3 else ""
        return False, "settings differ from config.yaml + config.paper.yaml: " + "; ".join(diff[:3]) + more
    return True, None


def rows_of(results: Iterable[Mapping[str, Any]], reported: Mapping[str, Any] | None = None,
            paper_config: tuple[Mapping[str, Any], Mapping[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One leaderboard row per results document, best P@1 first; gains over Parabel where it ran; with
    ``paper_config`` (config.yaml and config.paper.yaml, loaded), whether a row with a paper figure ran
    the paper's settings (:func:`paper_settings`)."""
    results = list(results)
    base = next((r["metrics"] for r in results if r["method"] == BASELINE), None)
    rows = []
    for r in results:
        m = r["metrics"]
        row: dict[str, Any] = {"method": r["method"], **{k: m[k] for k in METRICS}}
        row["train_time_s"] = r.get("total_train_time_s")
        row["predict_ms_per_doc"] = r.get("predict_latency_ms_per_doc")
        row["model_size_mb"] = (r.get("model_size_bytes") or 0) / 2**20
        row["device"] = r.get("device")
        row["machine"] = _machine(r)
        row["second_stage"] = second_stage_cell(r.get("second_stages") or [])
        zs = r.get("zero_shot") or {}
        row["zero_shot_p_at_1"], row["zero_shot_recall_at_100"] = zs.get("p_at_1"), zs.get("recall_at_100")
        for k in ("p_at_1", "p_at_3", "p_at_5"):
            row[f"gain_{k}"] = (m[k] - base[k]) / base[k] * 100 if base and base[k] else None
        paper = select_reported(reported or {}, r["dataset"], r["method"]) or r.get("reported") or {}
        for k in ("p_at_1", "p_at_3", "p_at_5"):
            row[f"paper_{k}"] = paper.get(k)
        row["paper_source"] = paper.get("source")
        row["paper_note"] = paper.get("note")
        row["paper_settings"], row["paper_settings_why"], row["paper_departures"] = None, None, None
        if paper_config is not None and row["paper_p_at_1"] is not None:
            row["paper_settings"], row["paper_settings_why"] = paper_settings(r, *paper_config)
            if row["paper_settings"]:    # what the paper's settings still leave ours (xmc_steps.papers)
                row["paper_departures"] = "; ".join(paper_mode_departures(
                    PAPER_SECTIONS.get(split_method(r["method"])[0], ""), r["dataset"])) or None
        rows.append(row)
    rows.sort(key=lambda x: -x["p_at_1"])
    return rows


#: the metrics a seed summary gives mean and standard deviation of
SEED_METRICS = ["p_at_1", "p_at_3", "p_at_5", "ndcg_at_5", "psp_at_5", "recall_at_100"]


def seed_summary(results: list[Mapping[str, Any]]) -> dict[str, Any]:
    """One target's runs over seeds (its results documents, one per seed replica): for every metric of
    :data:`SEED_METRICS` the mean and the sample standard deviation (``n - 1``; 0 for one run)."""
    import statistics

    if not results:
        raise ValueError("a seed summary needs at least one results document")
    methods = {r["method"] for r in results}
    if len(methods) != 1:
        raise ValueError(f"a seed summary is of one target; got {sorted(methods)}")
    out: dict[str, Any] = {"method": methods.pop(), "datasets": [r["dataset"] for r in results], "n": len(results),
                           "mean": {}, "std": {}, "runs": {}}
    for k in SEED_METRICS:
        vals = [float(r["metrics"][k]) for r in results]
        out["runs"][k] = vals
        out["mean"][k] = statistics.fmean(vals)
        out["std"][k] = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return out


def add_seed_columns(rows: list[dict[str, Any]], summaries: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """P@1 mean +- std over seeds on the rows whose target has a seed summary, and a mark where a row's
    P@1 is within that noise of the row above it (rows best first).

    Within noise: the two targets' mean P@1 differ by no more than the sum of their standard
    deviations over seeds (about one standard deviation of the difference, a deliberately lenient
    test: a researcher should not read more into such a gap).  A target without a seed summary has
    no known noise and gets no mark.
    """
    by = {s["method"]: s for s in summaries}
    for r in rows:
        s = by.get(r["method"])
        r["p_at_1_mean"] = s["mean"]["p_at_1"] if s else None
        r["p_at_1_std"] = s["std"]["p_at_1"] if s else None
        r["n_seeds"] = s["n"] if s else None
        r["within_noise_of"] = None
    for above, r in zip(rows, rows[1:]):
        if r["n_seeds"] and above["n_seeds"] and r["n_seeds"] > 1 and above["n_seeds"] > 1:
            gap = abs(above["p_at_1_mean"] - r["p_at_1_mean"])
            if gap <= above["p_at_1_std"] + r["p_at_1_std"]:
                r["within_noise_of"] = above["method"]
    return rows


def second_stage_cell(checks: list[Mapping[str, Any]]) -> str | None:
    """What the validation split decided for a target's re-rankers and ensembles: ``off`` where a stage
    kept its input alone (the row is then its input's answer), else the combination kept."""
    cells = [("off (kept " + c["input"] + ")" if c.get("switched_off") else c["chosen"]) + (" forced" if c.get("forced") else "")
             for c in checks if c.get("measured", True) and "chosen" in c]
    return "; ".join(cells) or None


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _seed_cell(r: Mapping[str, Any]) -> str:
    if not r.get("n_seeds"):
        return "-"
    cell = f"{r['p_at_1_mean']:.2f} ± {r['p_at_1_std']:.2f} ({r['n_seeds']})"
    return cell + (f" ≈ {r['within_noise_of']}" if r.get("within_noise_of") else "")


def _settings_cell(r: Mapping[str, Any]) -> str:
    ps = r.get("paper_settings")
    cell = "-" if ps is None else "yes" if ps else "no"
    return cell + (" *" if r.get("paper_note") else "")


def markdown(dataset: str, rows: list[dict[str, Any]]) -> str:
    seeds = any(r.get("n_seeds") for r in rows)
    marks = any(r.get("paper_settings") is not None or r.get("paper_note") for r in rows)
    zero = any(r.get("zero_shot_p_at_1") is not None for r in rows)
    second = any(r.get("second_stage") for r in rows)
    cols = ["method"] + METRICS + (["seeds_p_at_1"] if seeds else []) + (
        ["zero_shot_p_at_1", "zero_shot_recall_at_100"] if zero else []) + (["second_stage"] if second else []) + [
        "train_time_s", "predict_ms_per_doc", "model_size_mb", "gain_p_at_1", "paper_p_at_1",
        "paper_p_at_3", "paper_p_at_5"] + (["paper_settings"] if marks else []) + ["machine"]
    names = {**HEAD, "method": "target", "train_time_s": "train s", "predict_ms_per_doc": "predict ms/doc",
             "model_size_mb": "model MB", "gain_p_at_1": "P@1 gain over Parabel %", "paper_p_at_1": "paper P@1",
             "paper_p_at_3": "paper P@3", "paper_p_at_5": "paper P@5", "machine": "machine",
             "seeds_p_at_1": "P@1 over seeds (n); ≈ within noise of the row above",
             "paper_settings": "paper's settings (* another split)",
             "zero_shot_p_at_1": "zero-shot P@1", "zero_shot_recall_at_100": "zero-shot R@100",
             "second_stage": "second stage on validation (off: its input kept)"}
    out = [f"# Leaderboard: {dataset}", "",
           "Metrics in percent on the test split, best P@1 first; 'paper' columns are the papers' own figures for this "
           "dataset and target (sources below); the gain is (ours - parabel) / parabel on this data; zero-shot: over "
           "the test labels that training never saw (xmc_steps.metrics.zero_shot).", "",
           "| " + " | ".join(names[c] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(_seed_cell(r) if c == "seeds_p_at_1" else _settings_cell(r) if c == "paper_settings"
                                     else _fmt(r[c], 1 if c in ("train_time_s", "model_size_mb") else 2) for c in cols) + " |")
    sources = sorted({(r["method"], r["paper_source"], r.get("paper_note"), r.get("paper_settings_why"),
                       r.get("paper_departures")) for r in rows if r["paper_source"]}, key=lambda x: x[0])
    if sources:
        out += ["", "Papers' figures (a paper's figure stands beside our run of the same target; 'paper's settings: no' "
                "marks a run that did not use config.yaml + config.paper.yaml's settings for it):"]
        out += [f"- {m}: {s}" + (f"; {n}" if n else "") + (f"; ours: {w}" if w else "")
                + (f"; paper mode's own: {d}" if d else "") for m, s, n, w, d in sources]
    out += ["", "![P@k](leaderboard.png)", "![recall@k](leaderboard_recall.png)",
            "![decile-wise recall@100](leaderboard_deciles.png)", ""]
    return "\n".join(out)


def write_csv(path: str | os.PathLike, rows: list[dict[str, Any]]) -> None:
    with io.atomic_path(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["method"])
        w.writeheader()
        w.writerows(rows)


def plots(results: list[Mapping[str, Any]], rows: list[dict[str, Any]], stem: Path, dataset: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    by = {r["method"]: r for r in results}
    order = [r["method"] for r in rows]
    paths = []
    # P@k bars
    fig, ax = plt.subplots(figsize=(max(6.4, 0.9 * len(order) + 2), 4.0))
    x = np.arange(len(order))
    for j, k in enumerate((1, 3, 5)):
        ax.bar(x + (j - 1) * 0.27, [by[m]["metrics"][f"p_at_{k}"] for m in order], 0.27, label=f"P@{k}")
    ax.set_xticks(x, order, rotation=30, ha="right", fontsize=8)
    paths.append(_finish(fig, ax, None, "precision (%)", f"{dataset}: P@k", stem.with_name(stem.name + ".png")))
    # recall@k curves
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for m in order:
        r = by[m]
        if r.get("recall_curve"):
            ax.plot(np.arange(1, len(r["recall_curve"]) + 1), r["recall_curve"], label=m)
        else:
            ax.plot([10, 20, 100], [r["metrics"][f"recall_at_{k}"] for k in (10, 20, 100)], "o--", label=m)
    paths.append(_finish(fig, ax, "k", "recall@k (%)", f"{dataset}: recall@k",
                         stem.with_name(stem.name + "_recall.png")))
    # decile-wise recall@100
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for m in order:
        d = by[m]["metrics"]["decile_recall_at_100"]
        ax.plot(np.arange(1, len(d) + 1), d, "o-", label=m)
    ax.set_yscale("symlog", linthresh=0.1)     # the head decile holds most of it: the tail would be flat
    paths.append(_finish(fig, ax, "label decile (1 = most frequent labels)", "contribution to recall@100 (%, log scale)",
                         f"{dataset}: decile-wise recall@100", stem.with_name(stem.name + "_deciles.png")))
    return paths


def _finish(fig, ax, xlabel: str | None, ylabel: str, title: str, path: Path) -> Path:
    """Label a plot, add its legend and write it (PNG, atomically)."""
    import matplotlib.pyplot as plt

    if xlabel:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    with io.atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    return path


def cross_dataset(tables: list[Path]) -> str:
    """The main columns of every dataset's leaderboard, one block per dataset."""
    cols = ["method", "p_at_1", "p_at_3", "p_at_5", "recall_at_100", "gain_p_at_1", "paper_p_at_1", "paper_settings",
            "train_time_s", "machine"]
    out = ["# Leaderboard: all datasets", ""]
    for t in sorted(tables):
        with open(t, encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
        out += [f"## {t.parent.name}", "", "| target | P@1 | P@3 | P@5 | R@100 | P@1 gain over Parabel % | paper P@1 | "
                "paper's settings (* another split) | train s | machine |", "|" + "---|" * len(cols)]
        for r in rows:
            r["paper_settings"] = {"True": True, "False": False}.get(r.get("paper_settings") or "")
            out.append("| " + " | ".join(_settings_cell(r) if c == "paper_settings" else _fmt(_num(r.get(c)))
                                         for c in cols) + " |")
        out.append("")
    return "\n".join(out)


def _num(v: Any) -> Any:
    try:
        return float(v) if v not in (None, "") else None
    except ValueError:
        return v
