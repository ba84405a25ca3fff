import json

import pytest

from test_workflow import _run
from xmc_steps import io, leaderboard
from xmc_steps.stages import leaderboard as leaderboard_stage


def _res(method, p1, dataset="d", **more):
    m = {k: 0.0 for k in leaderboard.METRICS}
    m.update(p_at_1=p1, p_at_3=p1 / 2, p_at_5=p1 / 3, recall_at_10=p1, recall_at_20=p1 + 1, recall_at_100=p1 + 2,
             decile_recall_at_100=[p1 / 2, p1 / 4] + [0.1] * 8)
    return {"dataset": dataset, "method": method, "metrics": m, "total_train_time_s": 10.0,
            "predict_latency_ms_per_doc": 1.5, "model_size_bytes": 2**20, "device": "cpu", "reported": None, **more}


def test_rows_rank_by_p1_with_gains_over_parabel_and_the_papers_figures():
    reported = {"d": {"lightxml": {"p_at_1": 77.0, "p_at_3": 58.0, "p_at_5": 45.0, "source": "LightXML Table 4"}}}
    results = [_res("parabel", 50.0), _res("lightxml", 60.0, machines=[{"host": "g", "cpu": "x", "cores": 8,
                                                                       "gpu": "NVIDIA H100"}]),
               _res("xr-linear", 40.0, machines=[{"host": "l", "cpu": "Core i5", "cores": 2, "gpu": None}])]
    rows = leaderboard.rows_of(results, reported)
    assert [r["method"] for r in rows] == ["lightxml", "parabel", "xr-linear"]
    assert rows[0]["gain_p_at_1"] == pytest.approx(20.0) and rows[2]["gain_p_at_1"] == pytest.approx(-20.0)
    assert rows[0]["paper_p_at_1"] == 77.0 and rows[0]["paper_source"] == "LightXML Table 4"
    assert rows[1]["paper_p_at_1"] is None
    assert rows[0]["machine"] == "GPU NVIDIA H100" and rows[2]["machine"] == "CPU Core i5 (2 cores)"
    md = leaderboard.markdown("d", rows)
    assert "| lightxml | 60.00 |" in md and "LightXML Table 4" in md and "leaderboard_recall.png" in md
    # no parabel run: no gains, no error
    assert leaderboard.rows_of([_res("lightxml", 60.0)])[0]["gain_p_at_1"] is None


def test_cli_writes_the_table_the_csv_and_three_plots(tmp_path):
    files = []
    for i, (m, p1) in enumerate((("parabel", 50.0), ("elias", 55.0))):
        r = _res(m, p1, recall_curve=[min(100.0, p1 + k / 10) for k in range(100)] if i else None)
        if r["recall_curve"] is None:
            del r["recall_curve"]
        io.write_json(tmp_path / f"{m}.json", r)
        files.append(str(tmp_path / f"{m}.json"))
    out = tmp_path / "lb" / "leaderboard.md"
    from xmc_steps.stage import cli_main

    assert cli_main(leaderboard_stage.main, ["--results", *files, "--out", str(out), "--no-tracking"]) == 0
    assert "| elias | 55.00 |" in out.read_text()
    for f in ("leaderboard.csv", "leaderboard.png", "leaderboard_recall.png", "leaderboard_deciles.png"):
        assert (out.parent / f).stat().st_size > 0, f
    assert (out.parent / "leaderboard.png").read_bytes()[:4] == b"\x89PNG"
    # the table rendered for snakemake --report: an HTML table with a row per target
    page = (out.parent / "leaderboard.html").read_text()
    assert "<table>" in page and "<td>elias</td><td>55.00</td>" in page and "<script" not in page
    all_md = tmp_path / "all.md"
    assert cli_main(leaderboard_stage.main, ["--tables", str(out.parent / "leaderboard.csv"), "--out", str(all_md),
                                       "--no-tracking"]) == 0
    assert "## lb" in all_md.read_text() and "| elias | 55.00 |" in all_md.read_text()
    assert cli_main(leaderboard_stage.main, ["--results", "--out", str(tmp_path / "x.md"), "--no-tracking"]) != 0


@pytest.mark.slow
def test_leaderboard_targets_rank_what_has_run(toy_linear_run):
    """`results/toy/leaderboard.md` and `results/leaderboard.md` from the toy's two evaluated targets,
    without asking for any other target; a new results file reruns the leaderboard."""
    tmp = toy_linear_run
    r = _run(tmp, "results/toy/leaderboard.md", "results/leaderboard.md")
    assert "xr_linear_train" not in r.stdout + r.stderr and "evaluate" not in r.stdout.split("Job stats")[-1][:400]
    md = (tmp / "results/toy/leaderboard.md").read_text()
    assert "| xr-linear |" in md and "| parabel |" in md
    assert "## toy" in (tmp / "results/leaderboard.md").read_text()
    # a file that is not a target is not ranked; a new target's results file reruns the leaderboard
    res = json.loads((tmp / "results/toy/parabel.json").read_text())
    io.write_json(tmp / "results/toy/notes.json", {"not": "a target"})
    io.write_json(tmp / "results/toy/lightxml.json", {**res, "method": "lightxml"})
    r = _run(tmp, "results/toy/leaderboard.md", extra=["-n"])
    assert "rule leaderboard" in r.stdout + r.stderr and "xr_linear_train" not in r.stdout + r.stderr
    assert "notes.json" not in r.stdout + r.stderr
    for f in ("lightxml.json", "notes.json"):
        (tmp / "results/toy" / f).unlink()


def test_seed_summary_and_noise_marks():
    from xmc_steps import leaderboard as lb

    def res(method, dataset, p1):
        return {"method": method, "dataset": dataset,
                "metrics": {k: p1 if k == "p_at_1" else 50.0 for k in lb.SEED_METRICS}}

    a = lb.seed_summary([res("parabel", "d", 90.05), res("parabel", "d-seed1", 89.70), res("parabel", "d-seed2", 89.72)])
    assert a["n"] == 3 and a["mean"]["p_at_1"] == pytest.approx(89.8233, abs=1e-3)
    assert a["std"]["p_at_1"] == pytest.approx(0.1966, abs=1e-3) and a["std"]["p_at_5"] == 0.0
    b = lb.seed_summary([res("xr-linear", "d", 89.70), res("xr-linear", "d-seed1", 89.60)])
    c = lb.seed_summary([res("elias", "d", 92.6), res("elias", "d-seed1", 92.5)])
    with pytest.raises(ValueError, match="one target"):
        lb.seed_summary([res("a", "d", 1.0), res("b", "d", 1.0)])
    blank = dict.fromkeys(lb.METRICS + ["train_time_s", "predict_ms_per_doc", "model_size_mb", "gain_p_at_1", "paper_p_at_1",
                                        "paper_p_at_3", "paper_p_at_5", "machine", "paper_source"])
    rows = [{**blank, "method": m, "p_at_1": p}
            for m, p in (("elias", 92.6), ("parabel", 90.05), ("xr-linear", 89.7), ("x", 80.0))]
    rows = lb.add_seed_columns(rows, [a, b, c])
    marks = {r["method"]: r["within_noise_of"] for r in rows}
    # parabel's mean is 2.7 below ELIAS's (far outside both spreads); xr-linear's 0.17 below parabel's,
    # within 0.20 + 0.07
    assert marks == {"elias": None, "parabel": None, "xr-linear": "parabel", "x": None}
    assert lb._seed_cell(rows[2]) == "89.65 ± 0.07 (2) ≈ parabel" and lb._seed_cell(rows[3]) == "-"
    assert "P@1 over seeds" in lb.markdown("d", rows)



def test_rows_whose_settings_are_not_the_papers_are_marked(tmp_path):
    """A paper figure stands beside a run of the paper's settings (config.yaml + config.paper.yaml for
    that dataset and method), or its row says it does not, and why; a paper's note (GUDN's other
    split) is printed beside it."""
    import yaml

    from xmc_steps import config
    from xmc_steps.stage import cli_main

    root = config.SCHEMA_PATH.parents[2]
    base = yaml.safe_load((root / "config.yaml").read_text())
    paper = yaml.safe_load((root / "config.paper.yaml").read_text())
    merged = config.deep_merge(base, paper)
    reported = io.read_json(root / "workflow" / "reported.json")

    def res(dataset, method, cfg):
        return _res(method, 80.0, dataset=dataset,
                    config={"settings": config.method_settings(cfg, dataset, method) | {"threads": 64}})

    runs = [res("eurlex4k", "gudn", merged),                        # the paper's settings (threads aside)
            res("eurlex4k", "xtransformer", base),                  # config.yaml's defaults
            res("eurlex4k", "parabel", merged),                     # no paper section: a baseline
            res("amazon3m", "elias", merged),                       # the paper's (its section: issue 33)
            res("wiki500k", "xr-linear", merged)]                   # a figure without a paper section
    rows = {r["method"] + "@" + r.get("dataset", ""): r for r in
            [dict(row, dataset=run["dataset"]) for run in runs for row in leaderboard.rows_of([run], reported, (base, paper))]}
    gudn, xt = rows["gudn@eurlex4k"], rows["xtransformer@eurlex4k"]
    assert gudn["paper_settings"] is True and gudn["paper_settings_why"] is None and "15,539" in gudn["paper_note"]
    assert xt["paper_settings"] is False and "differ from config.yaml + config.paper.yaml" in xt["paper_settings_why"]
    assert "xtransformer.cluster.leaf_size 100 (paper: 62)" in xt["paper_settings_why"]
    assert rows["parabel@eurlex4k"]["paper_settings"] is False
    assert rows["elias@amazon3m"]["paper_settings"] is True
    assert "no xr_linear section for wiki500k" in rows["xr-linear@wiki500k"]["paper_settings_why"]
    # a row without a paper figure is not marked; without the config files nothing is
    assert leaderboard.rows_of([res("debtags", "xr-linear", base)], reported, (base, paper))[0]["paper_settings"] is None
    assert leaderboard.rows_of([runs[1]], reported)[0]["paper_settings"] is None
    md = leaderboard.markdown("eurlex4k", leaderboard.rows_of(runs[:3], reported, (base, paper)))
    assert "paper's settings (* another split)" in md and "| yes * |" in md and "| no |" in md
    assert "another split: GUDN Table 1" in md and "ours: settings differ" in md
    # a "yes" names what paper mode itself still runs that is not the paper's (xmc_steps.papers), a "no" nothing
    assert "LightXML's (GUDN states none" in gudn["paper_departures"] and xt["paper_departures"] is None
    assert "5,000 held-out calibration documents" in rows["elias@amazon3m"]["paper_departures"]
    assert "paper mode's own: the optimiser, precision and split are LightXML's" in md
    # the CLI reads both files; the cross-dataset table carries the mark
    files = []
    for i, r in enumerate(runs[:2]):
        io.write_json(tmp_path / f"{i}.json", r)
        files.append(str(tmp_path / f"{i}.json"))
    io.write_json(tmp_path / "reported.json", reported)
    out = tmp_path / "eurlex4k" / "leaderboard.md"
    assert cli_main(leaderboard_stage.main, ["--results", *files, "--out", str(out), "--reported", str(tmp_path / "reported.json"),
                                       "--paper-config", str(root / "config.yaml"), str(root / "config.paper.yaml"),
                                       "--no-tracking"]) == 0
    assert "| yes * |" in out.read_text()
    assert "| yes * |" in leaderboard.cross_dataset([out.parent / "leaderboard.csv"])


def test_zero_shot_columns_appear_when_a_result_has_them():
    zs = {"n_docs": 3, "n_labels": 4, "p_at_1": 12.5, "p_at_3": 5.0, "p_at_5": 3.0, "recall_at_10": 20.0,
          "recall_at_100": 40.0}
    rows = leaderboard.rows_of([_res("dual-encoder", 30.0, zero_shot=zs), _res("xr-linear", 40.0, zero_shot=None)])
    assert rows[1]["zero_shot_p_at_1"] == 12.5 and rows[0]["zero_shot_p_at_1"] is None
    md = leaderboard.markdown("d", rows)
    assert "zero-shot P@1" in md and "| 12.50 | 40.00 |" in md
    assert "zero-shot" not in leaderboard.markdown("d", leaderboard.rows_of([_res("xr-linear", 40.0)])).split("\n")[4]


def test_a_switched_off_second_stage_is_named_in_its_row():
    off = {"rule": "dual_encoder_ranker_fuse", "input": "shortlist", "chosen": "shortlist", "switched_off": True}
    on = {"rule": "dual_encoder_ensemble", "input": "dual-encoder", "chosen": "combined(w=0.75)", "switched_off": False}
    rows = leaderboard.rows_of([_res("dual-encoder-ranker", 30.0, second_stages=[off]),
                                _res("dual-encoder-ensemble", 31.0, second_stages=[on]),
                                _res("elias-ensemble", 20.0, second_stages=[{"rule": "elias_ensemble", "measured": False}]),
                                _res("dual-encoder", 30.0)])
    cells = {r["method"]: r["second_stage"] for r in rows}
    assert cells == {"dual-encoder-ranker": "off (kept shortlist)", "dual-encoder-ensemble": "combined(w=0.75)",
                     "elias-ensemble": None, "dual-encoder": None}
    md = leaderboard.markdown("d", rows)
    assert "second stage on validation" in md and "| off (kept shortlist) |" in md
    assert "second stage on validation" not in leaderboard.markdown("d", leaderboard.rows_of([_res("dual-encoder", 1.0)]))
