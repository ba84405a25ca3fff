"""Parabel's one prediction path (issue 51): the predict stage and serving call parabel.serve.predict, its
PredictParams saved with the model (parabel.json) and overridden by the caller; older models fall back."""

import json

import numpy as np
import pytest
import scipy.sparse as sp

from xmc_steps import io

pytest.importorskip("omikuji")

from xmc_steps.parabel import model as pm  # noqa: E402
from xmc_steps.parabel.serve import PredictParams, predict  # noqa: E402
from xmc_steps.stages.parabel import main as parabel_main  # noqa: E402

L = 30


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A forest trained by the stage (beam 3, topk 7 in its section) on random data, and its inputs."""
    tmp = tmp_path_factory.mktemp("parabel")
    rng = np.random.default_rng(0)
    X = sp.random(200, 120, density=0.06, format="csr", dtype=np.float32, random_state=rng)
    X.data[:] = rng.random(X.nnz, dtype=np.float32) + 0.1
    Y = sp.csr_matrix((rng.random((200, L)) < 0.1).astype(np.float32))
    io.save_csr(tmp / "X.npz", X)
    io.save_csr(tmp / "Y.npz", Y)
    io.write_table(tmp / "labels.parquet", {"label_id": [f"l{i}" for i in range(L)]})
    parabel_main(["train", "--features", str(tmp / "X.npz"), "--labels", str(tmp / "Y.npz"), "--out", str(tmp / "model"),
                  "--params", json.dumps({"min_branch_size": 5, "beam": 3, "topk": 7, "threads": 1}), "--no-tracking"])
    return tmp, X


def _stage(tmp, model, params, name):
    parabel_main(["predict", "--model", str(model), "--features", str(tmp / "X.npz"), "--label-table",
                  str(tmp / "labels.parquet"), "--out", str(tmp / f"{name}.parquet"), "--params", json.dumps(params),
                  "--no-tracking"])
    return io.read_predictions(tmp / f"{name}.parquet", L)


def test_the_stage_predicts_with_the_saved_params_overridden_by_the_rules(trained):
    tmp, X = trained
    meta = io.read_json(tmp / "model" / pm.META)
    assert meta["predict"] == {"beam": 3, "topk": 7} and "threads" not in meta["params"]
    forest = pm.load(tmp / "model" / "omikuji", 1)
    # the rule's beam and topk (what the former stage used: the rule passes the whole section), else the saved ones
    for params, (topk, beam) in (({"beam": 4, "topk": 5}, (5, 4)), ({"topk": 6}, (6, 3)), ({}, (7, 3))):
        ref = pm.predict(forest, X, topk, beam, L)
        assert (_stage(tmp, tmp / "model", params, "p") != ref).nnz == 0, params
        r = predict(tmp / "model", X, L, params, forest)
        assert (r["scores"] != ref).nnz == 0 and r["params"] == PredictParams(beam=beam, topk=topk)


def test_a_model_saved_before_its_predict_params_falls_back_to_the_defaults(trained, tmp_path):
    import shutil

    tmp, X = trained
    shutil.copytree(tmp / "model", tmp_path / "old")
    (tmp_path / "old" / pm.META).unlink()
    forest = pm.load(tmp_path / "old" / "omikuji", 1)
    r = predict(tmp_path / "old", X, L, {"topk": 4})
    assert r["params"] == PredictParams(beam=pm.ParabelParams.beam, topk=4)
    assert (r["scores"] != pm.predict(forest, X, 4, pm.ParabelParams.beam, L)).nnz == 0
    assert (_stage(tmp, tmp_path / "old", {"beam": 2, "topk": 3}, "old") != pm.predict(forest, X, 3, 2, L)).nnz == 0
