"""Ensemble combiners against hand-worked cases."""

import numpy as np
import pytest
import scipy.sparse as sp

from xmc_steps.ensemble import combine


def _m(rows, L=4):
    d = np.zeros((len(rows), L), np.float32)
    for i, r in enumerate(rows):
        for j, v in r.items():
            d[i, j] = v
    return sp.csr_matrix(d)


A = _m([{0: 0.9, 1: 0.5}])
B = _m([{1: 0.8, 2: 0.6}])


def test_average_counts_missing_as_zero():
    P = combine([A, B], "average").toarray()[0]
    assert P == pytest.approx([0.45, 0.65, 0.3, 0.0])


def test_rank_average_is_scale_free():
    # A: label 0 rank 0 -> 1, label 1 rank 1 -> 1 - 1/2 = 0.5; B: label 1 -> 1, label 2 -> 0.5
    P = combine([A * 100, B], "rank-average").toarray()[0]
    assert P == pytest.approx([0.5, 0.75, 0.25, 0.0])


def test_softmax_average():
    e = np.exp([0.0, -0.4])                  # A's softmax over (0.9, 0.5)
    sa = e / e.sum()
    e = np.exp([0.0, -0.2])                  # B's softmax over (0.8, 0.6)
    sb = e / e.sum()
    P = combine([A, B], "softmax-average").toarray()[0]
    assert P == pytest.approx([sa[0] / 2, (sa[1] + sb[0]) / 2, sb[1] / 2, 0.0], rel=1e-5)


def test_sigmoid_average_and_topk():
    s = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
    P = combine([A, B], "sigmoid-average", topk=2).toarray()[0]
    assert P[1] == pytest.approx((s(0.5) + s(0.8)) / 2, rel=1e-5)
    assert (P > 0).sum() == 2


def test_shape_mismatch_and_unknown_method():
    with pytest.raises(ValueError, match="differ in shape"):
        combine([A, _m([{0: 1.0}], L=5)])
    with pytest.raises(ValueError, match="unknown ensemble method"):
        combine([A], "median")


def test_the_stage_takes_the_method_under_the_config_s_name(tmp_path, capsys):
    """Every ensemble rule passes the method as ``ensemble`` (ELIAS's and the dual encoder's section key unchanged,
    X-Transformer's variant's and LightXML's ``lightxml.ensemble.method`` given under it): the one key; ``method``
    is an error naming it."""
    from xmc_steps import io
    from xmc_steps.stage import cli_main
    from xmc_steps.stages import ensemble as ensemble_stage

    io.write_table(tmp_path / "labels.parquet", {"label_id": ["a", "b", "c"]})
    paths = []
    for i, m in enumerate(([[0.9, 0.1, 0.0]], [[0.2, 0.7, 0.1]])):
        paths.append(str(tmp_path / f"m{i}.parquet"))
        io.write_predictions(paths[-1], sp.csr_matrix(np.array(m, np.float32)), 3)

    def run(params, name):
        argv = ["--predictions", *paths, "--label-table", str(tmp_path / "labels.parquet"),
                "--out", str(tmp_path / f"{name}.parquet"), "--no-tracking", "--params", params]
        return cli_main(ensemble_stage.main, argv)

    assert run('{"ensemble": "rank-average", "topk": 2}', "e") == 0
    assert run('{"ensemble": "average", "topk": 2}', "a") == 0
    e, a = (io.read_predictions(tmp_path / f"{n}.parquet", 3) for n in ("e", "a"))
    assert (e != a).nnz > 0                     # the key is read
    capsys.readouterr()
    assert run('{"method": "rank-average", "topk": 2}', "m") == 2
    assert "the ensemble's method is the parameter 'ensemble'" in capsys.readouterr().err
