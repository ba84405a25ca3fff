import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tiny_encoder import make_tiny_encoder, toy_tokens
from xmc_steps import encoders, neural, trainer

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    return make_tiny_encoder(tmp_path_factory.mktemp("tiny") / "bert")


# --------------------------------------------------------------------------- small pieces


def test_device_and_autocast_on_cpu():
    assert neural.resolve_device("cpu").type == "cpu"
    # auto: bf16 only where the CPU has it natively; off and fp16: fp32 on every CPU
    native = neural.cpu_has_bf16()
    assert neural.amp_dtype(torch.device("cpu"), "auto") is (torch.bfloat16 if native else None)
    assert neural.amp_dtype(torch.device("cpu"), "fp16") is None
    for amp in ("off", "fp32", False):
        assert neural.amp_dtype(torch.device("cpu"), amp) is None
    with neural.autocast_context("cpu", "off"):
        x = torch.ones(2, 2) @ torch.ones(2, 2)
    assert x.dtype == torch.float32
    with neural.autocast_context("cpu", "auto"):
        x = torch.ones(2, 2) @ torch.ones(2, 2)
    assert x.dtype == (torch.bfloat16 if native else torch.float32)
    # bf16 by name on any CPU; the weights stay fp32, the steps run
    assert neural.amp_dtype(torch.device("cpu"), "bf16") is torch.bfloat16
    with neural.autocast_context("cpu", "bf16"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    net = nn.Linear(4, 1)
    tr = trainer.Trainer(net, trainer.param_groups({"n": (net, 0.1)}), trainer.TrainParams(steps=3, warmup_steps=0,
                         batch_size=2), None, device="cpu", amp="bf16")
    X = torch.randn(6, 4)
    tr.fit(lambda m, b: (m(b).float().pow(2).mean(), {}), 6, lambda i: X[i])
    assert tr.step == 3 and net.weight.dtype == torch.float32
    assert isinstance(neural.cpu_has_bf16(), bool)
    with pytest.raises(ValueError):
        trainer.Trainer(nn.Linear(2, 1), trainer.param_groups({"n": (nn.Linear(2, 1), 0.1)}),
                        trainer.TrainParams(steps=1, warmup_steps=0), None, amp="fp8")


def test_train_params_json_roundtrip():
    p = trainer.TrainParams(steps=7, batch_size=3, grad_accum=2, lr=1e-4, warmup_steps=2, seed=5)
    q = trainer.TrainParams.from_dict(json.loads(json.dumps(p.to_dict())))
    assert q == p and q.is_resolved and q.resolved(10 ** 6) == p     # fixed counts stay as they are
    e = trainer.TrainParams(epochs=1.5, batch_size=4, grad_accum=2, warmup=0.25)
    assert not e.is_resolved
    r = e.resolved(100)
    assert (r.steps, r.warmup_steps) == (19, 5)                     # ceil(1.5 * 100 / 8), round(0.25 * 19)
    assert trainer.TrainParams(epochs=1.0).resolved(10).warmup_steps == 0   # neither warm-up key: none
    with pytest.raises(ValueError, match="epochs or steps"):
        trainer.TrainParams().resolved(10)
    with pytest.raises(ValueError, match="unknown"):
        trainer.TrainParams.from_dict({"stepz": 3})


def test_lr_schedule_warmup_then_linear_decay():
    f = [trainer.lr_factor(t, 4, 12) for t in range(13)]
    assert f[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert f[4] == pytest.approx(1.0)
    assert f[8] == pytest.approx(0.5)
    assert f[11] == pytest.approx(1 / 8) and f[12] == 0.0
    assert trainer.lr_factor(0, 0, 10) == 1.0

    # the trainer applies it: the lr used at step t (1-based) is lr * lr_factor(t - 1)
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    params = trainer.TrainParams(steps=12, batch_size=4, lr=0.1, warmup_steps=4, log_every=1)
    seen = {}
    tr = trainer.Trainer(model, trainer.param_groups({"all": (model, 0.1)}), params, None, device="cpu",
                        on_step=lambda s, logs: seen.__setitem__(s, logs["lr_all"]))
    X = torch.randn(10, 3)
    tr.fit(lambda m, b: (m(b).pow(2).mean(), {}), 10, lambda idx: X[idx])
    assert [seen[s] for s in range(1, 13)] == pytest.approx([0.1 * x for x in f[:12]])


def test_param_groups_no_decay_on_bias_and_layernorm():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    head = nn.Linear(2, 2)
    groups = trainer.param_groups({"encoder": (model, 1e-4), "head": (head, 1e-2)}, weight_decay=0.05)
    by_name = {g["name"]: g for g in groups}
    assert set(by_name) == {"encoder", "encoder.no_decay", "head", "head.no_decay"}
    ids = lambda ps: {id(p) for p in ps}  # noqa: E731
    assert ids(by_name["encoder"]["params"]) == {id(model[0].weight), id(model[2].weight)}
    assert ids(by_name["encoder.no_decay"]["params"]) == {id(model[0].bias), id(model[1].weight), id(model[1].bias),
                                                          id(model[2].bias)}
    assert by_name["encoder"]["weight_decay"] == 0.05 and by_name["encoder.no_decay"]["weight_decay"] == 0.0
    assert by_name["head"]["lr"] == 1e-2 and by_name["encoder"]["lr"] == 1e-4
    with pytest.raises(ValueError, match="already"):
        trainer.param_groups({"a": (model, 1e-3), "b": (model[0], 1e-3)})


def test_token_data_batches_are_trimmed(tmp_path):
    ids = np.array([[101, 5, 6, 102, 0, 0], [101, 7, 102, 0, 0, 0], [101, 102, 0, 0, 0, 0]], dtype=np.int32)
    from xmc_steps import io

    io.save_arrays(tmp_path / "t.npz", input_ids=ids, lengths=np.array([4, 3, 2], dtype=np.int32))
    td = neural.TokenData.load(tmp_path / "t.npz")
    i, m = td.batch([1, 2])
    assert i.dtype == torch.long and m.dtype == torch.long
    assert i.tolist() == [[101, 7, 102], [101, 102, 0]]
    assert m.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert td.batch([0])[0].shape == (1, 4)


def test_text_encoder_poolings_and_embed(tiny):
    assert encoders.resolve(tiny).is_dir()
    tok = encoders.load_tokenizer(tiny)
    enc_ids = tok(["a short text", "another, slightly longer text here"], padding=True, return_tensors="pt")
    for pooling, dim in (("cls", 32), ("mean", 32), ("cls-concat-last-k", 64)):
        e = neural.TextEncoder(tiny, pooling=pooling, last_k=2).eval()
        assert e.dim == dim
        with torch.no_grad():
            out = e(enc_ids["input_ids"], enc_ids["attention_mask"])
        assert out.shape == (2, dim)
    with pytest.raises(ValueError, match="layers"):
        neural.TextEncoder(tiny, pooling="cls-concat-last-k", last_k=3)
    e = neural.TextEncoder(tiny, pooling="mean").eval()
    ids, lengths, _ = toy_tokens(13, 12, 3)
    td = neural.TokenData(ids, lengths)
    emb = neural.embed(e, td, batch_size=4, device="cpu", amp="off", progress=None)
    assert emb.shape == (13, 32) and emb.dtype == np.float32
    with torch.no_grad():  # rows come back in the original order, padding does not matter
        one = e(*td.batch([7])).numpy()[0]
    np.testing.assert_allclose(emb[7], one, atol=1e-5)
    # the default precision (bf16 on a CPU with native bf16) stays close to fp32 and comes back as float32
    auto = neural.embed(e, td, batch_size=4, device="cpu", progress=None)
    assert auto.dtype == np.float32
    np.testing.assert_allclose(auto, emb, atol=0.05)


# --------------------------------------------------------------------------- checkpoints


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 16)
        self.drop = nn.Dropout(0.3)  # consumes the torch RNG: resume must restore it
        self.norm = nn.LayerNorm(16)
        self.b = nn.Linear(16, 1)

    def forward(self, x):
        return self.b(self.norm(self.drop(torch.relu(self.a(x)))))


def _fit(ckpt, on_step=None, steps=10):
    torch.manual_seed(0)
    net = _Net()
    X, y = torch.randn(23, 6, generator=torch.Generator().manual_seed(1)), torch.randn(23, 1)
    p = trainer.TrainParams(steps=steps, batch_size=5, grad_accum=2, lr=1e-2, warmup_steps=2, checkpoint_every=100,
                           log_every=1, seed=3)
    tr = trainer.Trainer(net, trainer.param_groups({"net": (net, 1e-2)}), p, ckpt, on_step=on_step, device="cpu")

    def loss_fn(m, b):
        err = m(b[0]) - b[1]
        return err.pow(2).mean(), {"mae": float(err.detach().abs().mean())}

    tr.fit(loss_fn, len(X), lambda idx: (X[idx], y[idx]))
    return tr


@pytest.mark.slow
def test_sigterm_checkpoints_current_step_then_resume_matches(tmp_path):
    ref = _fit(tmp_path / "ref")
    assert [s for s, _ in trainer.list_checkpoints(tmp_path / "ref")] == [10]  # final checkpoint only

    def kill_at_4(step, logs):
        if step == 4:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(trainer.Preempted) as exc:
        _fit(tmp_path / "run", on_step=kill_at_4)
    assert exc.value.code == 143 and exc.value.step == 4
    ck = trainer.list_checkpoints(tmp_path / "run")
    assert [s for s, _ in ck] == [4]
    state = torch.load(ck[0][1] / "trainer.pt", weights_only=True)
    assert state["step"] == 4 and state["scheduler"]["last_epoch"] == 4
    assert state["wall"] >= state["time"] > 0            # the process's wall time up to the checkpoint
    assert signal.getsignal(signal.SIGTERM) is not None  # handler restored

    tr = _fit(tmp_path / "run")
    assert tr.resumed_from == 4 and tr.steps_this_run == 6 and tr.step == 10
    assert tr.wall_before == state["wall"] and tr.wall_s > state["wall"]
    for k, v in ref.model.state_dict().items():
        torch.testing.assert_close(tr.model.state_dict()[k], v, rtol=0, atol=1e-6)


def test_trainer_counts_wall_time_from_its_stages_start(tmp_path):
    """Inside a stage the trainer's wall time runs from the stage's start (work before the first
    step, such as a linear start, counts towards a resumed stage's time); outside, from itself."""
    import argparse
    import time

    from xmc_steps import stage

    assert stage.started_at() is None
    net = nn.Linear(2, 1)
    p = trainer.TrainParams(steps=1, batch_size=4, lr=1e-2, warmup_steps=0)
    with stage.stage_run("unit", argparse.Namespace(log=None, record=None, params="{}", no_tracking=True)) as st:
        assert stage.started_at() == st.t0
        time.sleep(0.05)
        tr = trainer.Trainer(net, trainer.param_groups({"n": (net, 1e-2)}), p, None, device="cpu")
        assert tr.wall_s >= 0.05
    assert stage.started_at() is None
    t0 = time.perf_counter()                # outside a stage the clock starts with the trainer, not before:
    wall = trainer.Trainer(net, trainer.param_groups({"n": (net, 1e-2)}), p, None, device="cpu").wall_s
    assert wall <= time.perf_counter() - t0  # (bounded by the time it took, however slow the machine)


def test_checkpoints_keep_newest_two_and_other_config_is_not_resumed(tmp_path):
    torch.manual_seed(0)
    net = nn.Linear(2, 1)
    X = torch.randn(8, 2)
    p = trainer.TrainParams(steps=7, batch_size=4, lr=1e-2, warmup_steps=0, checkpoint_every=2)
    tr = trainer.Trainer(net, trainer.param_groups({"n": (net, 1e-2)}), p, tmp_path, device="cpu")
    tr.fit(lambda m, b: (m(b).pow(2).mean(), {}), 8, lambda i: X[i])
    assert [s for s, _ in trainer.list_checkpoints(tmp_path)] == [6, 7]
    assert not list(tmp_path.glob(".tmp-*"))
    p2 = trainer.TrainParams(steps=9, batch_size=4, lr=1e-2, warmup_steps=0, checkpoint_every=2)
    tr2 = trainer.Trainer(nn.Linear(2, 1), trainer.param_groups({"n": (nn.Linear(2, 1), 1e-2)}), p2, tmp_path, device="cpu")
    assert tr2.resumed_from is None and tr2.step == 0
    assert trainer.list_checkpoints(tmp_path) == []  # set aside, with a warning


def test_checkpoint_of_an_earlier_version_without_schedule_resumes(tmp_path):
    """A checkpoint written before ``schedule`` existed had the linear schedule: it still resumes;
    the same checkpoint under ``schedule: constant`` is another trajectory and is set aside."""
    net = nn.Linear(2, 1)
    X = torch.randn(8, 2)
    p = trainer.TrainParams(steps=4, batch_size=4, lr=1e-2, warmup_steps=0, checkpoint_every=2)
    trainer.Trainer(net, trainer.param_groups({"n": (net, 1e-2)}), p, tmp_path, device="cpu").fit(
        lambda m, b: (m(b).pow(2).mean(), {}), 8, lambda i: X[i])
    for _, path in trainer.list_checkpoints(tmp_path):
        state = torch.load(path / "trainer.pt", weights_only=True)
        del state["params"]["schedule"]
        torch.save(state, path / "trainer.pt")
    same = trainer.TrainParams(steps=4, batch_size=4, lr=1e-2, warmup_steps=0, checkpoint_every=2)
    tr = trainer.Trainer(nn.Linear(2, 1), trainer.param_groups({"n": (nn.Linear(2, 1), 1e-2)}), same, tmp_path,
                         device="cpu")
    assert tr.resumed_from == 4
    const = trainer.TrainParams(steps=4, batch_size=4, lr=1e-2, warmup_steps=0, checkpoint_every=2, schedule="constant")
    tr = trainer.Trainer(nn.Linear(2, 1), trainer.param_groups({"n": (nn.Linear(2, 1), 1e-2)}), const, tmp_path,
                         device="cpu")
    assert tr.resumed_from is None

@pytest.mark.slow
def test_sigkill_then_restart_ends_like_an_uninterrupted_run(tiny, tmp_path):
    script = str(HERE / "tiny_encoder.py")
    base = [sys.executable, script, "train", "--encoder", tiny, "--steps", "30", "--checkpoint-every", "5"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    ref = subprocess.Popen(base + ["--ckpt", str(tmp_path / "ref_ck"), "--out", str(tmp_path / "ref.safetensors")],
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    run = base + ["--ckpt", str(tmp_path / "ck"), "--out", str(tmp_path / "run.safetensors")]
    victim = subprocess.Popen(run + ["--sleep", "0.15"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while time.time() < deadline and victim.poll() is None:
        if trainer.list_checkpoints(tmp_path / "ck"):
            break
        time.sleep(0.02)
    killed_at = max([s for s, _ in trainer.list_checkpoints(tmp_path / "ck")] or [0])
    victim.send_signal(signal.SIGKILL)
    assert victim.wait(30) == -signal.SIGKILL
    assert 5 <= killed_at < 30 and not (tmp_path / "run.safetensors").exists()

    again = subprocess.run(run, env=env, capture_output=True, text=True, timeout=1200)
    assert again.returncode == 0, again.stderr[-2000:]
    assert ref.wait(1200) == 0, ref.stderr.read().decode()[-2000:]
    r = json.loads((tmp_path / "ref.safetensors.json").read_text())
    a = json.loads((tmp_path / "run.safetensors.json").read_text())
    assert r["step"] == r["scheduler_steps"] == 30 and r["adam_steps"] == [30] and r["resumed_from"] is None
    assert a["step"] == a["scheduler_steps"] == 30 and a["adam_steps"] == [30]
    assert a["resumed_from"] >= killed_at and a["steps_this_run"] == 30 - a["resumed_from"]
    from safetensors.torch import load_file

    wr, wa = load_file(str(tmp_path / "ref.safetensors")), load_file(str(tmp_path / "run.safetensors"))
    assert wr.keys() == wa.keys()
    for k in wr:
        torch.testing.assert_close(wa[k], wr[k], rtol=0, atol=1e-6)


def test_bucket_by_length_is_a_permutation_of_length_sorted_batches():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 65, size=1000)
    order = rng.permutation(1000)
    out = trainer.bucket_by_length(order, lengths, batch_size=32, window=5, rng=np.random.default_rng(1))
    assert sorted(out.tolist()) == list(range(1000))
    # every full batch comes from one window and is sorted by length: small spread inside a batch
    spread = [np.ptp(lengths[out[a:a + 32]]) for a in range(0, 32 * 30, 32)]
    assert np.mean(spread) < 0.25 * np.ptp(lengths)
    # windows keep the epoch's order: the first window's examples come first
    assert set(out[:160].tolist()) == set(order[:160].tolist())


def test_length_bucket_without_lengths_is_an_error():
    """A loop given ``length_bucket`` but no lengths would train on random batches without a word."""
    net = _Net()
    p = trainer.TrainParams(steps=2, batch_size=4, lr=1e-2, length_bucket=5)
    with pytest.raises(ValueError, match="length_bucket"):
        trainer.Trainer(net, trainer.param_groups({"net": (net, 1e-2)}), p.resolved(8), None, device="cpu")
    trainer.Trainer(net, trainer.param_groups({"net": (net, 1e-2)}), p.resolved(8), None, device="cpu",
                    lengths=np.arange(8))


def test_xlnet_pools_its_summary_token_at_the_end(tmp_path):
    """XLNet's tokenizer ends a text with <sep> <cls>; rows are right-padded, so "cls" pooling
    (and every layer of cls-concat-last-k) must read position length - 1, not the first word piece."""
    from transformers import XLNetConfig, XLNetModel

    torch.manual_seed(0)
    XLNetModel(XLNetConfig(vocab_size=120, d_model=16, n_layer=2, n_head=2, d_inner=32)).save_pretrained(
        str(tmp_path / "xlnet"), safe_serialization=True)
    ids = torch.randint(5, 120, (3, 7))
    mask = (torch.arange(7)[None, :] < torch.tensor([[7], [4], [2]])).long()
    ids = ids * mask                                            # pad id 0 on the right
    enc = neural.TextEncoder(str(tmp_path / "xlnet"), pooling="cls", pretrained=True).eval()
    assert enc.describe()["summary_token"] == "last"
    with torch.no_grad():
        h = enc.model(input_ids=ids, attention_mask=mask).last_hidden_state
        got = enc(ids, mask)
        assert torch.allclose(got, torch.stack([h[0, 6], h[1, 3], h[2, 1]]))
        assert not torch.allclose(got, h[:, 0])
        cat = neural.TextEncoder(str(tmp_path / "xlnet"), pooling="cls-concat-last-k", last_k=2).eval()
        hs = cat.model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        assert torch.allclose(cat(ids, mask)[:, :16], got) and torch.allclose(cat(ids, mask)[2, 16:], hs[-2][2, 1])


# --------------------------------------------------------------------------- prefetching, logging, profiling


def _recorded_fit(prefetch, steps=9, ckpt=None, on_step=None, log_tensor=True):
    """A tiny regression trained with ``prefetch`` micro-batches built ahead; returns the trainer,
    the indices batch_fn was called with (in call order) and the batches the loss saw (in order)."""
    torch.manual_seed(0)
    net = _Net()
    X, y = torch.randn(23, 6, generator=torch.Generator().manual_seed(1)), torch.randn(23, 1)
    p = trainer.TrainParams(steps=steps, batch_size=5, grad_accum=2, lr=1e-2, warmup_steps=2, checkpoint_every=100,
                           log_every=3, seed=3, length_bucket=2)
    lengths = np.arange(23) % 7
    tr = trainer.Trainer(net, trainer.param_groups({"net": (net, 1e-2)}), p, ckpt, on_step=on_step, device="cpu",
                         prefetch=prefetch, lengths=lengths)
    built, seen = [], []

    def batch_fn(idx):
        built.append(np.asarray(idx).tolist())
        return torch.as_tensor(np.asarray(idx)), X[idx], y[idx]

    def loss_fn(m, b):
        seen.append(b[0].tolist())
        err = m(b[1]) - b[2]
        mae = err.detach().abs().mean()
        return err.pow(2).mean(), {"mae": mae if log_tensor else float(mae)}

    tr.fit(loss_fn, len(X), batch_fn)
    return tr, built, seen


def test_prefetch_gives_the_same_batches_in_the_same_order_and_the_same_weights():
    ref, built0, seen0 = _recorded_fit(prefetch=0)
    for depth in (1, 2, 5):
        tr, built, seen = _recorded_fit(prefetch=depth)
        assert seen == seen0 and built == built0          # the same micro-batches, in the same order
        assert len(built) == 9 * 2                         # none built past the last step
        assert (tr.epoch, tr.pos) == (ref.epoch, ref.pos)
        for k, v in ref.model.state_dict().items():
            assert torch.equal(tr.model.state_dict()[k], v), k   # bit for bit


def test_logged_tensors_are_read_at_the_interval_as_the_floats_were():
    """Logs given as tensors reach on_step as floats, with the same means as logs given as floats."""
    got = {}
    _recorded_fit(prefetch=2, on_step=lambda s, lg: got.setdefault("t", {}).__setitem__(s, lg))
    _recorded_fit(prefetch=0, on_step=lambda s, lg: got.setdefault("f", {}).__setitem__(s, lg), log_tensor=False)
    assert sorted(got["t"]) == sorted(got["f"]) == [3, 6, 9]
    for s in (3, 6, 9):
        a, b = got["t"][s], got["f"][s]
        assert set(a) == set(b) and all(isinstance(v, float) for v in a.values())
        for k in ("loss", "mae", "grad_norm", "lr_net"):
            assert a[k] == pytest.approx(b[k], rel=1e-6), k


def test_non_finite_loss_is_still_reported_with_its_step(caplog):
    net = nn.Linear(2, 1)
    X = torch.randn(8, 2)
    p = trainer.TrainParams(steps=4, batch_size=4, lr=1e-2, warmup_steps=0, log_every=2, max_grad_norm=0)
    tr = trainer.Trainer(net, trainer.param_groups({"n": (net, 1e-2)}), p, None, device="cpu")
    calls = []

    def loss_fn(m, b):
        calls.append(1)
        out = m(b).pow(2).mean()
        return (out * float("nan") if len(calls) == 3 else out), {}

    with caplog.at_level("WARNING", logger="xmc.trainer"):
        tr.fit(loss_fn, 8, lambda i: X[i])
    assert "non-finite loss at step 3" in caplog.text


def test_prefetched_run_preempted_resumes_bit_for_bit(tmp_path):
    """SIGTERM with batches in flight: the checkpoint names the first batch not trained on (as
    without prefetching), and the resumed run ends with the uninterrupted run's weights."""
    ref, _, seen_ref = _recorded_fit(prefetch=2, steps=9, ckpt=tmp_path / "ref")

    def kill_at_4(step, logs):  # logs at steps 3, 6, 9: stop after step 6 finishes
        if step == 6:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(trainer.Preempted):
        _recorded_fit(prefetch=3, steps=9, ckpt=tmp_path / "run", on_step=kill_at_4)
    state = torch.load(trainer.list_checkpoints(tmp_path / "run")[-1][1] / "trainer.pt", weights_only=True)
    cut, _, _ = _recorded_fit(prefetch=0, steps=6)
    assert state["step"] == 6 and (state["epoch"], state["pos"]) == (cut.epoch, cut.pos)
    tr, _, seen = _recorded_fit(prefetch=2, steps=9, ckpt=tmp_path / "run")
    assert tr.resumed_from == 6 and seen == seen_ref[12:]
    for k, v in ref.model.state_dict().items():
        assert torch.equal(tr.model.state_dict()[k], v), k


def test_prefetch_error_reaches_the_loop():
    net = nn.Linear(2, 1)
    p = trainer.TrainParams(steps=3, batch_size=2, lr=1e-2, warmup_steps=0)
    tr = trainer.Trainer(net, trainer.param_groups({"n": (net, 1e-2)}), p, None, device="cpu", prefetch=2)

    def batch_fn(idx):
        raise KeyError("no such batch")

    with pytest.raises(KeyError, match="no such batch"):
        tr.fit(lambda m, b: (m(b).sum(), {}), 4, batch_fn)


def test_weight_average_count_survives_a_state_dict_round_trip():
    net = nn.Linear(3, 2)
    swa = trainer.WeightAverage(net)
    swa.update(net)
    with torch.no_grad():
        net.weight.add_(1.0)
    swa.update(net)
    assert swa.count() == 2 and int(swa.n) == 2
    other = trainer.WeightAverage(net)
    other.load_state_dict(swa.state_dict())
    assert other.count() == 2
    other.update(net)
    assert int(other.n) == 3 and other.count() == 3


def test_step_profiler_splits_the_steps_by_phase():
    net = nn.Linear(4, 1)
    X = torch.randn(16, 4)
    p = trainer.TrainParams(steps=5, batch_size=4, lr=1e-2, warmup_steps=0)
    prof = trainer.StepProfiler("cpu", detailed=True, warmup=2)
    with trainer.profiling(prof):
        tr = trainer.Trainer(net, trainer.param_groups({"n": (net, 1e-2)}), p, None, device="cpu")
    assert trainer.Trainer(net, trainer.param_groups({"n": (net, 1e-2)}), p, None, device="cpu").profiler is None
    tr.fit(lambda m, b: (m(b).pow(2).mean(), {}), 16, lambda i: X[i])
    assert prof.steps == 5 and prof.timed_steps == 3 and len(prof.durations) == 3
    assert set(prof.split_ms()) == {"batch", "forward_backward", "optimizer", "rest"}
    assert all(v >= 0 for v in prof.split_ms().values()) and prof.step_ms() >= 0


class HostReads(TorchDispatchMode):
    """Records the ops that make the host wait for a CUDA device (recorded on the CPU the same way):
    scalar reads (``float()``, ``int()``, ``bool()``, ``.item()``), ops whose output size depends on
    the values (nonzero, masked_select, unique, bincount, repeat_interleave without a size) and
    boolean-mask indexing."""

    READS = ("_local_scalar_dense", "nonzero", "masked_select", "_unique", "unique_", "bincount", "repeat_interleave")

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.paused:
            return func(*args, **(kwargs or {}))
        name = str(func)
        flat = [a for x in args for a in (x if isinstance(x, (list, tuple)) else [x])]
        if any(r in name for r in self.READS) or (
                "index.Tensor" in name and any(isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in flat)):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def test_trainer_steps_read_nothing_back_between_log_lines():
    """The loop itself (tensor logs, the loss, the gradient norm, the schedule, clipping) makes the
    host wait for the device only at the logging interval: here (CPU) not at all within the steps."""
    torch.manual_seed(0)
    net = _Net()
    X, y = torch.randn(40, 6), torch.randn(40, 1)
    p = trainer.TrainParams(steps=6, batch_size=5, grad_accum=2, lr=1e-2, warmup_steps=2, log_every=3)
    tr = trainer.Trainer(net, trainer.param_groups({"net": (net, 1e-2)}), p, None, device="cpu", prefetch=0)

    def loss_fn(m, b):
        err = m(b[0]) - b[1]
        return err.pow(2).mean(), {"mae": err.detach().abs().mean()}

    reads = HostReads()
    real = tr.optimizer.step

    def opt_step(*a, **k):   # AdamW's step counts are host tensors: its CPU loop reads them (the fused CUDA one not)
        reads.paused = True
        try:
            return real(*a, **k)
        finally:
            reads.paused = False

    opt_step._wrapped_by_lr_sched = True   # (the schedule's own wrapper is inside real)
    tr.optimizer.step = opt_step
    with reads:
        tr.fit(loss_fn, len(X), lambda idx: (X[idx], y[idx]))
    assert tr.step == 6 and reads.ops == []
