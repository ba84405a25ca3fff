"""The LightXML training driver: Eq. 6 end to end on the shared :class:`~xmc_steps.trainer.Trainer`,
with the paper's weight averaging and periodic validation."""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Mapping, Protocol

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn

from .. import distributed, metrics, neural
from ..neural_stage import valid_subset
from ..cluster_tree import assignment_matrix
from .. import resources
from ..linear_start import least_squares_bytes, least_squares_head
from ..trainer import Trainer, WeightAverage, digest, list_checkpoints, param_groups
from .model import LightXMLModel, predict
from .params import LightXMLParams


class _TrainBox(nn.Module):
    """What a checkpoint holds: the model, its weight average and, for static negatives, the
    clusters drawn once for every training text (``static_top``, ``-1`` until drawn)."""

    def __init__(self, model: LightXMLModel, swa: WeightAverage | None, n_static: int = 0, guide_state: bool = False):
        super().__init__()
        self.lightxml = model
        self.swa = swa
        self.register_buffer("static_top", torch.full((n_static, model.topb if n_static else 0), -1, dtype=torch.long))
        # valid P@1 and P@5 of the linear start before the first step (-1: none measured), kept for the guard
        self.register_buffer("start_valid", torch.full((2,), -1.0, dtype=torch.float64))
        if guide_state:   # what a guide that ``needs_start`` measured on the start (NaN: not yet)
            self.register_buffer("guide_state", torch.full((1,), float("nan"), dtype=torch.float64))


@torch.no_grad()
def draw_top_clusters(model: LightXMLModel, tokens: neural.TokenData, batch_size: int, device: torch.device | str,
                      amp: str = "auto", progress: Callable[..., Any] | None = None) -> np.ndarray:
    """The generator's top-``topb`` clusters for every text (``N x b``), in eval mode (no dropout)."""
    out = np.zeros((len(tokens), model.topb), dtype=np.int64)
    fn = lambda ids, mask: model.top_clusters(model.generator(model.represent(ids, mask)))  # noqa: E731
    for idx, top in neural.run_inference(fn, model, tokens, batch_size, device, amp, progress, what="static negatives"):
        out[idx] = top.cpu().numpy()
    return out


def cluster_targets(model: LightXMLModel, Y: sp.spmatrix) -> sp.csr_matrix:
    """The generator's targets (``N x K``): the labels themselves when flat, else each text's clusters."""
    Y = sp.csr_matrix(Y)
    if model.flat:
        return Y
    return sp.csr_matrix(Y @ assignment_matrix(model.cluster_of.cpu().numpy(), model.n_clusters))


def _fit_generator(model: LightXMLModel, emb: np.ndarray, Y: sp.spmatrix, params: LightXMLParams) -> None:
    """The generator's ``W_g, b_g`` := the ridge fit of its targets (``+-head_init_scale``) on the
    encoder's representations ``emb`` of the training texts (:func:`xmc_steps.linear_start.least_squares_head`)."""
    W, b = least_squares_head(emb, cluster_targets(model, Y), params.head_init_l2, params.head_init_scale, bias=True)
    with torch.no_grad():
        model.generator.weight.copy_(torch.from_numpy(W).to(model.generator.weight.device))
        model.generator.bias.copy_(torch.from_numpy(b).to(model.generator.bias.device))


#: labels solved for at a time in the discriminator's start (a ``hidden x chunk`` float64 block)
_LABEL_CHUNK = 65536


def bottleneck_features(model: LightXMLModel, emb: np.ndarray, batch_size: int = 4096) -> np.ndarray:
    """``act(W_h e + b_h)`` of Eq. 4 for representations ``emb`` (``N x D``, no dropout): ``N x hidden``."""
    dev = model.bottleneck.weight.device
    out = np.empty((emb.shape[0], model.hidden), dtype=np.float32)
    with torch.no_grad():
        for a in range(0, emb.shape[0], batch_size):
            h = model.bottleneck(torch.from_numpy(np.asarray(emb[a:a + batch_size], dtype=np.float32)).to(dev))
            if model.bottleneck_kind == "sigmoid":
                h = torch.sigmoid(h)
            out[a:a + batch_size] = h.float().cpu().numpy()
    return out


def _fit_discriminator(model: LightXMLModel, emb: np.ndarray, Y: sp.spmatrix, params: LightXMLParams) -> None:
    """``discriminator_init: linear``: the label embeddings ``E`` := the ridge fit of every label's
    targets (``+-head_init_scale`` over all training texts) on the bottleneck's features ``h`` of
    ``emb``, the bottleneck ``W_h, b_h`` staying as drawn (:func:`bottleneck_features`).

    The fit has an intercept (on the centred features, as the generator's), which Eq. 4 has no place
    for: it is carried along the features' mean ``mu``, ``E_l = W_l + b_l mu / ||mu||^2``, so that
    ``E_l . h = W_l . h + b_l (mu . h) / ||mu||^2``, exactly the fit's score at ``h = mu`` and close to it
    around: a text's features vary little along their mean (sigmoid features sit near 0.5, and the
    pre-trained representations share most of their direction: mean pairwise cosine 0.97 for
    MiniLM on yso-finna-sv-50k).  Without it, the uncentred features' common level dominates the
    ridge's scale (``head_init_l2`` is relative to the mean eigenvalue) and the labels' differences
    drown."""
    H = bottleneck_features(model, emb)
    W, b = least_squares_head(H, Y, params.head_init_l2, params.head_init_scale, bias=True, chunk=_LABEL_CHUNK)
    mu = H.mean(axis=0).astype(np.float64)
    m2 = float(mu @ mu)
    if m2 > 1e-12:
        for a in range(0, W.shape[0], _LABEL_CHUNK):
            W[a:a + _LABEL_CHUNK] += np.outer(b[a:a + _LABEL_CHUNK] / m2, mu).astype(np.float32)
    with torch.no_grad():
        model.label_emb.weight.copy_(torch.from_numpy(W).to(model.label_emb.weight.device))


def linear_start(model: LightXMLModel, tokens: neural.TokenData, Y: sp.spmatrix, params: LightXMLParams,
                 device: torch.device | str, log: logging.Logger) -> None:
    """``head_init: linear``: the generator's ``W_g, b_g`` from the least-squares fit of its targets
    (``+-head_init_scale``) on the pre-trained encoder's representations of the training texts (eval
    mode: no dropout), :func:`xmc_steps.linear_start.least_squares_head`; ``discriminator_init:
    linear`` (clustered models): the label embeddings from the same kind of fit on the bottleneck's
    features of those representations (:func:`_fit_discriminator`).  One pass over the texts for both."""
    t0 = time.perf_counter()
    emb = neural.embed(model.encoder, tokens, params.eval_batch_size, device, params.amp, progress=log.info)
    done = []
    if params.head_init == "linear":
        _fit_generator(model, emb, Y, params)
        done.append("generator")
    if params.discriminator_init == "linear" and not model.flat:
        _fit_discriminator(model, emb, Y, params)
        done.append(f"discriminator ({model.n_labels} label embeddings on the {model.hidden} bottleneck features)")
    log.info("%s initialised by least squares on the pre-trained representations (l2 %g, targets +-%g) in %.1f s",
             " and ".join(done) or "nothing", params.head_init_l2, params.head_init_scale, time.perf_counter() - t0)


def refit_generator(model: LightXMLModel, tokens: neural.TokenData, Y: sp.spmatrix,
                    valid: tuple[neural.TokenData, sp.spmatrix], params: LightXMLParams,
                    device: torch.device | str, log: logging.Logger, emb: np.ndarray | None = None) -> dict[str, Any]:
    """``head_refit``: the generator re-fit as the linear start is fit (:func:`linear_start`), on the
    *fine-tuned* encoder's representations of the training texts, and kept when the model's valid P@1
    is higher with it than with the trained generator; a clustered model then also tries its label
    embeddings re-fit on the trained bottleneck's features (:func:`_fit_discriminator`, the same pass
    over the texts), kept when that is higher still.  Returns ``{"trained": P@1, "refit": P@1 (the
    generator re-fit), "refit_discriminator": P@1 (both re-fit; clustered only), "kept": "trained" |
    "refit" | "refit_discriminator", "metrics": the kept model's valid metrics}`` (the stage's final
    validation, not computed again).

    Why: on yso-finna-sv-50k (18,056 labels, flat) fine-tuning from the linear start loses it (valid
    P@1 0.129 -> 0.000 after 200-400 steps), yet the fine-tuned encoder is not worse: a least-squares
    generator on its representations of 12,000 training texts reaches P@1 0.082, against 0.073 for
    the same fit on the pre-trained encoder.  The joint BCE moves the encoder faster than the
    generator (at ``lr_generator``) can follow over thousands of rare labels; the closed form catches
    the generator up, as the X-Transformer matcher's ``head_refit`` does for its head.
    A clustered model's discriminator drifts the same way (yso-finna-sv-50k clustered: xmc_steps/lightxml,
    "The clustered start").  ``emb``: those representations when already computed (the stage's pass shared
    by the ranks, :func:`xmc_steps.neural_stage.sharded_embed`)."""
    t0 = time.perf_counter()
    was_training = model.training
    model.eval()
    m = {"trained": valid_metrics(model, valid[0], valid[1], params, device)}
    trained = {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith(("generator.", "label_emb."))}
    if emb is None:
        emb = neural.embed(model.encoder, tokens, params.eval_batch_size, device, params.amp, progress=log.info)
    _fit_generator(model, emb, Y, params)
    m["refit"] = valid_metrics(model, valid[0], valid[1], params, device)
    if not model.flat:      # on top of the re-fit generator, the label embeddings re-fit too
        _fit_discriminator(model, emb, Y, params)
        m["refit_discriminator"] = valid_metrics(model, valid[0], valid[1], params, device)
    best = max(m, key=lambda k: (m[k]["p_at_1"], k == "trained"))   # a tie keeps what training gave
    restore = {"trained": ("generator.", "label_emb."), "refit": ("label_emb.",), "refit_discriminator": ()}[best]
    sd = model.state_dict()
    for k, v in trained.items():
        if restore and k.startswith(restore):
            sd[k].copy_(v)
    model.train(was_training)
    log.info("generator%s: valid P@1 %.4f as trained, %.4f with the generator re-fit by least squares on the "
             "fine-tuned encoder%s (%.1f s): keeping the %s one", "" if model.flat else " and discriminator",
             m["trained"]["p_at_1"], m["refit"]["p_at_1"],
             "" if model.flat else f", {m['refit_discriminator']['p_at_1']:.4f} with the label embeddings re-fit too",
             time.perf_counter() - t0, best.replace("_", " "))
    out = {k: v["p_at_1"] for k, v in m.items()}
    return {**out, "kept": best, "metrics": m[best]}


def valid_metrics(model: LightXMLModel, tokens: neural.TokenData, Y: sp.spmatrix, params: LightXMLParams,
                  device: torch.device | str, progress: Callable[..., Any] | None = None) -> dict[str, float]:
    """P@1, P@5 and R@``topk`` of the model's predictions on ``tokens`` (fractions)."""
    r = predict(model, tokens, topk=params.topk, batch_size=params.eval_batch_size, device=device, amp=params.amp,
                progress=progress)
    p = metrics.precision(r["scores"], Y, 5)
    rec = metrics.recall(r["scores"], Y, params.topk)
    return {"p_at_1": float(p[0]), "p_at_5": float(p[4]), f"recall_at_{params.topk}": float(rec[-1])}


def positive_pairs(Y: sp.csr_matrix, idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's positives as (row in the batch, label) pairs: what :meth:`LightXMLModel.loss` takes."""
    sub = Y[idx]
    rows = np.repeat(np.arange(len(idx), dtype=np.int64), np.diff(sub.indptr))
    return torch.from_numpy(rows), torch.from_numpy(sub.indices.astype(np.int64))


class Guide(Protocol):
    """An extra loss that :func:`train_lightxml` adds at every step (e.g. GUDN's guide network,
    :class:`xmc_steps.gudn.GuideNetwork`), on a second text of every training text.

    * ``tokens``: the second texts' token ids, one row per training text (in the training split's
      order); the model's encoder reads a batch's rows at every step, as it reads the texts.
    * ``needs_start``: whether the guide measures something on the model's start (after the linear
      start, before the first step) that a resumed run must keep.  :meth:`start` is then called once
      per run, before the first step; the trainer's checkpoints keep what it returned.
    * :meth:`loss` of every step, on the representations before dropout.
    * :meth:`describe`: what the model's description (``lightxml.json``) records about the guide
      (:func:`xmc_steps.lightxml.run.run_training`)."""

    tokens: neural.TokenData
    needs_start: bool

    def start(self, model: LightXMLModel, tokens: neural.TokenData, Y: sp.csr_matrix, device: torch.device,
              log: logging.Logger, kept: float | None) -> float:
        """The value to keep for this run: ``kept`` (what a resumed run's checkpoint kept), or, on a
        fresh run (``kept is None``), what the guide measures on ``model`` and the training data."""
        ...

    def loss(self, model: LightXMLModel, e_text: torch.Tensor, e_tokens: torch.Tensor, rows: torch.Tensor,
             labels: torch.Tensor, class_loss: torch.Tensor, max_pos: int | None = None, ranks: Any = None
             ) -> tuple[torch.Tensor, Mapping[str, Any]]:
        """``(loss, logs)`` of a batch: ``e_text`` and ``e_tokens`` are the encoder's representations of
        the texts and of their second texts (``tokens``), ``rows, labels`` the positives
        (:func:`positive_pairs`), ``class_loss`` the texts' own classification loss of the step (a guide
        may weigh itself against it), ``max_pos`` as for :meth:`LightXMLModel.candidates`, ``ranks`` (given
        with several processes only) as for :meth:`LightXMLModel.loss`: the guide's part of the global batch's
        loss.  The logs may be 0-d tensors (read at the trainer's logging interval)."""
        ...

    def describe(self) -> dict[str, Any]:
        """Entries for the trained model's description (once trained: what :meth:`start` decided too)."""
        ...


def memory_bytes(model: LightXMLModel, n_train: int, batch_size: int) -> int:
    """Host memory LightXML holds in proportion to L or K: the generator (``K x D``) and, clustered,
    the label embeddings (``L x hidden``) with their gradients and AdamW's moments, the least-squares
    starts of both (:func:`xmc_steps.linear_start.least_squares_bytes`; the label embeddings' in
    chunks of labels), the cluster table and a batch's dense generator targets and scores.  (On a
    GPU the training state is in device memory: not checked here.)"""
    D, L, K, h = model.dim, model.n_labels, model.n_clusters, model.hidden
    total = resources.adam_state_bytes(K * D) + least_squares_bytes(n_train, D, K) + 2 * resources.dense_bytes(batch_size, K)
    if not model.flat:
        total += (resources.adam_state_bytes(L * h) + least_squares_bytes(n_train, h, L, chunk=_LABEL_CHUNK)
                  + resources.dense_bytes(*model.cluster_labels.shape, dtype=np.int64))
    return total


def train_lightxml(model: LightXMLModel, tokens: neural.TokenData, Y: sp.spmatrix, params: LightXMLParams,
                   ckpt_dir: str | os.PathLike | None, log: logging.Logger | None = None,
                   on_step: Callable[[int, dict[str, float]], Any] | None = None,
                   valid: tuple[neural.TokenData, sp.spmatrix] | None = None,
                   fingerprint: Mapping[str, Any] | None = None, guide: Guide | None = None) -> Trainer:
    """Train ``model`` with Eq. 6 (one learning rate for every part, AdamW's decay except on biases
    and LayerNorm).  ``params`` must be resolved (:meth:`LightXMLParams.resolved`).  Resumes from
    ``ckpt_dir``.  The model ends on the training device with the weight average copied in (when
    the run took any).  With ``guide`` (:class:`Guide`) the guide's loss is added at every step."""
    log = log or neural._default_log
    tp = params.train
    if not tp.is_resolved or params.eval_every is None:
        raise ValueError("resolve the parameters first (LightXMLParams.resolved)")
    Y = sp.csr_matrix(Y, dtype=np.float32)
    Y.sort_indices()
    n = len(tokens)
    if Y.shape != (n, model.n_labels):
        raise ValueError(f"Y has shape {Y.shape}, expected ({n}, {model.n_labels})")
    if guide is not None and len(guide.tokens) != n:
        raise ValueError("a guide needs tokens, one row per training text")
    generator = [(f"generator.{k}", v) for k, v in model.generator.named_parameters()]
    discriminator = []
    if not model.flat:
        discriminator += [(f"bottleneck.{k}", v) for k, v in model.bottleneck.named_parameters()]
        discriminator += [("label_emb.weight", model.label_emb.weight)]
    lr_g = params.lr_generator if params.lr_generator is not None else tp.lr
    parts = {"encoder": (model.encoder, tp.lr), "generator": (generator, lr_g)}
    if discriminator:
        parts["discriminator"] = (discriminator, tp.lr)
    groups = param_groups(parts, tp.weight_decay)
    swa_first, swa_every = params.swa_schedule(n)
    swa = WeightAverage(model) if swa_first <= tp.steps else None   # no copy of the weights when unused
    static_at = params.static_step()
    if static_at is not None and model.flat:
        raise ValueError("static negatives need label clusters: with one label per cluster every label is scored "
                         "(set flat_max_labels below the number of labels for a clustered model)")
    guide_start = guide is not None and bool(guide.needs_start)
    box = _TrainBox(model, swa, n if static_at is not None else 0, guide_state=guide_start)
    fp = {"model": model.describe(), "encoder": params.encoder, "last_k": params.last_k, "swa": [swa_first, swa_every],
          "negatives": params.negatives, "static_step": static_at, "lr_generator": params.lr_generator,
          "start": [params.head_init] + ([params.head_init_l2, params.head_init_scale] if params.head_init == "linear" else [])
          + ([f"discriminator-{params.discriminator_init}"] if not model.flat else []),
          "data": digest(tokens.input_ids, tokens.lengths, Y.indptr, Y.indices)}
    if guide is not None:   # (the key's name predates the generic guide: kept for the checkpoints)
        fp["label_tokens"] = digest(guide.tokens.input_ids, guide.tokens.lengths)
    if not model.flat:
        fp["clusters"] = digest(model.cluster_of.cpu().numpy())
    fp.update(dict(fingerprint or {}))
    starts = params.head_init == "linear" or (params.discriminator_init == "linear" and not model.flat)
    if starts and not (ckpt_dir is not None and list_checkpoints(ckpt_dir)):
        device = neural.resolve_device(params.device)
        model.to(device)
        linear_start(model, tokens, Y, params, device, log)
        if valid is not None and distributed.rank_from_env() == 0:     # with several processes: rank 0's
            m0 = valid_metrics(model, valid[0], valid[1], params, device)
            box.start_valid.copy_(torch.tensor([m0["p_at_1"], m0["p_at_5"]], dtype=torch.float64))
            log.info("the linear start (step 0): valid P@1 %.4f, P@5 %.4f (%d documents)", m0["p_at_1"], m0["p_at_5"],
                     len(valid[0]))
            if on_step is not None:
                on_step(0, {"valid_p_at_1": m0["p_at_1"], "valid_p_at_5": m0["p_at_5"]})
    # with several processes the label embeddings' gradient goes through the candidates' rows (distributed.RowExchange)
    trainer = Trainer(box, groups, tp, ckpt_dir, log=log, on_step=on_step, fingerprint=fp, lengths=tokens.lengths,
                      device=params.device, amp=params.amp,
                      row_sparse=[] if model.flat else [model.label_emb.weight])
    if guide_start:   # measured once, at the start; a resumed run keeps its checkpoint's
        kept = float(box.guide_state[0])
        box.guide_state.fill_(guide.start(model, tokens, Y, trainer.device, log, None if np.isnan(kept) else kept))

    vt, vY = valid_subset(valid if params.eval_every > 0 else None, params.eval_max_docs, tp.seed)

    def draw() -> None:
        log.info("static negatives: drawing the top-%d clusters of %d training texts once, from the generator after "
                 "step %d", model.topb, n, trainer.step)
        box.static_top.copy_(torch.from_numpy(draw_top_clusters(model, tokens, params.eval_batch_size, trainer.device,
                                                                params.amp, log.info)))

    if static_at is not None and trainer.step >= static_at and int(box.static_top[0, 0]) < 0:
        draw()   # a resumed run whose checkpoint predates the draw's completion

    def step_end(step: int) -> dict[str, float] | None:
        if static_at is not None and step == static_at:
            draw()
        if swa is not None and step >= swa_first and (step - swa_first) % swa_every == 0:
            swa.update(model)
        # with several processes rank 0 alone evaluates, on the whole subset (the others wait at the next step)
        if vt is None or not trainer.is_main or (step % params.eval_every and step != tp.steps):
            return None
        m = valid_metrics(model, vt, vY, params, trainer.device)
        log.info("step %d: valid P@1 %.4f, P@5 %.4f (%d documents)", step, m["p_at_1"], m["p_at_5"], len(vt))
        return {"valid_p_at_1": m["p_at_1"], "valid_p_at_5": m["p_at_5"]}

    def batch_fn(idx: np.ndarray):
        # built ahead of its step (Trainer.fit's prefetch): nothing here may read the training state
        ids, mask = tokens.batch(idx)
        rows, labels = positive_pairs(Y, idx)
        n_pos = np.diff(Y.indptr)[idx]
        batch = {"ids": ids, "mask": mask, "rows": rows, "labels": labels,
                 "max_pos": int(n_pos.max()) if len(n_pos) else 0}
        if static_at is not None:
            batch["idx"] = torch.from_numpy(np.asarray(idx, dtype=np.int64))
        if guide is not None:
            batch["guide_ids"], batch["guide_mask"] = guide.tokens.batch(idx)
        return batch

    def loss_fn(m: _TrainBox, b):
        net = m.lightxml
        raw = net.encoder(b["ids"], b["mask"])
        e = net.dropout(raw)
        ranks = None
        if trainer.dist:   # this rank's part of the global batch's loss (L_d: over its real candidates)
            real = float(trainer.rank_examples > 0)
            ranks = (trainer.batch_share, lambda c: distributed.all_reduce_sum(c * real) / trainer.world)
        if static_at is None:
            loss, lg, ld = net.loss(e, b["rows"], b["labels"], max_pos=b["max_pos"], ranks=ranks)
        elif trainer.step < static_at:              # static, first phase: the generator alone
            loss, lg, ld = net.loss(e, b["rows"], b["labels"], generator_only=True, ranks=ranks)
        else:                                       # static, second phase: the drawn clusters (a device gather)
            loss, lg, ld = net.loss(e, b["rows"], b["labels"], top=m.static_top[b["idx"]], max_pos=b["max_pos"],
                                    ranks=ranks)
        logs = {"loss_g": lg, "loss_d": ld}        # tensors: read at the logging interval, no sync per step
        if guide is not None:
            # with several processes the guide's part of the global batch's loss (xmc_steps.gudn.loss.guide_loss)
            extra, more = guide.loss(net, raw, net.encoder(b["guide_ids"], b["guide_mask"]), b["rows"], b["labels"],
                                     loss, max_pos=b["max_pos"], **({"ranks": ranks} if ranks is not None else {}))
            loss = loss + extra
            logs.update(more)
        return loss, logs

    trainer.fit(loss_fn, n, batch_fn, step_end=step_end, loss_scope="global")
    start = box.start_valid.tolist()
    trainer.start_valid = {"p_at_1": start[0], "p_at_5": start[1]} if start[0] >= 0 else None
    if swa is not None and int(swa.n) > 0:
        log.info("weight average of %d snapshots (from step %d, every %d steps) replaces the last weights",
                 int(swa.n), swa_first, swa_every)
        swa.copy_to(model)
    return trainer
