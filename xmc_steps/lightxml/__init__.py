"""LightXML (Jiang et al., AAAI 2021): one transformer trained end to end with a generator that
recalls label clusters and a discriminator that ranks their labels, the negatives re-drawn from
the current generator at every step ("dynamic negative sampling").

Model (:class:`LightXMLModel`)
------------------------------
* Text representation ``e``: the summary-token states of the last ``last_k`` (5) layers,
  concatenated (:class:`xmc_steps.neural.TextEncoder`, ``pooling="cls-concat-last-k"``: the
  summary token is the first one, or the last real one for XLNet), then dropout ``dropout``
  (0.5, "a high rate of dropout").
* Label clusters: the finest level of the shared balanced tree (``index/pifa-tfidf/tree-b2-l{s}``:
  balanced 2-means on PIFA label vectors down to at most ``s`` labels per cluster, at least
  ``s / 2``, as the paper builds them after AttentionXML).  For a small label set
  (``L <= flat_max_labels``; the paper does this for Eurlex-4K, AmazonCat-13K and Wiki10-31K)
  every label is its own cluster: the generator scores every label and there is no discriminator.
* Generator (Eq. 1): ``G(e) = sigmoid(W_g e + b_g)`` over the ``K`` clusters, BCE against the
  text's clusters.
* Candidates (Eq. 2): the labels of the top-``topb`` clusters by the *current* ``G(e)``
  (detached: the generator learns from the ground truth only, as the paper says), re-drawn at
  every step and never cached.  In training the positives are added: ``train_candidates:
  positives`` adds the positive labels that the top clusters miss (the paper: "all positive
  labels are added to this subset", Algorithm 1 lines 9-13); ``positive-clusters`` ranks the
  positives' clusters first, so their whole clusters become candidates (what the authors'
  released code does, which also makes the positives' cluster siblings negatives).
* Discriminator (Eqs. 3-4): ``D(e, M) = sigmoid(M act(W_h e + b_h))`` with ``M`` the rows of the
  label embeddings ``E`` (``L x hidden``, Xavier-uniform; "initialized randomly") of the
  candidates only: a batch gathers ``B x S x hidden`` values, never ``B x L``.  ``act`` is the
  sigmoid of Eq. 4 (``bottleneck: sigmoid``, the default: the paper's equation) or the identity
  (``bottleneck: linear``, the authors' code).
* Loss (Eqs. 1, 5, 6): ``L_g + L_d``, each BCE averaged over its entries (``B x K`` for the
  generator, the real candidates for the discriminator): the paper writes sums, which would
  scale the step size with ``K`` and the candidate count; the mean is what the authors train
  with.
* Prediction: ``p_l = G(e)_{g_c(l)} * D(e, M)_l`` over the candidates of the top-``topb``
  clusters (no positives added); flat: ``p = G(e)``.  The top ``topk`` (100) are written.

Static negatives (``negatives: static``, the ``lightxml-static`` target: Table 5's "S")
-------------------------------------------------------------------------------------
The paper compares its dynamic negatives with static ones "from a generator trained first"; its
two sentences on how (S: "trained label recalling with the freeze text representation of trained
label ranking") do not say where the ranking part's negatives come from.  Our reading isolates
exactly what the table measures, the negatives: the generator (with the encoder) trains alone
with ``L_g`` for the first ``static_switch`` (0.5) of the steps; then the top-``topb`` clusters
of every training text are drawn once from it (eval mode) and kept (in the checkpoint), and the
rest of the run trains Eq. 6 as usual except that the candidates are those drawn clusters (plus
the positives) instead of a fresh draw.  The generator keeps learning from ``L_g``, so prediction
is the same ``G x D`` as the dynamic model's and the model has the same size.  Static negatives
need clusters: a model with one label per cluster draws no negatives (the stage says so).
Measured on debtags in the clustered mode (``bench/clustered.yaml``: 128 clusters of <= 5 labels,
top-10 clusters as candidates; default config otherwise, bf16, one CPU thread each): dynamic
test P@1 90.18, P@5 43.83, PSP@5 57.13, R@100 94.91; static 85.94, 42.07, 55.08, 94.92 (valid
P@1 0.903 against 0.865, both with the re-fit generator).  The paper's direction, with the
caveat of our reading that the static discriminator trains on half the steps.  Both are below
the flat default (91.95), where every label is scored.  Those runs started from random label
embeddings; from the least-squares ones (``discriminator_init: linear``, the default since; "The
clustered start" below) the gap narrows and the direction holds: dynamic 92.03, 46.12, 63.20, 95.19;
static 91.19, 45.69, 61.78, 95.06 (valid P@1 0.922 against 0.915, both with their heads re-fit).

Ensembles (``lightxml-ensemble``)
---------------------------------
One model per encoder x seed of ``lightxml.ensemble`` (the paper: three encoders for the small
label sets, three clusterings for the large ones), their test predictions averaged by
:mod:`xmc_steps.ensemble`.  A member's seed is both its clustering seed and its training seed
(data order, initialisation), so seeds differ even where there are no clusters.

Training
--------
AdamW, one learning rate for every part (``train.lr``, 1e-4 constant: ``train.schedule:
constant``, no warm-up), weight decay 0.01 except on biases and LayerNorm weights (the
paper's sentence says the opposite, "0.01 weight decay for bias and layer norm weight", which
we read as the usual exemption it inverts by mistake: decaying only biases and norms while
leaving the weights free has no use), autocast on CUDA.  Stochastic weight averaging: from
``swa_start`` of the steps on, the weights are added to a running average every
``swa_every_epochs`` epochs, and the average is the saved model (the authors start it after
4 of 10 epochs on Wiki-500K and 10 of 20 on Eurlex-4K, adding every 3,000 and 200 steps).
The final model is the one after the last step (no selection on validation).

The start and the rates (our defaults in ``config.yaml``; the class defaults and
``config.paper.yaml`` are the paper's)
-----------------------------------------------------------------------------------------------
The paper's recipe (a random generator, one constant rate 1e-4 for every part, dropout 0.5) trains
for 5-30 epochs on a V100.  In a run a CPU can afford it does not learn: on debtags (572 labels,
flat), one epoch of MiniLM at 64 tokens ended at valid P@1 0.2725, *below* the frequency prior's
0.345 (the loss fell from 0.69 to 0.025: every label pushed negative, the ranking the label
priors'), which the guard caught.  Three settings, each a named option, make it learn:

* ``head_init: linear`` (an addition; ``random`` is the paper): before the first step the generator
  ``W_g, b_g`` is the least-squares fit of its targets ``+-head_init_scale`` (4) on the
  *pre-trained* encoder's representations of the training texts (:mod:`xmc_steps.linear_start`, as
  the X-Transformer matcher's ``head_init: linear``; clusters' targets when clustered; for the
  discriminator's label embeddings see "The clustered start" below).  One inference pass over the
  training split (about 4 minutes for debtags on 2 cores).  On debtags this start alone has valid
  P@1 0.879 / P@5 0.430.
* ``lr_generator`` (``null`` = ``train.lr``, the paper's one rate): 1e-5.  The discriminator (bottleneck
  and label embeddings) trains at ``train.lr``.  Adam moves every weight by about the rate per step; at 1e-4 the fitted start is
  worn down faster than the encoder improves.
* ``dropout``: 0.1 instead of the paper's 0.5.  Dropout at 0.5 on the concatenated
  representation is a strong ridge on the generator; over a few thousand steps it costs more than
  it regularises.

Measured on debtags (300 steps of batch 16, encoder at a constant 1e-4, SWA off, valid P@1 / P@5
on 1,000 documents after 150 and 300 steps; 2-core CPU):

==============================================  ===============  ===============
start, head rate, dropout                       step 150         step 300
==============================================  ===============  ===============
linear, 1e-4 (one rate), 0.5                    0.788 / 0.334    0.815 / 0.346
linear, 1e-5, 0.5                               0.750 / 0.285    0.842 / 0.347
linear, 1e-5, 0.5, warm-up 30 + linear decay    0.810 / 0.318    0.793 / 0.312
**linear, 1e-5, 0.1** (the default)             0.806 / 0.407    0.876 / 0.438
==============================================  ===============  ===============

The full default run on debtags (2 epochs = 2,727 steps, 43 minutes of stage time on 2 cores, of
which 5 for the start and 5 for validation): valid P@1 0.868 after 272 steps, 0.885 after one epoch,
0.906 at the end and 0.911 with the weight average; test P@1 91.20, P@5 45.70.  On
reuters21578/modapte-all5 (368 labels, 875 steps, 14 minutes): valid P@1 0.949 at the start, 0.979 at
the end; test P@1 96.65, P@5 42.54 (xr-linear on the same data: 95.99, 44.86).

Guard: after training the stage compares the model's valid P@1 with the frequency prior's
(every text gets the most frequent training labels) and, with ``head_init: linear``, with the
linear start's own (measured on the validation split before the first step, kept in the
checkpoint, the curve's step 0): a model not above the prior, or below its start, fails the stage
with the numbers (``allow_weak: true`` keeps it with a warning).  The second test matters on a
large label space, where the prior is near 0 (yso-finna-sv-50k: 0.001) and passes almost anything.

Not yet solved: yso-finna-sv-50k (18,056 labels, flat).  The linear start has valid P@1 0.129
there (xr-linear's test P@1 is 15.79), but fine-tuning loses it within a few hundred steps with
these defaults (valid P@1 0.001 after 562 steps); neither a common bias shift that balances the
BCE's push on the negatives against its pull on the positives (330 against 2.8 per text at the
start), nor an encoder rate of 2e-5, kept it (0.027 and 0.034 after 150 and 300 steps), and one
rate of 1e-4 for every part lost it faster (0.001 after 150 steps).  The guard fails such a run.
Measured since (a probe: the default recipe for 400 steps, then a least-squares
generator on the *fine-tuned* encoder's representations of 12,000 training texts): the trained
model's valid P@1 is 0.000, the refit's 0.082, and the same refit on the *pre-trained* encoder's
representations of those texts 0.073.  So the encoder is not what is lost: the generator falls out
of step with it (the joint BCE moves the encoder faster than the generator, at ``lr_generator``,
follows over thousands of rare labels).  ``head_refit: true`` (the default; ``config.paper.yaml``
keeps the trained generator) therefore re-fits the generator by least squares after training,
on all training texts, and keeps whichever generator ranks the validation texts better
(:func:`.train.refit_generator`; the X-Transformer matcher does the same for its head).  On
debtags it helps too: valid P@1 0.9142 as trained, 0.9208 re-fit (307 s on 2 cores); test P@1
92.26, P@5 48.15, R@100 97.94 (without it, the run above: 91.20, 45.70, 90.88).  The full
yso-finna-sv-50k run with it (default config, 2 epochs = 5,625 steps; one CPU thread beside other
runs, 140 minutes of stage time): valid P@1 0.129 at the start, 0.0005 after 562 steps, then
recovering (0.022, 0.047, 0.065, 0.075, 0.085, 0.092, 0.102, 0.108 every 562 steps), 0.111 with the
weight average, **0.144 with the re-fit generator** (kept); test P@1 14.06, P@5 6.79, R@100 32.68
(xr-linear 15.74, 6.37, 20.12).  Fine-tuning does gain over the start once the generator is
caught up; the early collapse and the generator's drift during training (which in the clustered
mode also feeds the discriminator its negatives) remain open.
Precision on the CPU: ``amp: auto`` runs the steps and the inference passes in bf16 autocast on a
CPU with native bf16 (:mod:`xmc_steps.neural`).  The default debtags run on this machine's 2-core AMD
EPYC (AVX512-BF16), alone on it: **1,566 s of stage time** (the start's pass over the training texts
at 196 seq/s, 2,727 steps at 37-41 seq/s, the re-fit 155 s), under the 40 minutes that 2 epochs are
sized for; the fp32 run above took 3,321 s, under another run's load (measured in one process, bf16
is 1.7x faster per training step and 1.8x in inference).  Valid P@1 0.858 at the start (fp32:
0.859), 0.917 trained, 0.925 re-fit; test P@1 91.95, P@5 48.08, PSP@5 66.52, R@100 97.98 (fp32:
92.26, 48.15, 66.64, 97.94).  Training seeds 1 and 2 (one thread each, side by side, 3,240 s):
test P@1 92.31 and 92.19, so the three bf16 seeds give P@1 92.15 +- 0.18 (std) and P@5
48.16 +- 0.08; their average (``lightxml-ensemble``) 92.49, P@5 48.40, PSP@5 67.15, R@100 98.38.
The one-run difference between the precisions is inside that spread and inside the test split's
own sampling error (+-0.35 points of P@1 on 6,059 documents).
yso-finna-sv-50k in bf16 (default config, one thread beside another run, 6,085 s of stage time
against the fp32 run's 8,407 s): valid P@1 0.128 at the start, the same early loss (0.0005 after
562 steps) and recovery (0.018, 0.045, 0.067, 0.081, 0.084, 0.089, 0.100, 0.106, 0.109), 0.111
with the weight average, 0.142 re-fit (kept; fp32 0.144); test P@1 13.66, P@5 6.76, R@100 32.08
(fp32: 14.06, 6.79, 32.68; the test split's sampling error is +-0.34 points of P@1 on 10,000 documents).
The clustered start (``discriminator_init``)
--------------------------------------------
In the clustered mode a random ``E`` (the paper) has to be learned from the candidates alone, each
label's row moving only in the steps where it is a candidate.  On one NVIDIA H200 (default config,
2 epochs, bench/gpu_lightxml_gudn.sh, the overlay bench/clustered.yaml) that was enough on debtags
(128 clusters of <= 5 labels: valid P@1 0.301 at the start, 0.904 re-fit; test P@1 90.00) but not on
yso-finna-sv-50k (512 clusters of <= 36 labels): valid P@1 0.008 at the start, 0.004 after 562
steps, 0.018 after 5,625, 0.020 re-fit; test P@1 2.12, P@5 1.46, R@100 16.38, against the flat
model's 13.68, 6.71, 32.11 from the same run; GUDN on the same clusters: test P@1 2.36.  The guard
passed both: the frequency prior (0.0008) and a start with a random discriminator are no baselines.
``discriminator_init: linear`` (an addition, the default; ``random`` is the paper) starts ``E`` as
each label's least-squares fit on the bottleneck's features of the pre-trained representations
(:func:`.train._fit_discriminator`: the bottleneck as drawn, targets ``+-head_init_scale`` over all
training texts, the same pass over the texts as the generator's start), and ``head_refit`` then
also re-fits ``E`` on the trained bottleneck's features after the generator, kept when valid P@1
is higher (:func:`.train.refit_generator`).  The default was chosen on these runs (default config
otherwise, 2 epochs, one CPU thread each beside one or two other runs; the random rows are the
H200 run above, same precision and seed):

==========================  =====================================  =====================================
valid P@1                   debtags clustered                      yso-finna-sv-50k clustered
==========================  =====================================  =====================================
start: random / linear E    0.301 / **0.789**                      0.008 / **0.079**
step 562 (yso) / 544        0.862 / 0.815                          0.004 / **0.024**
trained                     0.901 / **0.910**                      0.018 / **0.101**
generator re-fit            0.904 / **0.916**                      0.020 / **0.108**
label embeddings re-fit     - / **0.922** (kept)                   - / **0.115** (kept)
test P@1 / P@5 / PSP@5      90.00 / 43.90 / 57.14 ->               2.12 / 1.46 / 2.10 ->
                            **92.03 / 46.12 / 63.20**              **11.32 / 3.98 / 5.73**
test R@100                  94.92 -> 95.19                         16.38 -> 18.55
==========================  =====================================  =====================================

On yso the clustered model still loses most of its start in the first few hundred steps and then
recovers (0.037, 0.049, 0.060, 0.070, 0.081, 0.080, 0.094, 0.095, 0.106 every 562 steps), as the
flat one does; it stays below the flat default there (test 13.68 / 6.71, R@100 32.11), its recall
bounded by the 10 clusters' 360 candidates.  The flat model's start is 0.129 (all 2,304 features,
where ``E`` sees 300 random ones).  The guard now has a start worth the name in the clustered mode
too: a clustered model that loses it fails the stage.

The generator's start is not shown to help on the test suite's clustered toy (MiniLM at
16 tokens, 135 steps at one rate of 3e-4) the run from the linear start ends at test P@1 48-53,
from the random start at 97 (``tests/test_workflow.py`` runs the toy from the random start); and
since the network's random parts are drawn from ``train.seed`` (before, from whatever state the
global generator was in), the CLI toy's clustered mode is seen to depend on the seed: valid P@1
0.56, 1.0, 0.75, 1.0 for seeds 0-3 after 120 steps, with or without ``head_refit`` (the
discriminator, not the generator, is what varies there).

Files: :mod:`.params` (:class:`LightXMLParams`), :mod:`.model` (the network, candidates, losses,
inference, loading), :mod:`.train` (the training driver, and the :class:`~.train.Guide` another loss plugs
in as), :mod:`.run` (a training run as the stages run it: inputs, model, training, guard, outputs).  The
stage is :mod:`xmc_steps.stages.lightxml` (``python -m xmc_steps.stages.lightxml``).
"""

from ..methods import lazy_exports

#: the public names, each imported from its submodule on first use (``import xmc_steps.lightxml.spec`` costs no torch)
_EXPORTS = {
    "FORMAT": ".model",
    "TRAIN_DEFAULTS": ".params",
    "Candidates": ".model",
    "Guide": ".train",
    "LightXMLModel": ".model",
    "LightXMLParams": ".params",
    "build_model": ".model",
    "cluster_table": ".model",
    "frequency_prior": ".train",
    "load_lightxml": ".model",
    "predict": ".model",
    "train_lightxml": ".train",
    "valid_metrics": ".train",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
