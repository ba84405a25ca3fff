"""The dual encoder's validation table (xmc_steps/dual_encoder, "Choosing the defaults"): one row per run,
read from its training record (valid figures over the whole validation split; test is never read).

    python bench/dual_encoder_choices.py [--results results] [--encoder-dir minilm-64] DATASET [ALIAS ...]

``DATASET`` is the default config's run, each ``ALIAS`` a run of ``bench/dual-encoder-choices.yaml`` (one
setting changed); a missing run prints as missing.  Columns: valid P@1, P@5, recall@w (the guard's budget),
the start's (the pre-trained encoder's) recall@w, the most frequent labels' and the linear tree's recall at
the same budget, training seconds and sequences/s (what else ran on the machine shows there), and the
settings that differ from the first row's.  The table is markdown, on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xmc_steps.params import flatten  # noqa: E402


def load(results: Path, name: str, encoder_dir: str) -> dict | None:
    path = results / name / "dual-encoder" / encoder_dir / "record.json"
    if not path.exists():
        return None
    return json.loads(path.read_text())


def table(results: Path, names: list[str], encoder_dir: str) -> str:
    rows = ["| run | valid P@1 | valid P@5 | valid R@w | start R@w | most frequent R@w | linear tree R@w "
            "| train s | seq/s | settings changed |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    base = None
    for name in names:
        rec = load(results, name, encoder_dir)
        if rec is None:
            rows.append(f"| {name} | missing |||||||||")
            continue
        m, p = rec["metrics"], flatten(rec["params"])
        if base is None:
            base = p
        ignore = {"threads", "device"}
        changed = ", ".join(f"{k}={p[k]}" for k in sorted(p) if k not in ignore and p.get(k) != base.get(k))
        rows.append("| " + " | ".join([
            name, *(f"{100 * m[k]:.2f}" if k in m else "" for k in (   # no start point with eval_every 0
                "valid_p_at_1", "valid_p_at_5", "valid_recall", "valid_start_recall", "valid_recall_most_frequent",
                "valid_recall_linear_tree")),
            f"{m['train_time_s']:.0f}", f"{m['train_seq_per_s']:.1f}", changed or "(defaults)"]) + " |")
    return "\n".join(rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="+", help="the default run's dataset, then the aliases")
    ap.add_argument("--results", type=Path, default=Path("results"))
    ap.add_argument("--encoder-dir", default="minilm-64", help="the model folder under dual-encoder/")
    a = ap.parse_args(argv)
    print(table(a.results, a.names, a.encoder_dir))


if __name__ == "__main__":
    main()
