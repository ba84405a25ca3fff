"""Ensembles of prediction tables (X-Transformer Table 5 rows 7-9; ELIAS's 3 models).

The stage: the members' prediction tables combined by :func:`xmc_steps.ensemble.combine` (the
``ensemble`` and ``topk`` parameters: ``ensemble`` the method, described in :mod:`xmc_steps.ensemble`, under the
name of the methods' config key, ``elias.ensemble``, which their rules pass unchanged).  Given the
members' validation tables, it keeps the best on validation of each member alone and the combination
(:mod:`xmc_steps.second_stage`): an ensemble that does not beat its best member there is switched off.

CLI::

    python -m xmc_steps.stages.ensemble --predictions a.parquet b.parquet ... --label-table labels.parquet \\
        --out predictions.parquet --params '{"ensemble": "average", "topk": 100}'
"""

from __future__ import annotations

import argparse

from .. import ensemble, io, second_stage
from ..stage import StageError, add_common_args, cli_main, stage_run


def _choose(args, st, L: int, names: list[str], method: str, topk: int):
    """The validation choice among each member alone and the combination (:func:`ensemble.candidates`), the
    best member the input (:func:`second_stage.choose`)."""
    if len(args.valid_predictions) != len(args.predictions):
        raise StageError(f"{len(args.valid_predictions)} validation tables for {len(args.predictions)} members")
    Y = io.load_csr(args.valid_labels)
    valid = [io.read_predictions(p, L) for p in args.valid_predictions]
    rankings, how = {}, {}
    for name, weights, member in ensemble.candidates(len(valid)):
        label = names[member] if member is not None else name
        P = ensemble.ranking(valid, method, topk, weights, member)
        rankings[label] = second_stage.measure(P, Y)
        how[label] = (weights, member)
        st.log.info("validation %s: %s", label, ", ".join(f"{k} {v:.2f}" for k, v in rankings[label].figures.items()))
    best_member = max(names, key=lambda n: sum(rankings[n].figures[k] for k in second_stage.GUARDED))
    choice = second_stage.choose(rankings, best_member)
    st.log.info("%s", choice.summary())
    return choice, how[choice.chosen]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m xmc_steps.stages.ensemble", description=__doc__.splitlines()[0])
    ap.add_argument("--predictions", nargs="+", required=True, help="member prediction tables")
    ap.add_argument("--label-table", required=True, help="the ingest stage's labels.parquet (gives L)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--names", nargs="+", default=None, help="the members' names (default: member 0, 1, ...)")
    ap.add_argument("--valid-predictions", nargs="+", default=None,
                    help="the members' validation tables, in --predictions' order: the stage then keeps the best of "
                         "each member alone and the combination on validation (with --valid-labels)")
    ap.add_argument("--valid-labels", default=None, help="the validation split's labels (Y_valid.npz)")
    ap.add_argument("--choice-out", default=None, help="a JSON file for the choice (serving applies it)")
    ap.add_argument("--unmeasured", default="the members' validation predictions are not part of this target",
                    help="without --valid-predictions: why the combination was not chosen on validation (the record "
                         "says it)")
    add_common_args(ap)
    args = ap.parse_args(argv)
    with stage_run("ensemble", args, outputs=[args.out]) as st:
        if "method" in st.params:
            raise StageError("the ensemble's method is the parameter 'ensemble' (as elias.ensemble), not 'method'")
        method = st.params.get("ensemble", "average")
        topk = int(st.params.get("topk", 100))
        L = io.read_table(args.label_table, ["label_id"]).num_rows
        names = args.names or [f"member {i}" for i in range(len(args.predictions))]
        if len(names) != len(args.predictions):
            raise StageError(f"{len(names)} names for {len(args.predictions)} members")
        if (args.valid_predictions is None) != (args.valid_labels is None):
            raise StageError("--valid-predictions and --valid-labels go together")
        members = [io.read_predictions(p, L) for p in args.predictions]
        weights, member = None, None
        if args.valid_predictions:
            choice, (weights, member) = _choose(args, st, L, names, method, topk)
            st.extra["second_stage"] = choice.record()
            st.params["combine_chosen"] = choice.chosen
            st.metric("second_stage_switched_off", float(choice.switched_off))
            for side in ("input", "chosen"):
                for k, v in choice.record()["valid"][side].items():
                    st.metric(f"valid_{side}_{k}", v)
        else:
            st.extra["second_stage"] = {"measured": False, "why": args.unmeasured}
        try:
            P = ensemble.ranking(members, method, topk, weights, member)
        except ValueError as e:
            raise StageError(str(e)) from e
        io.write_predictions(args.out, P, topk)
        if args.choice_out:
            io.write_json(args.choice_out, {"method": method, "names": names, "weights": weights, "member": member,
                                            "chosen": st.params.get("combine_chosen", "combined"),
                                            "members": [str(p) for p in args.predictions], "topk": topk})
            st.output("choice", args.choice_out)
        st.metric("n_members", len(members))
        st.output("predictions", args.out)


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
