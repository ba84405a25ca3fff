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
   Ties at the cut (stage 1's fixed edges give every label of a cluster the same ``yhat``; the
   ``min(1, .)`` clamps make more) go to the lower label id.
6. ``p_l = sigmoid(w_l^T phi) * yhat_l`` for the ``K`` shortlisted labels.

:meth:`EliasModel.shortlist` returns ``(labels, yhat, p)``, each ``B x K`` (``K`` =
``min(K, L)``; rows with fewer candidates are padded with label ``-1`` and scores 0).

No read-back per step (issue 36): every shape in the training step comes from ``B``, ``b``,
``kappa``, ``K``, the batch's most positives per text (counted by the batch builder on the host) and
``max_rows_per_label`` (the most rows of ``A`` holding one label, read when ``A_index`` is set).  Eq. 3's
parents are a padded ``n x max_rows_per_label`` gather with an argmax (the first maximum: the lowest
``c * kappa + slot``); Eq. 6's per-example deduplication is a sort of the ``b' kappa`` paths by label and a
scatter-max over each run; the top-``K`` cut a stable sort; ``wl_decay: touched`` keeps a device mask
of the touched rows of ``W_L``.  So a CUDA step never waits for the device between log lines (the
encoder's own transformers mask builder aside: it checks the attention mask for padding on the host).
The values, the gradients and the weights after training are those of the earlier value-dependent
code bit for bit, ties at the top-``K`` cut aside (``tests/test_elias.py`` keeps it as the reference).

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
* ``stage2.a_init: partition`` (ours, the default; :func:`.model.partition_start`): each row of ``A``
  holds stage 1's labels of that cluster first, then Eq. 10's best other candidates up to
  ``kappa``; all values start equal (``a_init_mass: null``: a uniform row, edges ``beta / kappa``
  about 0.1, as Eq. 10's random(0, 1) values give on average), or give stage 1's labels the share
  ``a_init_mass`` of the row's softmax.  What it fixes: Eq. 10's per-row top-``kappa`` of
  ``M^T Y`` is taken by the frequent labels, and the labels in no row can never be predicted
  (reuters21578/modapte-all5: 157 of 368, 116 of them with training documents, at b = C = 64;
  yso-finna-sv-50k: 8,053 of 18,056 at b = 52 of 256).  ``random`` is Eq. 10 as written
  (config.paper.yaml).  Chosen on validation ("Choosing the defaults").
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
  ``touched`` is the reading closer to the paper and the default; the validation runs behind it
  are in "Choosing the defaults" (where a step's shortlists touch every row, the two rules are
  one; no test-split figure decides it).
* ``wl_delay_steps``: ``wl`` (and its bias) are frozen (no gradient, no update, no decay)
  for the first ``wl_delay_steps`` optimisation steps of the stage.
* ``wl_update_every`` (k; default 1, config.paper.yaml 10 as §4): ``wl`` (and its bias) take an
  optimiser step only every k steps (and at the stage's last), on the mean of the k steps'
  gradients, summed in between in buffers that the checkpoints keep
  (:class:`.train.WlAccumulator`); AdamW's decay of ``wl`` and ``wl_decay: touched``'s row decay
  (over the rows the k steps touched) happen at those steps only.  The paper calls it a speed
  device: one dense AdamW update of the L x D matrix per k steps instead of one per step.
* ``swa_epochs`` (default 0 = off): stochastic weight averaging — the uniform average of
  all trainable weights taken after every optimisation step of the last
  ``swa_epochs`` epochs (``round(swa_epochs * steps_per_epoch)`` steps, at least 1);
  the saved model holds the average.  The running average lives in buffers that the
  trainer's checkpoints carry, so a resumed run averages the same steps.
* The training recipe is ``train`` (:class:`xmc_steps.trainer.TrainParams`, ``lr`` unset: the three
  rates below); epochs become steps as ``ceil(train.epochs * N / (batch_size * grad_accum))``, the
  warm-up is a fraction of them (``train.warmup``, 0.1 by default; ``warmup_steps`` fixes a count).
* Stage-dependent defaults (:data:`.params.STAGE_DEFAULTS`, config.yaml's, see "Choosing the
  defaults"): stage 1 2 epochs, ``lr_encoder 1e-4``, ``lr_clf 1e-3``, ``lambda_ 0``; stage 2 2 epochs,
  ``lr_encoder 3e-5``, ``lr_clf 3e-4``, ``lr_A 5e-3``, ``lambda_ 0.05``.  The authors' Amazon-670K
  settings from their public code (15 and 30 epochs, stage 1 ``lr_clf 1e-2``) are config.paper.yaml's.  ``alpha 10``, ``beta = L / C``, ``kappa = min(L, ceil(10 L / C))``;
  ``b`` and ``K`` from the data (below).
* ``wl`` is a dense ``L x D`` parameter: its gradient (the backward of the ``B x K`` row
  gather) and AdamW's update are dense over ``L`` once per optimisation step, as in the
  paper (whose remedy, updating ``W_L`` every 10 steps, is noted above); the forward pass
  itself touches only the ``B x K`` shortlisted rows.
* The paper's appendix (training details per dataset) is not in the text we have; the
  defaults come from the authors' public Amazon-670K settings.
* Every ``eval_every`` steps (default: ten points per stage) and at step 0 of a fresh run: shortlist
  recall at the guard's width ``w`` (below; the share of a document's positives among the top-``w``
  of its shortlist, averaged over documents with a positive) and P@1 of ``p`` on a fixed subset of
  at most ``eval_max_docs`` validation documents.  The final model is the one after the last step
  (no selection).

Sizes from the data (``C``, ``b``, ``K``, ``kappa``, ``beta``)
--------------------------------------------------------------
The paper (§4) takes ``C ~ L / 100`` clusters "as LightXML", fixes ``K = 2000`` "approximately the
number of labels existing partition based methods shortlist assuming beam-size b = 20 and the number
of labels per cluster = 100", ``kappa ~ 10 L / C`` (§3.4) and ``beta ~ L / C`` (§3.2).  Those are
the sizes of million-label sets; fixed, they fail elsewhere.  The earlier defaults here (leaf size
10, ``b = 16``, ``K = 100``, tuned on debtags) gave yso-finna-sv-50k's 18,056 labels ``C = 2,048``
clusters of 9 labels and a beam over 0.8 % of them (about 140 labels): stage 2's test shortlist
recall@100 was 17.5, below parabel's R@100 (25.8), and nothing warned.  The rules now:

* ``C``: the paper's rule, ``2^ceil(log2(L / cluster.leaf_size))`` with ``leaf_size 100``, but at least
  ``cluster.min_clusters`` (64, ours: debtags' 572 labels would get 8 clusters of 72, an index with
  nothing to choose).  debtags 64 clusters of 9, reuters-all5 (368 labels) 64 of 6, yso-finna-sv-50k
  256 of 70-71, Wiki-500K 8,192 (config.paper.yaml: 4,096, the power of two nearest L / 100).
* ``K`` (:func:`default_K`): ``clip(ceil(L / 10), 200, 2000)``, at most ``L``: the paper's 2,000 from
  20,000 labels up, and at least 200 (twice the top 100 that ELIAS++ re-ranks and R@100 counts).
  debtags 200, reuters-all5 200, yso-finna-sv-50k 1,806.
* ``b`` (:func:`default_b`): the fewest clusters whose labels (``L / C`` each in stage 1's
  partition) number ``coverage * K``, at most ``C``; ``coverage`` 2 (ours).  The paper's ``b = 20``
  over clusters of 100 labels is ``coverage`` 1: stage 1's shortlist is then every label its beam
  reaches, and the top-``K`` cut chooses nothing.  debtags 45 of 64, yso-finna-sv-50k 52 of 256
  (3,667 labels for ``K`` 1,806).  In stage 2 a row holds ``kappa = 10 L / C`` candidates, so the
  beam reaches up to ten times more paths.
* ``kappa``, ``beta``: the paper's, from the same ``L / C``.

config.paper.yaml states the paper's values for each benchmark (``b 20``, ``K 2000``, ``coverage 1``,
``min_clusters 1``).

The linear start (``head_init``)
--------------------------------
A random ``W_C`` over thousands of clusters is the regime in which the X-Transformer matcher
collapsed to the frequency prior until it got its least-squares start (:mod:`xmc_steps.xtransformer.matcher`).
``head_init: linear`` (default, ours) starts stage 1's ``W_C`` and ``W_L`` (and ``wl_bias``) as the
least-squares fits (:func:`xmc_steps.linear_start.least_squares_head`) of ``+-head_init_scale``
targets on the *pre-trained* encoder's embeddings of the training texts: ``W_C`` of each document's
clusters under the balanced partition, ``W_L`` of its labels (one ``d x d`` system, solved in label
chunks; one inference pass over the training split).  ``head_init_scale`` 4 (ours): the fit of
``+-1`` targets gives logits within about ``+-1``, where the softmax of Eq. 1 over 256 clusters gives
the best cluster about 1 % of the mass (``s_c`` 0.1 after ``alpha``) and the sigmoid of a negative
label 0.27; at ``+-4`` they are 18 % (``s_c`` 1) and 0.02.  ``random`` (N(0, 0.02)) is the paper's.
Stage 2 starts from stage 1's weights either way.  A resumed run takes its weights from the checkpoint.
``head_refit`` (default on, ours, as the X-Transformer matcher's): after stage 1, ``W_C`` and ``W_L``
are fit the same way on the *fine-tuned* encoder's embeddings of the training texts (the pass that
computes Eq. 9's ``M`` anyway) and kept when the valid shortlist recall is higher; the stage records
both (``valid_shortlist_recall_trained_head`` / ``_refit_head``).  On yso-finna-sv-50k, stage 1 first
loses part of its start (valid recall 0.405 at step 0, 0.369 after one epoch, 0.420 after two): the
encoder moves under heads fit to the pre-trained one.  ``head_refit_select`` (ours; :func:`.model.refit_heads`):
``joint`` (the default) keeps both re-fit heads or neither, by that recall; ``per_head`` keeps ``W_C`` so
(the shortlist is ``W_C``'s and ``A``'s alone), then ``W_L``, trained or re-fit, by the valid P@1 it
gives on that shortlist (recorded as ``valid_p_at_1_refit_wc_trained_wl`` or ``_trained_wc_refit_wl``).
Why: on yso-finna-sv-50k the re-fit won on recall (0.4532 against 0.4169) while its ``W_L`` ranks worse
(valid P@1 0.0998 against 0.1235 as trained), and stage 2 starts from both.  Measured on debtags (the
default stage 1, trained heads kept; valid shortlist recall@200 / P@1 of each (W_C, W_L), the re-fit
computed after the fact, 2 CPU cores, 2026-12-02): trained, trained 0.9906 / 91.70; re-fit, re-fit
0.9886 / 91.58; trained, re-fit 0.9906 / 91.95; re-fit, trained 0.9886 / 91.91.  ``per_head`` would keep
the trained ``W_C`` and the re-fit ``W_L``: +0.25 of P@1, 6 of 2,423 documents, within the noise.
yso-finna-sv-50k's stage 1 kept no trained heads, so its figures need a new stage 1 (the ``-perhead``
alias of ``bench/elias-gpu.yaml``, in ``bench/gpu_elias_choices.sh``): until then ``joint`` stays.

Choosing the defaults (validation split, one H200, ``bench/gpu_elias.sh``)
--------------------------------------------------------------------------
Valid shortlist recall at the guard's width (debtags ``w`` = 200 of 572 labels, C = 64;
yso-finna-sv-50k ``w`` = 1,806 of 18,056, C = 256), on a fixed subset of 2,000 valid documents
during training and on all of them at the end (last column), two epochs a stage, batch 32, MiniLM at
64 tokens, bf16, random batches (``train.length_bucket`` 0, the default then).  Stage 1:

================  =========  ======  ======  ==========  ===========  =============================
set               start      lr_clf  step 0  one epoch   two epochs   baselines: tree index / tree
                                                         (all valid)  ranked / most frequent
================  =========  ======  ======  ==========  ===========  =============================
debtags           linear     1e-2    0.9806  0.9878      0.9914       0.9843 / 0.9905 / 0.9569
debtags           linear     1e-3    0.9806  0.9882      0.9914
debtags           random     1e-2    0.4274  0.9779      0.9886
yso-finna-sv-50k  linear     1e-2    0.4053  0.2335      0.3765       0.4517 / 0.4779 / 0.3681
yso-finna-sv-50k  linear     1e-3    0.4053  0.3693      0.4198
yso-finna-sv-50k  random     1e-2    0.1072  0.1193      0.2160
================  =========  ======  ======  ==========  ===========  =============================

* ``head_init: linear``: the paper's random start reaches in two epochs less than the least-squares
  start holds at step 0 on yso-finna-sv-50k (0.216 against 0.405; it stays below the most frequent
  labels), and ends lower on debtags (0.9886 against 0.9914).
* ``stage1.lr_clf`` 1e-3 (the paper's 1e-2 is the class default and config.paper.yaml's): the rate
  that undoes the least-squares start less (yso: 0.41 -> 0.37 after one epoch instead of -> 0.23) and
  ends higher (0.420 against 0.377); on debtags the two tie (P@1 of the subset 0.920 against 0.917).
* Head or encoder (``bench/elias_head_fits.py``, the pre-trained MiniLM frozen, yso-finna-sv-50k, all
  5,000 valid documents, width 1,806; 2 CPU cores): ``W_C`` by least squares (the start) 0.4152 (train
  0.5475); by the softmax cross-entropy of Eq. 1 run to the end, 10 epochs at 1e-2 0.4112 (train
  0.5603), 30 epochs 0.4124 (0.5985), 30 epochs at 3e-3 0.4099.  No fit of the head on the pre-trained
  embeddings beats the start, so the gap to the tree's index (0.452) is the encoder's: stage 1 passes
  only where fine-tuning moves the encoder far enough.  On the fine-tuned encoder of the bucketed CPU
  run below (its saved heads are the re-fit): least squares 0.4549 (train 0.6133), cross-entropy 10
  epochs at 1e-2 0.4638 (0.6636), 30 epochs 0.4578 (0.6897): there the fit moves the recall by 0.01 at
  most, and the re-fit, not the trained head (0.4169), is what passes the guard.
* ``train.length_bucket`` 50 in both stages (ours, the X-Transformer matcher's; 0, random batches, is
  the authors' code, config.paper.yaml's, and was the default until 2026-12-02): yso-finna-sv-50k's
  titles average 22 tokens and a random batch of 32 pads to about 56, so on 2 CPU cores stage 1 trains
  at 30.9 sequences/s bucketed against 17-22 with random batches; valid recall (2,000 documents) at
  steps 564 / 1,128 / 1,692 / 2,813: 0.345 / 0.371 / 0.375 / 0.413 bucketed, 0.315 / 0.359 / 0.390 / -
  random (a CPU run stopped at 1,692).  debtags (texts average 61 of the 64 tokens: no speed to gain),
  2 CPU cores, valid recall@200 on all valid documents, bucketed (2026-12-02) against random
  (2026-11-29, another machine): stage 1 0.9906 against 0.9918 (the trained heads kept: the re-fit
  0.9886), stage 2 0.9942 against 0.9942, both guards pass; test ELIAS++ P@1 92.67 against 92.74,
  R@100 98.71 against 98.74 (one run each, reported, not chosen on).  So the default, chosen on the valid
  figures: stage 2, whose shortlist ELIAS++ re-ranks, ties on debtags and passes on yso, and yso trains
  1.4-1.8x faster.
  reuters21578/modapte-all5 (58 of 64 tokens) has only its random-batch rows so far.
* Two epochs a stage: on yso-finna-sv-50k stage 1 still climbs at the end (0.369 after one epoch,
  0.420 after two; the rate decays to 0 over the stage), stage 2 flattens in its second epoch (valid
  subset 0.5735 at one epoch, 0.5777 at two).  More epochs are for machines with a GPU: two epochs of
  both stages take 6 minutes there (750-870 training sequences/s with five other trainings on the GPU),
  about 2 hours on 2 CPU cores.
* Stage 2 (from the lr_clf 1e-3 stage 1): yso-finna-sv-50k 0.5424 at step 0 (Eqs. 9-10's ``A``
  already adds recall), 0.5692 at the end on all valid documents: above stage 1 (0.420) and both
  trees (0.452, 0.478), the learned index the paper claims.  debtags 0.9841 -> 0.9879, within the
  noise below stage 1's 0.9914 (every index is above 0.95 at 200 of 572 labels).
* Where the guard stands at the defaults: stage 1 passes on debtags (0.9914 against 0.9843 and 0.9569)
  and on reuters21578/modapte-all5 (0.9937 against the tree's index 0.9944, within the noise: CPU run)
  and failed on yso-finna-sv-50k (0.420 against 0.452; an H200 run before ``head_refit``), where stage 2
  would pass (0.569).  With ``head_refit`` and ``train.length_bucket: 50`` (2 CPU cores, 2026-12-01) yso's
  stage 1 passes: 0.4532 with the re-fit heads against the tree's 0.4517 (the trained heads 0.4169),
  and stage 2 from it (2026-12-02) passes too: 0.5629 on all valid documents against stage 1's 0.4532
  and the trees' 0.4517 / 0.4779 (valid subset of 2,000: 0.516 at step 0, 0.521 / 0.523 / 0.546 /
  0.559 at steps 282 / 846 / 1,410 / 2,256, 0.561 at 2,538; its P@1 0.107 -> 0.046 -> 0.084): today's
  defaults, since ``length_bucket`` 50 became one (random batches with the re-fit: not measured there).  With Eq. 10's
  start stage 2 failed on reuters-all5 (0.9885 against stage 1's 0.9937, beyond the noise of 0.0040: it
  starts at 0.9887 and stays flat) and ended 0.0035 below stage 1 on debtags: on small label spaces
  Eq. 10's random edge values over ``kappa = 10 L / C`` candidates undo the partition, and two epochs at
  ``lr_A`` 5e-3 do not win it back.  With the partition start (the default, below) it passes on both
  (CPU runs at the defaults: debtags 0.9942 against stage 1's 0.9918; reuters-all5 0.9946 against
  0.9935, whose stage 1 ties the tree's 0.9944 within the noise and kept its re-fit heads, 0.9935 against
  0.9920 trained).  Test rows: the README.

Stage 2's start, ``a_init`` (valid shortlist recall at the guard's width, stage 2 at step 0 from
the same stage-1 model; 2 CPU cores).  reuters21578/modapte-all5 (368 labels, C 64, b 64, kappa 58,
w 184; the trained stage 1, 0.9937 on its own) and yso-finna-sv-50k (18,056 labels, C 256, b 52,
kappa 706, w 1,806; stage 1 from its CPU run's checkpoint at step 249 of 2,813, 0.3412 on its own,
2,000 valid documents: a stage 1 trained to the end needs the GPU), P@1 beside, labels in no row of
``A`` last:

=========================================  ===============  ===================  ======
``a_init`` (``a_init_mass``)                reuters-all5     yso-finna-sv-50k     no row
=========================================  ===============  ===================  ======
random (Eq. 10, the paper)                  0.9887 / 0.942   0.4371 / 0.017       157 / 8,053
partition, Eq. 10's random(0, 1) values     0.9950 / 0.952   0.4251 / 0.020       0
partition, uniform (null: the default)      0.9950 / 0.968   0.4815 / 0.027       0
partition, 0.05 / 0.1 / 0.2                 0.9938 / 0.9950  0.4693 / 0.4823      0
                                            / 0.9953         / 0.3431
partition, 0.3 / 0.5 / 0.9                  0.9949 / - /     - / 0.3423 /         0
                                            0.9934           0.3423
=========================================  ===============  ===================  ======

Trained (reuters-all5, two epochs, the whole valid split at the end; the guard's verdict): random
0.9885, flat from its first evaluation, fails against stage 1's 0.9937; partition 0.9 0.9946 and
uniform 0.9953 pass (the tree's index: 0.9944).  Uniform is the default: the highest or within 0.0003 of it
on both sets at the start, where a share of 0.2 or more on stage 1's labels keeps yso-finna-sv-50k
at stage 1's recall (the rows' other candidates, which add the recall, then rank below every label of
the beam's clusters).  Eq. 10's random values lose 0.056 of that on yso against equal values.

Trained on yso-finna-sv-50k (stage 2 from the same default stage 1, two epochs, ``length_bucket`` 50;
the ``-eq10`` alias against the default's ``-lb50`` folder; 2 CPU cores, 2026-12-02; valid shortlist
recall@1,806 / P@1 on 2,000 valid documents at steps 0, 1,128, 2,256, then the guard on all 5,000):

==========================  =============  =============  =============  ===============  ===========
``a_init``                  step 0         step 1,128     step 2,256     all valid        no row of A
==========================  =============  =============  =============  ===============  ===========
partition (the default)     0.5162 / .107  0.5391 / .069  0.5587 / .083  0.5629 / 0.0928  0
random (Eq. 10, the paper)  0.4785 / .060  0.5233 / .070  0.5470 / .087  0.5512 / 0.0968  6,918
==========================  =============  =============  =============  ===============  ===========

The partition start keeps its lead through training: 0.0117 of recall at the end (the guard's noise
is 0.012), and Eq. 10's start leaves 6,918 of the 18,056 labels in no row of ``A``, never predicted;
its P@1 is 0.4 higher (20 of 5,000 documents).  ``partition`` stays.  Test (stage 2's predictions at
``yhat_power`` 0.75, P@1 / P@5 / R@100): partition 9.77 / 5.22 / 32.40, random 9.76 / 5.24 / 31.88.

``wl_decay`` and ``wl_update_every``: on reuters-all5 and debtags stage 1's beam holds every cluster
(b = C) or most (45 of 64), so every step's shortlists touch every row of ``W_L``: ``touched`` and
``all`` decay the same rows and only a larger label space can tell them apart.  yso-finna-sv-50k
(stage 2 from the same default stage 1, ``length_bucket: 50``, the ``-wlall`` alias; 2 CPU cores,
2026-12-02; valid shortlist recall@1,806 / P@1 of 2,000 valid documents at steps 0, 1,128, 2,256 and
the end): ``touched`` 0.5162 / 0.107, 0.5391 / 0.069, 0.5587 / 0.083, 0.5629 / 0.0928 (whole valid
split); ``all`` 0.5162 / 0.107, 0.5353 / 0.063, 0.5628 / 0.082, 0.5651 / 0.0930.  A tie: 0.0022 of
recall, against the guard's noise of 0.012 (two standard errors of the per-document difference).
``touched`` stays the default as the reading closer to the paper's 10-step update.  ``wl_update_every: 10`` on reuters-all5 (stage 2, Eq. 10's start, stopped at step
308 of 438 for the CPU): valid recall 0.9885 at every evaluation, as with every step (0.9885), P@1
0.87-0.91 against 0.89-0.91.  Its reason is speed (``bench/bench_elias_wl_update.py``).
yso-finna-sv-50k (stage 2 only, from the default stage 1: the ``-k10s2`` alias; 2 CPU cores,
2026-12-02, run beside ``-eq10``, one thread each): valid recall@1,806 / P@1 at steps 0, 1,128,
2,256 and on all valid documents, k = 10: 0.5162 / 0.107, 0.5456 / 0.055, 0.5653 / 0.060,
0.5636 / 0.0672; k = 1 (the default): 0.5162 / 0.107, 0.5391 / 0.069, 0.5587 / 0.083, 0.5629 / 0.0928.
The same recall (a difference of 0.0007) and 2.6 points less P@1 (128 of 5,000 documents): W_L,
stepped a tenth as often at the same learning rate, ranks the shortlist worse.  Side by side on one
machine the two trained at the same speed (13.97 and 13.92 sequences/s): on CPU the encoder's
passes cost the time, not W_L's update.  ``wl_update_every: 1`` stays; stage 1 at k = 10 is not
measured on yso (the ``-k10`` alias).  Test (P@1 / P@5 / R@100 at ``yhat_power`` 0.75): k = 10
7.39 / 4.08 / 28.04 against 9.77 / 5.22 / 32.40.

``predict.K`` (``bench/elias_predict_sizes.py``, reuters-all5 stage 2 (Eq. 10's start), valid
split): K 100 / 200 (as trained) / 368: P@1 90.87, P@3 66.45, P@5 43.52 at all three; R@100 98.55 /
98.67 / 98.67.  debtags (stage 2 at the defaults, a_init partition, 2 CPU cores, 2026-11-29; b 45 of 64,
valid split): K 100 / 200 (as trained) / 400 / 572: P@1 91.04 at all four, P@3 62.48 / 62.50 / 62.50 /
62.50, P@5 46.50 / 46.51 / 46.51 / 46.51, R@100 97.77 / 98.90 / 99.04 / 99.04.  So ``predict.K: null``
(as trained): a narrower shortlist loses recall on both sets, a wider one changes no precision and
adds 0.14 points of R@100 on debtags for twice the candidates scored (none on reuters-all5).
yso-finna-sv-50k (stage 2 at the defaults with ``train.length_bucket: 50``, 2 CPU cores, 2026-12-02;
valid split; b 52 of 256 clusters, which hold about 3,660 labels):

=============  =====  =====  =====  ======
b / K          P@1    P@3    P@5    R@100
=============  =====  =====  =====  ======
52 / 903       9.22   6.52   5.05   30.63
52 / 1,806     9.28   6.59   5.13   32.56  (as trained: the default)
52 / 3,612     9.32   6.63   5.16   33.36
52 / 7,224     9.32   6.63   5.16   33.66
104 / 3,612    8.40   5.96   4.64   30.48
104 / 7,224    8.40   5.96   4.64   30.61
=============  =====  =====  =====  ======

Here K decides more: twice the shortlist adds 0.8 of R@100 and 0.04 of P@1, a wider beam loses 0.9
of P@1 and 2 of R@100 (its extra clusters' labels outrank the truth).  ``predict.K: null`` stays: on
all three sets a wider K buys under a point of R@100 for twice the labels scored, a narrower one loses
recall; a user who wants the last point sets ``predict.K`` to the beam's labels (about ``b L / C``).

``predict.yhat_power`` (ours; the paper's §3.2 final score is ``p = sigmoid(w_l^T phi) * yhat``, a power
of 1, config.paper.yaml's): prediction ranks the shortlist by ``sigmoid(w_l^T phi) * yhat ** a``; the
shortlist itself (the top ``K`` by ``yhat``) is the same at every ``a``, training and its validation
curve keep the paper's ``p``.  On yso-finna-sv-50k stage 2's ``yhat`` (a path through one of 256
clusters whose rows hold 706 labels each) ranks the shortlist worse than the classifier does: ranked
by ``yhat`` alone the top 100 hold 16.5% of the truth, by the classifier alone 33.3%, by ``p`` 32.6%.
Valid split, the default models of the README (``length_bucket: 50``; stage 2's own rows; ELIAS++ with
the ranker as trained on ``a = 1`` candidates and the calibration cross-fitted on 5 folds of valid,
``bench/elias_plus_valid.py``'s rule; exploratory scripts, 2 CPU cores, 2026-12-02), P@1 / R@100:

=====  ===============  ===============  ===============  ===============  ===============  ===============
a      yso stage 2      yso ELIAS++      debtags stage 2  debtags ELIAS++  reuters stage 2  reuters ELIAS++
=====  ===============  ===============  ===============  ===============  ===============  ===============
0      12.04 / 33.34    17.54 / 33.34    91.70 / 98.31    92.61 / 98.31    95.12 / 98.97    97.56 / 98.97
0.25   11.38 / 33.78    18.42 / 33.78    91.13 / 98.57    92.74 / 98.57    93.19 / 99.11    98.07 / 99.11
0.5    10.90 / 33.90    18.38 / 33.90    90.76 / 98.78    92.70 / 98.78    92.80 / 99.20    97.30 / 99.20
0.75   10.16 / 33.61    18.42 / 33.61    90.47 / 98.86    92.70 / 98.86    92.54 / 99.31    97.17 / 99.31
1      9.28 / 32.56     18.18 / 32.56    90.34 / 98.87    92.86 / 98.87    92.29 / 99.30    97.30 / 99.30
=====  ===============  ===============  ===============  ===============  ===============  ===============

(ELIAS++'s R@100 is stage 2's: the ranker re-orders stage 2's top 100, §3.5.)  Stage 2 alone at
``a = 1.5 / 2 / 3``: yso 8.06 / 30.84, 7.12 / 29.08, 5.98 / 26.29; debtags R@100 98.91, 98.88, 98.72.
Chosen: ``a = 0.75``.  It keeps most of yso's gain in recall (+1.05 of R@100 against +1.34 at 0.5) and
ELIAS++'s best P@1 there (18.42), and on the two small label spaces, whose shortlists the classifier
and ``yhat`` rank alike, it stays within 0.01 of the paper's R@100 and within 0.16 of its ELIAS++
P@1 (1 and 4 documents of 778 and 2,423), where 0.5 loses 0.1 of R@100.  Lower powers raise stage 2's
own P@1 everywhere but lose recall on the small sets; ELIAS++'s ranker recovers the precision.

The guard (:mod:`.guard`)
-------------------------
After each stage the valid shortlist recall at ``w = min(K, L // 2)`` labels (the whole validation
split) is compared with two trivial indexes that propose as many labels: the most frequent training
labels, and the linear tree's beam as an index (XR-Linear over the same cluster tree, fit on the train
split, ``--linear-model``: the labels of its beam of ``b`` clusters by the clusters' scores, the first
``w``; its top-``w`` labels by its rankers are recorded beside, ``linear_tree_ranked``).  Stage 2 must
also not fall below stage 1.  "Below" is by more than two standard errors of the per-document
difference, in both tests (a tie within the validation split's noise passes).  A stage below that fails, naming the numbers and the keys to change, unless ``allow_weak``; the weights stay
checkpointed, so a rerun does not train again.  Each stage writes ``guard.json`` (the numbers and the
validation curve), ``guard_recall.npz`` (its per-document valid recalls) and ``curve.png``.  The
readings (the tree as an index; the noise margins) were fixed after runs that failed the first
versions; :mod:`.guard` gives the numbers.

Files: :mod:`.params` (:class:`EliasParams`), :mod:`.model` (the network, the index
initialisation of Eqs. 9-10, inference, saving and loading), :mod:`.loss` (:func:`elias_loss`),
:mod:`.train` (the training driver: SWA, ``wl_decay``, evaluation); the stage is
:mod:`xmc_steps.stages.elias` (``python -m xmc_steps.stages.elias``).
"""

from ..methods import lazy_exports

#: the public names, each imported from its submodule on first use (``import xmc_steps.elias.spec`` costs no torch)
_EXPORTS = {
    "FORMAT": ".model",
    "STAGE_DEFAULTS": ".params",
    "EliasModel": ".model",
    "EliasParams": ".params",
    "GuardReport": ".guard",
    "Shortlist": ".model",
    "adjacency_from_assignment": ".model",
    "build_model": ".model",
    "check_stage": ".guard",
    "cluster_topb": ".model",
    "decay_touched_rows": ".train",
    "default_K": ".params",
    "default_b": ".params",
    "elias_loss": ".loss",
    "guard_width": ".guard",
    "init_adjacency": ".model",
    "linear_start": ".model",
    "load_elias": ".model",
    "partition_start": ".model",
    "partition_targets": ".model",
    "predict": ".model",
    "refit_heads": ".model",
    "shortlist_metrics": ".model",
    "train_elias": ".train",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
