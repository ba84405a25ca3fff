"""X-Transformer (Chang et al., KDD 2020): a transformer *matcher* that maps a text to the top-``b``
of ``K`` label clusters (§3.3), and linear one-vs-all *rankers* that score the labels of those
clusters, combined by Eq. 2 (§3.4).

Modules
-------
* :mod:`.params`: :class:`MatcherParams` (the ``xtransformer.matcher`` section) and its training
  recipe :data:`TRAIN_DEFAULTS`;
* :mod:`.matcher`: :class:`MatcherModel` and Eq. 3's loss, the least-squares heads, training
  (:func:`train_matcher`), the cluster scores (:func:`predict_clusters`, :func:`topb_from_emb`,
  :func:`head_linear_topb`), :func:`finish_matcher` and :func:`load_matcher`;
* :mod:`.guard`: the cluster metrics, the trivial matchers, :class:`GuardReport`,
  :func:`check_matcher` (the matcher stage's test) and :func:`alone_failure` / :func:`check_guard`
  (the rankers' test with ``candidates: matcher``);
* :mod:`.ranker`: :class:`XTransformerRankerParams` (``xtransformer.ranker``), the candidate clusters,
  the rankers' training, Eq. 2 (``ranker.train``, ``ranker.predict``), the model folder and
  :func:`load_head`.  It loads no torch, nor does :mod:`.guard`.

The names above can be imported from the package itself (``from xmc_steps.xtransformer import
MatcherParams``); each is imported from its module on first use, so importing the package loads
nothing, and the rankers' stage starts without torch.

The stages: ``python -m xmc_steps.stages.matcher`` (:mod:`xmc_steps.stages.matcher`) and
``python -m xmc_steps.stages.xtransformer train|predict|select`` (:mod:`xmc_steps.stages.xtransformer`).

The matcher (§3.3)
==================

Model: ``g(x, k) = w_k^T phi(x)`` with ``phi`` the encoder's [CLS]-like embedding
(:class:`xmc_steps.neural.TextEncoder`, ``pooling="cls"`` by default) and ``W`` a
``K x dim`` linear head without bias, exactly as Eq. 3.  Targets: ``M = YC``
binarised (instance -> clusters of its labels) for the flat cluster assignment ``C``
(``L x K``, 0/1).  Loss (Eq. 3): the squared hinge ``max(0, 1 - M~_ik g(x_i, k))^2``
with ``M~ = 2M - 1``, averaged over the ``K`` outputs and over the batch
(:func:`squared_hinge_loss`).  The loss is the paper's at every setting.

What makes it learn at every K (readings and additions, each a named setting)
------------------------------------------------------------------------------
With a randomly initialised head, 600 steps of batch 32 and a head learning rate of
1e-3 (the configuration before this module took its current shape), the matcher
collapsed as soon as K was large: on yso-finna-sv-50k (45,000 short Swedish titles)
the valid cluster recall@10 ended at 0.110 for K = 256, 0.013 for K = 2,048 and 0.004 for
K = 8,192, against 0.109, 0.017 and 0.006 for always answering the most frequent
clusters (``bench/bench_matcher_scale.py``, one H200).  The mean over K of Eq. 3 is
dominated by the ~K negatives per example; a random head first drives every score
below -1, where the negatives cost nothing, and a few hundred steps leave each of
thousands of clusters a handful of positive examples to climb back with.  Three
changes, in order of effect, then two more:

* ``head_init="linear"`` (default; ``"random"`` is the paper's N(0, 0.02)): the head
  starts as the least-squares fit of Eq. 3's targets on the *pre-trained* encoder's
  embeddings of the training documents (:func:`linear_head`, one ``d x d`` ridge system
  for all clusters), the "linear bootstrap" that X-Transformer's successor
  (XR-Transformer, PECOS) uses to start each level's head, and the first half of
  linear-probe-then-fine-tune.  It costs one inference pass over the training split.
  At the start of fine-tuning it already ranks clusters (recall@10 0.23 at K = 256,
  0.15 at K = 2,048, 0.16 at K = 8,192), and fine-tuning improves it from there.
* ``lr_head = None`` (= ``train.lr``): Adam moves every head weight by about the learning
  rate per step whatever the gradient's size; at 1e-3 the least-squares head is
  undone within ~50 steps (recall@10 0.15 -> 0.05 at K = 2,048 on the CPU).
* ``train.epochs`` (a float; steps = ``ceil(epochs N / (batch_size grad_accum))``) and
  ``train.warmup`` (a fraction of the steps) instead of fixed step counts, so the schedule
  scales with the data; ``train.steps`` / ``train.warmup_steps`` still fix them (the papers'
  settings are step counts).

* ``head_refit`` (default on; an addition): after training, the head is re-fit by the
  same least squares on the *fine-tuned* encoder's embeddings of the training split
  (which the stage computes anyway) and kept when its valid cluster recall@b is higher
  (:func:`refit_head`).  Joint training moves the encoder faster than the head follows:
  on yso-finna-sv-50k, K = 256, after a quarter epoch on the CPU the re-fit head gives
  recall@10 0.268 against 0.248 for the trained one.
* ``length_bucket``: batches of similar lengths (about twice the CPU throughput on short
  titles, where a random batch is padded to its longest member).
* ``scorer`` (an addition; ``head``, the default, is the paper): which cluster scores the
  stage writes for the rankers (their candidate clusters and MAN negatives) and the guard
  judges.  ``head+linear`` (:func:`head_linear_topb`) scores a cluster by the mean of the
  head's ``T(g)`` (l3-hinge) and the linear tree's beam score over the same clusters (the
  XR-Linear tree fit on the train split, ``--linear-clusters``; 0 where its beam did not
  reach the cluster).  The head and the TF-IDF tree miss different clusters: on
  yso-finna-sv-50k (K = 256, the 5-epoch CPU matcher) each alone reaches valid recall@10
  0.327, their mean 0.382 (test 0.282 / 0.261 -> 0.317); the least-squares head on the
  *pre-trained* encoder gives 0.241 alone and 0.347 with the tree, so fine-tuning is worth 3.5
  points of it (a tree over ``TF-IDF ⊕ phi``, XR-Transformer's reading, reached 0.356).  It
  is **not** the default: the rankers search the union of the matcher's top-b and the linear
  tree's top-b (``candidates: union``), and a fused top-b overlaps the tree's, so the union
  shrinks (17.6 -> 14.4 clusters per test document) and loses recall (0.395 -> 0.358).
  ``head+linear`` suits ``candidates: matcher``.  The stage writes both scorers' valid recall
  to ``guard.json`` (``head.scorers``) whenever the linear clusters of every split are given.
  With ``head+linear`` the guard also requires the head *alone* to beat the most frequent
  clusters, so the linear half cannot carry a head that learned nothing.

``pooling``, the loss and the bias-free head stay the paper's.  The runs of
``bench/bench_matcher_scale.py`` on one H200 (valid recall@b, b = 10, or K/2 at K < 20;
"linear start" = ``head_init: linear``, ``lr_head = lr``, before ``head_refit`` and
``length_bucket`` existed; "random" = the epoch schedule with the paper's head and the
old head learning rate):

=====================  =====  ======  ==========  ==============  ======================
data                   K      before  random      linear start    linear tree / frequent
                                      (3 epochs)  (2 epochs)
=====================  =====  ======  ==========  ==============  ======================
debtags                8      0.978               0.982           0.978 / 0.899
debtags                64     0.928               0.962           0.955 / 0.826
yso-finna-sv-50k       256    0.110   0.211       0.313 (3 ep)    0.327 / 0.109
                                                  0.328 (5 ep)
yso-finna-sv-50k       2048   0.013               0.194           0.219 / 0.017
yso-finna-sv-50k       8192   0.004               0.191           0.188 / 0.006
yso-finna-sv-full      256                        0.481           0.489 / 0.119
=====================  =====  ======  ==========  ==============  ======================

The guard (:func:`check_matcher`): after training, the valid cluster recall@b of the
matcher (its scorer's top-b; ``b`` = :func:`guard_width`) is compared with two trivial
matchers, the most frequent clusters (:func:`frequency_topb`) and the linear tree's beam over
the same clusters (XR-Linear fit on the train split, ``--linear-clusters``).  The matcher
passes when it beats both; or, an addition (the rankers search the union of both top-b,
``candidates: union``), when it beats the most frequent clusters and its top-b together
with the tree's top-b reach a higher recall than the tree's own top clusters, as many per
document as that union holds (the tree's list carries 2b clusters for this): it then finds
clusters the tree would not, whatever it scores at b alone.  That second way counts only where
the rankers search the union: rankers with ``candidates: matcher`` (the paper's Eq. 2, as in
config.paper.yaml and the paper-candidates variant) search the matcher's top-b alone, and their
stage (``xmc_steps.stages.xtransformer train --guard``) fails unless the matcher beat both baselines on
its own (``passed_alone`` in guard.json, :func:`alone_failure`).  A matcher that fails fails the
stage with the numbers and the settings to change, unless ``allow_weak``; the trained
weights stay in the checkpoint folder, so the rerun with ``allow_weak: true`` (or more
epochs) does not start over.  Why the second test: the English MiniLM's head alone on
Swedish library titles lands next to the linear tree (above it at K = 8,192, below at
K = 2,048, level at K = 256: 0.3275 against 0.3275), a coin for the first test; what it adds
to the union is not: at K = 256 the union reaches valid recall 0.467 with 17.5 clusters per
document, the tree alone 0.393 with as many (its top-20: 0.411; 10 random clusters with the
tree's top-10: 0.354; on test 0.395 / 0.318 / 0.334 / 0.288).  A matcher that learned
nothing fails both (``tests/test_workflow.py``).

Scores written by the stage (``clusters_{split}.npz``) are, with the ``head`` scorer, the
raw ``g(x, k)`` of the top-``b`` clusters per row (not probabilities; a transform such as
the l3-hinge of XR-Linear is the consumer's choice); with ``head+linear``, the fused scores
in (0, 1].  The rankers read only which clusters they are; Eq. 2's ``g`` is always the
head's (``search.matcher_scores``).  ``emb_{split}.npz`` holds ``phi(x)`` (fp32) for the
ranker's ``phi_tfidf ⊕ phi_neural`` features.

The rankers and the final score of Eq. 2 (§3.4)
===============================================

The matcher (above) maps a text to the top-``b`` of ``K`` label clusters and gives the
instance embedding ``phi_neural``; :mod:`.ranker` trains the linear one-vs-all rankers
``h(x, l) = w_l^T phi(x)`` and combines both:

* ranker input ``phi(x)``: ``phi_tfidf(x)`` alone (``ranker_input: tfidf``, Table 5 row 0)
  or ``phi_tfidf(x) ⊕ phi_neural(x)`` (``tfidf+neural``); each block is L2-normalised
  and the neural block is scaled by ``neural_weight`` (1 by default: blocks of equal norm);
* candidate clusters (``candidates``, :func:`candidate_clusters`): the clusters Eq. 2
  searches for a document —

  - ``matcher``: the matcher's top-``b`` (the paper: labels outside them are ``-inf``);
  - ``union`` (default): the matcher's top-``b`` together with the top-``b`` of the
    linear tree's beam over the same clusters (XR-Linear over the matcher's tree,
    ``python -m xmc_steps.stages.xr_linear clusters``).  *An addition the paper lacks*: a
    matcher that misses a document's clusters can then cost no recall that the
    linear path would have had, whatever the matcher learnt.  XR-Transformer, the
    paper's successor, likewise ranks with a linear model on ``TF-IDF ⊕ neural``
    features over its whole tree rather than inside the matcher's clusters only;
  - ``linear``: the linear tree's top-``b`` alone (a reference row);

* negatives (:mod:`xmc_steps.negatives`): TFN = ``Y C`` (instances with a positive in
  the label's cluster), MAN = the candidate clusters on the training data (``M_hat``:
  the matcher's top-``b``, as the paper, or the union), or TFN+MAN (``M' = YC + M_hat``);
  the rankers are trained on the negatives of the clusters they will be asked about;
* the solver is the foundation's :func:`xmc_steps.ranker.train_rankers` (L2-regularised
  squared hinge, weights below ``threshold`` dropped), one per label;
* prediction (Eq. 2): labels outside the candidate clusters get no score; inside,
  ``f(x, l) = sigma(g(x, c_l), h(x, l))`` with ``g`` the matcher's score of the label's
  cluster (:func:`~xmc_steps.search.matcher_scores`: ``w_k . phi(x)`` from the matcher's head and the
  stored embeddings, so linear-only candidates have a matcher score too) and the
  combiner ``sigma`` chosen by ``combiner``:

  - ``product`` (default): ``T(g) * T(h)``, as the XR-Linear beam search scores a path;
  - ``ranker``: ``T(h)``; the candidates decide which clusters are searched, the ranker
    orders the labels inside;
  - ``mean``: ``(T(g) + T(h)) / 2``;

  where ``T`` is ``transform`` (l3-hinge ``exp(-max(0, 1 - z)^3)`` by default: both the
  matcher (Eq. 3) and the rankers are squared-hinge models, whose margin is 1), floored
  at ``1e-30`` so that no candidate underflows to a dropped zero.  The paper leaves sigma
  open ("a non-linear activation function to combine the final scores").

Both defaults are chosen on the validation split: ``python -m xmc_steps.stages.xtransformer
select`` (the ``xtransformer-selection`` target) fits the rankers on train and writes the
table of every candidate set x combiner on valid to
``results/<dataset>/xtransformer-selection.{md,csv,json}``, so the choice can be
regenerated on any dataset.  The tables of the default config at dc5879b (2-core CPU,
2026-11-28), union candidates, valid P@1 / R@100:

=========================  =============  =============  =============
dataset (K clusters)       product        ranker         mean
=========================  =============  =============  =============
debtags (8)                92.61 / 97.23  92.74 / 96.73  92.65 / 95.34
reuters-all5 (4)           97.69 / 98.77  97.43 / 98.73  97.69 / 98.59
yso-finna-sv-50k (256)     19.88 / 31.45  18.92 / 31.01  19.52 / 28.16
=========================  =============  =============  =============

``product`` has the best mean P@1 over the three (70.06 against 69.70 for ``ranker``), is
ahead on the one set where the gap is larger than a handful of documents (yso: +0.96 P@1,
+0.46 P@3, +0.28 P@5, +0.44 R@100) and has the best R@100 on all three; ``ranker``
leads on debtags by 3 of 2,423 documents.  ``ranker`` was the default until then, chosen
on the debtags table of the first X-Transformer stop (older matcher and candidates: 92.86
against 91.79).  On test the switch moved P@1 / R@100 from 92.69 / 97.03 to 92.79 / 97.51
(debtags), 97.12 / 99.02 to 97.25 / 98.49 (reuters-all5) and 18.05 / 27.97 to 18.17 / 28.33
(yso-finna-sv-50k), the same rankers.  Union candidates lead the paper's matcher-only ones on yso (19.88 against 16.58
P@1, 31.45 against 23.01 R@100) and equal them where K <= b (debtags, reuters).
"""

from __future__ import annotations

from ..methods import lazy_exports

#: the public names, each imported from its module on first use (PEP 562): importing the package
#: (or a light module of it) loads nothing else, and the rankers' stage, which never needs torch
#: (:mod:`.ranker`, :mod:`.guard`), does not load it through :mod:`.params` or :mod:`.matcher`
_MODULE_OF = {
    **{name: ".guard" for name in ("GuardReport", "alone_failure", "check_guard", "check_matcher", "cluster_recall",
                                  "frequency_topb", "guard_width", "top1_precision")},
    **{name: ".matcher" for name in (
        "MatcherModel", "build_model", "cluster_targets", "evaluate_clusters", "finish_matcher", "head_linear_topb",
        "linear_head", "load_cluster_assignment", "load_matcher", "matcher_bytes", "predict_clusters", "refit_head",
        "squared_hinge_loss", "topb_from_emb", "train_matcher")},
    **{name: ".params" for name in ("HEAD_INITS", "SCORERS", "TRAIN_DEFAULTS", "TRAIN_MOVED", "MatcherParams")},
    **{name: ".ranker" for name in ("CANDIDATES", "COMBINERS", "RANKER_INPUTS", "XTransformerRankerParams",
                                   "candidate_clusters", "load_head", "ranker_bytes")},
}
_MODULES = ("guard", "matcher", "params", "ranker")

__all__ = [*_MODULES, *_MODULE_OF]
__getattr__ = lazy_exports(__name__, _MODULE_OF, _MODULES)
