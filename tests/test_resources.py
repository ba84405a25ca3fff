"""Memory guards (issue 37): check_memory refuses, naming the estimate, what is available and the
setting; the cgroup limit counts; stages refuse before allocating."""

from __future__ import annotations

import argparse
import logging

import numpy as np
import pytest
import scipy.sparse as sp

from xmc_steps import io, resources, xr_linear
from xmc_steps.cluster_tree import hierarchical_kmeans
from xmc_steps.errors import StageError
from xmc_steps.stages import cluster, label_embedding
from xmc_steps.stages import xr_linear as xr_linear_stage


@pytest.fixture
def tiny_memory(monkeypatch):
    """Pretend 1 MiB is available."""
    monkeypatch.setattr(resources, "available_memory", lambda: (1 << 20, "available on this machine"))


def test_check_memory_passes_what_fits_and_logs_it(caplog):
    log = logging.getLogger("xmc.test")
    with caplog.at_level(logging.INFO, logger="xmc.test"):
        resources.check_memory("a small block", 1024, "some.setting", log)
    assert "a small block needs about 1.0 KiB" in caplog.text


def test_check_memory_refuses_naming_estimate_available_and_setting(tiny_memory):
    with pytest.raises(StageError) as e:
        resources.check_memory("the 500,000 x 384 head", resources.dense_bytes(500_000, 384), "xtransformer.cluster.leaf_size")
    msg = str(e.value)
    assert "the 500,000 x 384 head needs about 732.4 MiB" in msg
    assert "1.0 MiB available on this machine" in msg and "change xtransformer.cluster.leaf_size" in msg


def test_the_check_can_be_turned_into_a_warning(tiny_memory, monkeypatch, caplog):
    monkeypatch.setenv("XMC_MEMORY_CHECK", "0")
    log = logging.getLogger("xmc.test")
    with caplog.at_level(logging.WARNING, logger="xmc.test"):
        resources.check_memory("a big block", 1 << 30, "some.setting", log)
    assert "change some.setting" in caplog.text


def test_the_fraction_keeps_room_for_the_rest(monkeypatch):
    monkeypatch.setattr(resources, "available_memory", lambda: (1000, "available on this machine"))
    resources.check_memory("x", 900, "s")
    with pytest.raises(StageError):
        resources.check_memory("x", 901, "s")
    monkeypatch.setenv("XMC_MEMORY_FRACTION", "0.5")
    with pytest.raises(StageError):
        resources.check_memory("x", 501, "s")


def test_sizes():
    assert resources.dense_bytes(10, 3) == 120 and resources.dense_bytes(10, 3, dtype=np.float64) == 240
    assert resources.csr_bytes(4, 10) == 10 * 8 + 5 * 8
    assert resources.adam_state_bytes(100) == 1600
    assert resources.human_bytes(512) == "512 B" and resources.human_bytes(3 << 30) == "3.0 GiB"


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_a_cgroup_limit_is_read(tmp_path, version):
    root, self_cg = tmp_path / "cg", tmp_path / "self_cgroup"
    if version == "v2":
        (root / "job").mkdir(parents=True)
        (root / "job" / "memory.max").write_text(f"{8 << 30}\n")
        (root / "job" / "memory.current").write_text(f"{3 << 30}\n")
        self_cg.write_text("0::/job\n")
    else:
        (root / "memory" / "job").mkdir(parents=True)
        (root / "memory" / "job" / "memory.limit_in_bytes").write_text(f"{8 << 30}\n")
        (root / "memory" / "job" / "memory.usage_in_bytes").write_text(f"{3 << 30}\n")
        self_cg.write_text("5:cpu,cpuacct:/job\n4:memory:/job\n")
    assert resources._cgroup_room(root, self_cg) == 5 << 30


def test_no_cgroup_limit_means_none(tmp_path):
    (tmp_path / "cg").mkdir()
    (tmp_path / "cg" / "memory.max").write_text("max\n")
    (tmp_path / "self").write_text("0::/\n")
    assert resources._cgroup_room(tmp_path / "cg", tmp_path / "self") is None
    assert resources.available_memory()[0] > 0


def _args(**kw) -> list[str]:
    out = []
    for k, v in kw.items():
        out += [f"--{k.replace('_', '-')}", *([v] if isinstance(v, str) else v)]
    return out + ["--no-tracking"]


def test_a_stage_refuses_before_allocating(tmp_path, tiny_memory):
    """PIFA of 2,000 labels x 5,000 features on dense-ish rows: the bound is far above 1 MiB; the stage
    stops with the setting named and writes nothing."""
    rng = np.random.default_rng(0)
    X = sp.random(400, 5000, density=0.2, format="csr", dtype=np.float32, random_state=0)
    Y = sp.csr_matrix((rng.random((400, 2000)) < 0.05).astype(np.float32))
    io.save_csr(tmp_path / "X.npz", X)
    io.save_csr(tmp_path / "Y.npz", Y)
    out = tmp_path / "emb.npz"
    with pytest.raises(StageError, match=r"label embedding \(up to\) needs about .* change tfidf\.max_features"):
        label_embedding.main(_args(features=str(tmp_path / "X.npz"), labels=str(tmp_path / "Y.npz"), out=str(out)))
    assert not out.exists()


def test_the_clustering_and_xr_linear_stages_refuse_too(tmp_path, tiny_memory):
    E = sp.random(20_000, 300, density=0.1, format="csr", dtype=np.float32, random_state=1)
    io.save_csr(tmp_path / "E.npz", E)
    with pytest.raises(StageError, match=r"clustering 20,000 labels needs .* change cluster\.label_embedding"):
        cluster.main(_args(label_emb=str(tmp_path / "E.npz"), out=str(tmp_path / "tree.npz")))
    # xr-linear: 5,000 documents, MAN candidates of a beam of 10 over 2-label leaves
    tree = hierarchical_kmeans(sp.random(64, 8, density=0.5, format="csr", random_state=2) + sp.eye(64, 8), 2, 2)
    tree.save(tmp_path / "tree.npz")
    X = sp.random(5000, 50, density=0.1, format="csr", dtype=np.float32, random_state=3)
    Y = sp.csr_matrix((np.arange(5000)[:, None] % 64 == np.arange(64)[None, :]).astype(np.float32))
    io.save_csr(tmp_path / "X.npz", X)
    io.save_csr(tmp_path / "Y.npz", Y)
    args = argparse.Namespace(features=[str(tmp_path / "X.npz")], labels=[str(tmp_path / "Y.npz")],
                              tree=str(tmp_path / "tree.npz"), out=str(tmp_path / "model"), log=None, record=None,
                              params="{}", no_tracking=True, dataset="", method="", rule="", config_hash="",
                              phase=None, threads=None)
    with pytest.raises(StageError, match=r"xr-linear training .* change xr_linear\.beam"):
        xr_linear_stage._train_cli(args)
    assert not (tmp_path / "model").exists()


def test_estimates_follow_the_shapes():
    """The estimates grow with what the settings control: the beam and the kept top-k."""
    tree = hierarchical_kmeans(sp.random(64, 8, density=0.5, format="csr", random_state=2) + sp.eye(64, 8), 2, 4)
    p10 = xr_linear.XRLinearParams.from_dict({"beam": 10})
    p20 = xr_linear.XRLinearParams.from_dict({"beam": 20})
    tfn = xr_linear.XRLinearParams.from_dict({"negatives": "tfn"})
    assert xr_linear.train_bytes(1000, 5000, tree, p20) > xr_linear.train_bytes(1000, 5000, tree, p10) > \
        xr_linear.train_bytes(1000, 5000, tree, tfn)
    assert xr_linear.predict_bytes(10_000, tree, 10, 100) > xr_linear.predict_bytes(10_000, tree, 10, 10)
    assert xr_linear.max_children(tree) >= 2


def test_the_neural_estimates_grow_with_their_settings():
    from xmc_steps import xtransformer

    assert xtransformer.matcher_bytes(10_000, 384, 8192, 32) > xtransformer.matcher_bytes(10_000, 384, 64, 32)
    # the K x d head with gradient and two moments, at least
    assert xtransformer.matcher_bytes(0, 384, 8192, 0) >= 4 * 8192 * 384 * 4
    assert xtransformer.ranker_bytes(10_000, 50_000, 384, 5000) > xtransformer.ranker_bytes(10_000, 50_000, 0, 5000)
    assert xtransformer.ranker_bytes(10_000, 50_000, 0, 0, topk=100) > xtransformer.ranker_bytes(10_000, 50_000, 0, 0)
