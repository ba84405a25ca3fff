"""Synthetic Wiki-500K / Amazon-670K-shaped data: layout, statistics, learnable, seeded."""

import json

import numpy as np
import pytest

from xmc_steps import synth
from xmc_steps.stages import synth as synth_stage
from xmc_steps.datasets import locate


def _lines(p):
    return p.read_text(encoding="utf-8").splitlines()


def test_wiki500k_shape_at_a_small_fraction(tmp_path):
    out = tmp_path / "wiki500k-tiny"
    synth_stage.main(["--shape", "wiki500k", "--fraction", "0.0003", "--out", str(out), "--seed", "3"])
    info = json.loads((out / "synth.json").read_text())
    ids, texts = _lines(out / "label_ids.txt"), _lines(out / "label_texts.txt")
    assert len(ids) == len(texts) == 501_070 and len(set(ids)) == len(ids)       # every label, whatever the fraction
    train_t, train_l = _lines(out / "train_texts.txt"), _lines(out / "train_labels.txt")
    assert len(train_t) == len(train_l) == round(0.0003 * 1_779_881) == info["written"]["train"]["documents"]
    assert len(_lines(out / "test_texts.txt")) == round(0.0003 * 769_421)
    per_doc = [len(l.split()) for l in train_l]
    assert np.mean(per_doc) == pytest.approx(4.75, abs=0.35) and min(per_doc) >= 1
    assert np.mean([len(t.split()) for t in train_t]) == pytest.approx(800, rel=0.15)
    # the text depends on the labels: each document holds its labels' topic words
    by_id = dict(zip(ids, texts))
    for t, l in zip(train_t[:50], train_l[:50]):
        words = set(t.split())
        assert all(words & set(by_id[lab].split()) for lab in l.split())
    # a long tail: a few labels are frequent, most of those seen are seen once
    counts = np.unique(np.concatenate([l.split() for l in train_l]), return_counts=True)[1]
    assert counts.max() >= 20 and np.median(counts) == 1
    # the layout the pipeline reads
    files = locate("wiki500k-tiny", tmp_path)
    assert files.layout == "raw" and files.label_texts is not None


def test_same_seed_same_data_other_seed_other_data(tmp_path):
    shape = synth.SHAPES["amazon670k"]
    small = synth.Shape(**{**shape.__dict__, "n_labels": 5000, "vocab": 3000})
    a = synth.write(small, 0.0005, tmp_path / "a", seed=1)
    b = synth.write(small, 0.0005, tmp_path / "b", seed=1)
    c = synth.write(small, 0.0005, tmp_path / "c", seed=2)
    assert a["written"] == b["written"] and c["written"]
    for f in ("train_texts.txt", "train_labels.txt", "test_labels.txt", "label_texts.txt"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    assert (tmp_path / "a" / "train_labels.txt").read_bytes() != (tmp_path / "c" / "train_labels.txt").read_bytes()
    assert not list((tmp_path / "a").glob(".*.tmp"))
    with pytest.raises(Exception, match="fraction"):
        synth.write(small, 0.0, tmp_path / "d")
