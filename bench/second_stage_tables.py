"""Every second stage beside its input, on validation and on test: one table per dataset (issue 57).

For each dataset of a results folder with a trained ``dual-encoder-ranker`` and ``dual-encoder-ensemble``:

- the ranker (NGAME's second module): the shortlist alone (the input), the classifiers alone, the product
  (the target's default before the validation choice), NGAME's score fusion (the best beta and depth on
  validation), and the row the validation split chose.  Valid columns: out of fold, as the fuse stage
  measured them (its record); test columns: the same combinations fit on all of validation, scored here
  through ``xmc_steps.elias_plus``'s functions, which the predict stage uses;
- each ensemble (``--ensembles``; ``dual-encoder-ensemble``, with xr-linear, by default): each member alone, the
  combinations (for two members the averages at weights 0.25-0.75), and the chosen row, from the choice its
  stage saved (``ensemble.json``).

Writes ``docs/second-stage.md`` (``--write``) and prints the tables::

    python bench/second_stage_tables.py --results results --datasets debtags reuters-all5 yso-finna-sv-50k --write

Progress goes to stderr; stdout carries only the tables.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xmc_steps import elias_plus, ensemble, io, layout, second_stage  # noqa: E402
from xmc_steps.dual_encoder import spec as DES  # noqa: E402
from xmc_steps.registry import METHODS, split_method  # noqa: E402
from xmc_steps.elias_plus import EliasPlusParams  # noqa: E402
from xmc_steps.ranker import ranker_features  # noqa: E402
from xmc_steps.search import topk_per_row  # noqa: E402
from xmc_steps.serving import Target  # noqa: E402

LOG = logging.getLogger("second_stage_tables")
KEYS = second_stage.KEYS
HEAD = "| row | valid P@1 | valid P@5 | valid R@100 | test P@1 | test P@5 | test R@100 |\n|---|---|---|---|---|---|---|"


def _split(res: str, dataset: str, settings, split: str, W_meta, L: int):
    """The ranker's inputs of one split: features, candidates, labels."""
    _, meta = W_meta
    p = EliasPlusParams.from_dict(EliasPlusParams.upgrade(meta["params"]))
    folder = DES.model_dir(res, dataset, settings)
    X = io.load_csr(layout.at(res, layout.TFIDF, dataset=dataset) + f"/X_{split}.npz")
    E = io.load_arrays(f"{folder}/emb_{split}.npz")["emb"]
    Xr = ranker_features(X, E, "tfidf+neural", p.neural_weight)
    cand = elias_plus.candidates(io.read_predictions(f"{folder}/pred_{split}.parquet", L), p.n_candidates)
    Y = io.load_csr(layout.at(res, layout.INGEST, dataset=dataset) + f"/Y_{split}.npz")
    return Xr, cand, Y, p


def _row(name: str, valid: dict | None, test: dict) -> str:
    v = [f"{valid[k]:.2f}" if valid else "-" for k in KEYS]
    return f"| {name} | " + " | ".join(v + [f"{test[k]:.2f}" for k in KEYS]) + " |"


def ranker_table(res: str, dataset: str) -> list[str]:
    t = Target.load(Path(res) / dataset / "dual-encoder-ranker")
    L = io.read_table(layout.at(res, layout.INGEST, dataset=dataset) + "/" + layout.LABELS, ["label_id"]).num_rows
    folder = Path(DES.model_dir(res, dataset, t.settings, DES.DUAL_ENCODER_RANKER))
    W_meta = elias_plus.load_ranker(folder / "model")
    freq = elias_plus.label_train_freq(folder / "model")
    fused = io.read_json(folder / "fusion" / "calibration.json")
    record = fused["second_stage"]
    table = record["table"]
    Xt, ct, Yt, p = _split(res, dataset, t.settings, "test", W_meta, L)
    ht = elias_plus.ranker_scores(Xt, W_meta[0], ct, p.solver.bias)
    Xv, cv, Yv, _ = _split(res, dataset, t.settings, "valid", W_meta, L)
    hv = elias_plus.ranker_scores(Xv, W_meta[0], cv, p.solver.bias)
    fusion_rows = [n for n in table if n.startswith("fusion")]
    best_fusion = max(fusion_rows, key=lambda n: sum(table[n][k] for k in second_stage.GUARDED)) if fusion_rows else None
    rows = []
    for name in ["shortlist", "ranker", "product"] + ([best_fusion] if best_fusion else []):
        if name.startswith("fusion"):
            depth, beta = (float(x.split("=")[1]) for x in name[len("fusion("):-1].split(","))
            c = elias_plus.fit_combination("fusion", cv, hv, Yv, p, freq, int(depth), beta)
        else:
            c = elias_plus.Combination(name)
        test = second_stage.measure(topk_per_row(elias_plus.combination_scores(c, ct, ht, p, freq), p.topk), Yt).figures
        label = {"shortlist": "the shortlist alone (input)", "ranker": "the classifiers alone",
                 "product": "classifiers x shortlist (the former default)"}.get(name, f"NGAME's score fusion, {name}")
        rows.append(_row(label + (" **chosen**" if name == record["chosen"] else ""), table.get(name), test))
    LOG.info("%s: ranker table done", dataset)
    return [f"### {dataset}: dual-encoder-ranker (chosen on validation: {record['chosen']})", "", HEAD, *rows, ""]


def ensemble_table(res: str, dataset: str, target: str) -> list[str]:
    """An ensemble target's members alone and its combinations, from the choice its stage saved
    (``ensemble.json``: the members' test tables, the method, the chosen row) and its record (the valid rows)."""
    t = Target.load(Path(res) / dataset / target)
    base, variant = split_method(target)
    pred = Path(METHODS[base].predictions(res, dataset, t.settings, variant))
    choice = io.read_json(pred.with_name("ensemble.json"))
    record = io.read_json(pred.with_name(layout.RECORD))["extra"]["second_stage"]
    L = io.read_table(layout.at(res, layout.INGEST, dataset=dataset) + "/" + layout.LABELS, ["label_id"]).num_rows
    # the members' paths as the DAG wrote them: relative to its working folder, results/'s parent
    members = [io.read_predictions(m if Path(m).is_absolute() else Path(res).resolve().parent / m, L)
               for m in choice["members"]]
    Yt = io.load_csr(layout.at(res, layout.INGEST, dataset=dataset) + "/Y_test.npz")
    names, method, topk = choice["names"], choice["method"], int(choice["topk"])
    if not record.get("table"):
        return [f"### {dataset}: {target} (not chosen on validation: {record.get('why')})", ""]
    rows = []
    for name, weights, member in ensemble.candidates(len(members)):
        label = names[member] if member is not None else name
        P = ensemble.ranking(members, method, topk, weights, member)
        test = second_stage.measure(P, Yt).figures
        rows.append(_row(label + (" (input: the best member)" if label == record["input"] else "")
                         + (" **chosen**" if label == record["chosen"] else ""), record["table"].get(label), test))
    note = {"dual-encoder-ensemble": "xr-linear's validation rows: its fit on the train split (the target's own "
                                     "fits on train + valid)."}.get(target)
    return [f"### {dataset}: {target} (chosen on validation: {record['chosen']})", "", HEAD, *rows, "",
            *([note, ""] if note else [])]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default="results")
    ap.add_argument("--datasets", nargs="+", required=True)
    ap.add_argument("--ensembles", nargs="+", default=["dual-encoder-ensemble"],
                    help="the ensemble targets to tabulate where a dataset has them (elias-ensemble, "
                         "lightxml-ensemble, xtransformer-ensemble-indexing, ...)")
    ap.add_argument("--write", action="store_true", help="write docs/second-stage.md")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    out = ["# Second stages against their input", "",
           "Written by `bench/second_stage_tables.py` from a results folder (default config, one run per set, "
           "2-core CPU). Valid columns: out of fold for the fitted rows (each half of the validation documents "
           "scored by a tree fit on the other half), as the stage measured them; test columns: the same "
           "combinations fit on all of validation. Percent. The readings: "
           "[methods/second-stage.md](methods/second-stage.md).", ""]
    for d in args.datasets:
        for target in ["dual-encoder-ranker", *args.ensembles]:
            if not Path(layout.at(args.results, layout.CONFIG, dataset=d, method=target)).exists():
                LOG.warning("%s: no %s in %s", d, target, args.results)
            elif target == "dual-encoder-ranker":
                out += ranker_table(args.results, d)
            else:
                out += ensemble_table(args.results, d, target)
    text = "\n".join(out)
    print(text)
    if args.write:
        with io.atomic_path(ROOT / "docs" / "second-stage.md") as tmp:
            Path(tmp).write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
