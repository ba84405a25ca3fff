"""ELIAS (Gupta et al., NeurIPS 2022): a learnable cluster-to-label index trained end to end.

Model (§3.1-3.2, :class:`EliasModel`)
-------------------------------------
* ``phi(x)``: :class:`xmc_steps.neural.TextEncoder` ([CLS] of the last layer by default, §3.2);
* ``Wc`` (``C x D``): cluster classifiers, no bias (``s_c = w_c^T phi(x)``, §3.1);
* ``wl`` (``L x D``): label classifiers, optional bias ``wl_bias`` (``L``; off by default,
  the paper writes ``w_l^T phi(x)``);
* the row-sparse adjacency ``A`` stored as ``A_index`` (``C x kappa`` long buffer of label
  ids, ``-1`` pads rows with fewer candidates) and ``A_value`` (``C x kappa`` parameter).
  Pad entries take part in nothing (Eq. 5's softmax runs over the real entries of a row).

Forward, for a batch of ``B`` embeddings (cost ``O(B (C D + b' kappa log(b' kappa) + K D))``;
nothing is ever dense over ``L`` or ``C x L``):

1. Eq. 1: ``s = min(1, alpha * softmax(Wc phi))`` (softmax in fp32).
2. Eq. 2-4: the top-``b`` clusters, ranked by the logits ``Wc phi`` (the same order as
   ``s`` but without the ties the ``min(1, .)`` clamp creates).  In training (when the
   batch's positives are passed) each positive label adds its parent
   ``argmax_c a_{c,l}`` over the rows that hold ``l`` (Eq. 3; found through a
   label -> (row, slot) inverse index of ``A_index``, from the current ``A_value``; ties
   go to the lowest ``c * kappa + slot``).  A label held by no row has no parent.
3. Eq. 5: for the shortlisted rows only, ``s_{c,l} = min(1, beta * softmax_row(a_c))``.
4. Path scores ``s_c * s_{c,l}``; Eq. 6: ``yhat_l`` = the maximum over the paths that
   reach ``l`` in the same example (a scatter-max over the example's label ids;
   a cluster listed twice, e.g. in the top-b and as a parent, only repeats a path).
5. The top ``K`` labels by ``yhat`` form the shortlist.  *Reading*: in training the
   positives that some path reaches are always kept in the top ``K`` (ranked before the
   rest), since Eq. 3's parent set exists "to guarantee that the correct labels of x are
   present in the shortlist" and the top-K cut would otherwise drop a low-scoring one
   when ``K`` is smaller than the candidate set.  At prediction the cut is by ``yhat`` only.
6. ``p_l = sigmoid(w_l^T phi) * yhat_l`` for the ``K`` shortlisted labels.

:meth:`EliasModel.shortlist` returns ``(labels, yhat, p)``, each ``B x K`` (``K`` =
``min(K, L)``; rows with fewer candidates are padded with label ``-1`` and scores 0).

Stage 1 edge scores (*reading* of "A fixed and assigned from balanced partitions")
---------------------------------------------------------------------------------
Stage 1 builds ``A`` from the finest level of the balanced cluster tree: row ``c`` holds
exactly the labels of cluster ``c`` (``kappa1`` = the largest cluster size, pads
``-1``), values 0 and frozen (``requires_grad=False``).  With ``fixed_edges=True`` the
edge score of every real entry is exactly 1, so ``yhat_l = s_{c(l)}`` — the classic
partition index of §3.1 ("each label connected to exactly one cluster, all connections
with equal importance").  (Eq. 5 with constant values would give ``min(1, beta / n_c)``,
which is 1 whenever ``n_c <= beta = L/C``, i.e. the same up to the one-label size
differences of a balanced partition.)

Loss (§3.3, :func:`elias_loss`)
-------------------------------
``L = L_c + lambda * L_s`` with

* ``L_c = -sum_{l in shortlist} [y_l log p_l + (1 - y_l) log(1 - p_l)]`` — the standard
  BCE.  The paper's Eq. 7 prints ``(1 - y_l)(1 - log p_l)``, a typo (it would reward
  ``p -> 1`` for negatives); ``log p_l`` is computed as ``logsigmoid(z) + log(max(yhat, eps))``
  and ``log(1 - p_l)`` as ``log1p(-min(p, 1 - eps))``;
* ``L_s = -sum_{l: y_l = 1} log yhat_l`` (Eq. 8); a positive that is not in the shortlist
  (no path reaches it) counts with ``yhat = eps`` (a constant ``-log eps`` with no
  gradient; ``eps = 1e-6`` by default), and ``yhat`` is clamped to ``>= eps`` before the log.

Both sums run over the labels of one example; the batch loss is the **mean over the
examples** of ``L_c + lambda * L_s`` (so the per-step curves ``loss_c``/``loss_s`` are
per-example sums).

Staged training (§3.4) and the hyper-parameters
------------------------------------------------
* Stage 1 trains ``phi``, ``Wc``, ``wl`` with ``A`` fixed (above).
* :func:`init_adjacency` (Eqs. 9-10): ``A' = M^T Y`` with ``M`` the stage-1 model's top-b
  cluster scores ``s`` on the training split (``clusters_train.npz``); each row keeps its
  top-``kappa`` labels (ties: lower label id first; rows with fewer nonzeros are padded),
  values ``random(0, 1)`` from ``numpy.random.default_rng(seed)``.  Computed sparse, in
  blocks of cluster rows whose ``M^T Y`` product is bounded (``max_products``), so the
  memory is bounded at ``C = 5000``, ``L = 500k``.
* Stage 2 initialises ``phi``, ``Wc``, ``wl`` (and ``wl_bias`` when both stages have
  it) from stage 1 ("the rest of the stage 1 model") and trains everything with ``A``.
* AdamW (the :class:`xmc_steps.trainer.Trainer`) with three learning rates: ``lr_encoder``
  (``phi``), ``lr_clf`` (``Wc``, ``wl``, ``wl_bias``), ``lr_A`` (``A_value``); no weight decay
  on biases/gains; ``A_value`` gets ``weight_decay_A`` (default 0: the entries are edge
  logits, and decay would pull every row towards a uniform softmax); warm-up then
  linear decay; gradient clipping ``max_grad_norm``.
* ``wl_decay`` (``touched``, the default, or ``all``): AdamW's decoupled weight decay on
  ``wl``.  ``all`` decays every one of the L rows at every step, as a plain AdamW over a
  dense parameter does; a label seen once per epoch at Wiki-500K then shrinks by
  ``(1 - lr wd)`` about N / batch times between its visits, where the paper, updating
  ``W_L`` every 10 steps, applies a tenth of that.  ``touched`` decays, after each
  optimisation step, only the rows the step's shortlists touched (the rows whose
  gradient it computed), at the ``clf`` learning rate of that moment: the shrinkage then
  follows a label's own updates, as in a sparse optimiser.  ``Wc`` keeps the usual decay.
  ``touched`` is the reading closer to the paper and the default.  Stage 2 from the same
  stage-1 model, one epoch, CPU, ``all`` -> ``touched`` on the test split: debtags PSP@5 60.77
  -> 60.80, P@1 88.41 both; yso-finna-sv-50k PSP@5 2.00 -> 1.98, P@1 1.91 -> 1.93, R@100
  17.49 -> 17.57: within run-to-run noise on both (at 572 labels every row is touched
  often; on yso the default ELIAS of one CPU epoch learns little, so the comparison there is
  weak).
* ``wl_delay_steps``: ``wl`` (and its bias) are frozen (no gradient, no update, no decay)
  for the first ``wl_delay_steps`` optimisation steps of the stage.  (The paper's
  "update W_L every k = 10 steps" accumulation trick is a speed device and is not
  reproduced.)
* ``swa_epochs`` (default 0 = off): stochastic weight averaging — the uniform average of
  all trainable weights taken after every optimisation step of the last
  ``swa_epochs`` epochs (``round(swa_epochs * steps_per_epoch)`` steps, at least 1);
  the saved model holds the average.  The running average lives in buffers that the
  trainer's checkpoints carry, so a resumed run averages the same steps.
* The training recipe is ``train`` (:class:`xmc_steps.trainer.TrainParams`, ``lr`` unset: the three
  rates below); epochs become steps as ``ceil(train.epochs * N / (batch_size * grad_accum))``.
* Stage-dependent defaults (the authors' Amazon-670K settings from their public code): stage 1 15
  epochs, ``lr_encoder 1e-4``, ``lr_clf 1e-2``, ``lambda_ 0``; stage 2 30 epochs,
  ``lr_encoder 3e-5``, ``lr_clf 3e-4``, ``lr_A 5e-3``, ``lambda_ 0.05``.  ``alpha 10``,
  ``beta = L / C``, ``b = min(20, C)``, ``K = min(2000, L)``, ``kappa = min(L, ceil(10 L / C))``.
* ``wl`` is a dense ``L x D`` parameter: its gradient (the backward of the ``B x K`` row
  gather) and AdamW's update are dense over ``L`` once per optimisation step, as in the
  paper (whose remedy, updating ``W_L`` every 10 steps, is noted above); the forward pass
  itself touches only the ``B x K`` shortlisted rows.
* The paper's appendix (training details per dataset) is not in the text we have; the
  defaults come from the authors' public Amazon-670K settings.
* Every ``eval_every`` steps: shortlist recall@K (the share of a document's positives in
  its shortlist, averaged over documents with a positive) and P@1 of ``p`` on a fixed
  subset of at most ``eval_max_docs`` validation documents.  The final model is the one
  after the last step (no selection).

Files: :mod:`.params` (:class:`EliasParams`), :mod:`.model` (the network, the index
initialisation of Eqs. 9-10, inference, saving and loading), :mod:`.loss` (:func:`elias_loss`),
:mod:`.train` (the training driver: SWA, ``wl_decay``, evaluation), :mod:`.cli` (the stage:
``python -m xmc_steps.elias``).
"""

from .cli import main
from .loss import elias_loss
from .model import (FORMAT, EliasModel, Shortlist, adjacency_from_assignment, build_model, cluster_topb, init_adjacency,
                    load_elias, predict, shortlist_metrics)
from .params import STAGE_DEFAULTS, EliasParams
from .train import decay_touched_rows, train_elias

__all__ = ["FORMAT", "STAGE_DEFAULTS", "EliasModel", "EliasParams", "Shortlist", "adjacency_from_assignment", "build_model",
           "cluster_topb", "decay_touched_rows", "elias_loss", "init_adjacency", "load_elias", "main", "predict",
           "shortlist_metrics", "train_elias"]
