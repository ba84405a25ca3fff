"""GUDN (Wang et al., "GUDN: A novel guide network for extreme multi-label text classification"):
the LightXML network (:mod:`xmc_steps.lightxml`) trained with a guide network that reads each
training text's gold label texts.

* Backbone (§3.4): LightXML's, with its clusters and dynamic negatives for large label sets and
  a full output layer for small ones (``flat_max_labels``); its parameters are ``backbone``
  (config: ``lightxml`` deep-merged with ``gudn.backbone``).
* Feature extractor (§3.2): one encoder for texts and label sequences.  A text's labels' texts
  are joined into one sequence (label index order, ``label_separator``) and encoded like a text
  (``label_max_length`` tokens).  Both representations are the summary-token states of the last
  10 layers, concatenated: the paper says 10 for the labels, and the link guide feeds the label
  features to the text's classifier, so both have the same width (the authors' code uses 10 for
  both); an encoder with fewer layers (MiniLM: 6) uses all of them, with a warning.
* Feature guide (Eq. 2) on the representations before dropout: ``feature_loss: paper`` is Eq. 2 as
  written, ``1/(2n) sum ||E_t - E_l||^2``; ``mean`` the mean over every coordinate, as the authors'
  ``MSELoss`` computes it, ``d / 2`` times smaller for features of width ``d`` (the default);
  ``relative`` (an addition) Eq. 2's squared distances divided by the batch's spread about its
  centre (:func:`.loss.feature_guide`).  The first two can be met by making every text's and every
  label sequence's features the same vector, and they are:

  - at the paper's scale, on the CLI toy (tests/test_gudn.py's data, tiny encoder, 100 steps): valid
    P@1 stayed at the frequency prior's 0.25 (the guard fails it), at learning rates 2e-3 and 5e-4
    alike, while ``mean``, the link guide alone and no feature guide all reached 1.0.  Width 3,840
    (BERT-base, 10 layers) makes the paper's scale 1,920 times the authors';
  - at the authors' scale (``mean``) on yso-finna-sv-50k (18,056 labels, flat, default config): the
    total variance of the text features over 1,000 validation texts fell from 16.9 (pre-trained)
    to 0.002 after 2,186 steps, their mean pairwise cosine from 0.966 to 1.000; a least-squares
    generator on the step-1,500 features (12,000 training texts) reached valid P@1 0.001, against
    0.075 on the pre-trained features; the trained model's valid P@1 was 0.0000 at steps 562, 1,124 and 1,686,
    and the run was stopped (a re-fit cannot bring such features above the linear start's 0.132,
    so the guard would have failed the stage).  The classification loss, BCE averaged over 18,056 labels, pushes the
    encoder too weakly to hold the features apart; on debtags (572 labels) it holds them, though
    only just: total variance 3.1 after training, against 56.8 without the feature guide.

  ``relative`` does not change when every feature is shifted or scaled alike, so shrinking the
  features buys nothing.  On yso-finna-sv-50k after 600 steps the text features' total variance
  was 39.4, not collapsed; but the least-squares generator on them reached 0.057 (12,000 texts)
  against 0.075 on the pre-trained features, where LightXML's own (5 layers) after 400 steps
  reached 0.082 against their pre-trained 0.073: the guide, now about 60 times the authors' at the
  start (0.8 against 0.013), still pulls the encoder away from what the labels need there.  On
  debtags (default config otherwise, one CPU thread beside another run, 3,359 s) it costs: valid
  P@1 0.863 at the start, 0.896 trained, 0.907 re-fit; test P@1 90.69, P@3 62.71, P@5 46.30, PSP@5
  61.99, R@100 98.06, against ``mean``'s 92.09, 64.73, 48.64, 68.90, 97.65.  So ``mean`` stays the
  default loss; what the default does on yso-finna-sv-50k is the weight's business (below).
  LightXML's own encoder after the same 600 steps (default recipe, flat, no weight average, one CPU
  thread), re-fit on all 45,000 training texts: valid P@1 0.063, where ``relative``'s reached 0.098
  (the linear starts: 0.128 and 0.132).  So early in training the guide is not what loses the start (the
  classification loss does, for LightXML too); the gap opens later: after the 2-epoch runs below,
  LightXML's re-fit is at 0.146 and ``relative``'s at 0.075.

  Two further tries on yso-finna-sv-50k, full default runs (2 epochs) on one NVIDIA H200 beside each
  other (bench/gpu_lightxml_gudn.sh, the overlay bench/clustered.yaml), neither enough:

  - ``relative``, flat: valid P@1 0.132 at the start, 0.0025 after 562 steps, at most 0.001 from
    step 1,124 to the end; the re-fit generator 0.075, below the start, so the guard failed the
    stage (LightXML, flat, same run: 0.129 start, 0.107 trained, 0.146 re-fit; test P@1 13.68).
  - LightXML's clusters (§3.4, the paper's way for large label sets; 512 clusters of <= 36 labels,
    ``mean``), from a random discriminator: test P@1 2.36, P@5 1.52, R@100 16.65, level with LightXML
    on the same clusters (2.12): the random label embeddings did not learn in 2 epochs there
    (xmc_steps/lightxml, "The clustered start").  With the least-squares start of the label
    embeddings (``discriminator_init: linear``, one CPU thread beside two other runs): valid P@1 0.080
    at the start, 0.0035 after 562 steps and 0.0045 after 1,124, where LightXML on the same clusters
    and start had 0.024 and 0.037 (and went on to 0.070 at step 2,810); the run was stopped there.
    So the clusters do not keep the guide from pulling the encoder away either.

  Which guide does it (flat, default recipe, 1,124 steps, one CPU thread each, side by side; valid P@1
  at steps 562 / 1,124, the linear start 0.132): the link guide alone (``gudn-no-feature-guide``)
  0.0030 / **0.0405**, ahead of LightXML's 0.0005 / 0.018 at the same steps; the feature guide
  alone (``gudn-no-link-guide``, ``relative``) 0.0025 / 0.0010.  On yso-finna-sv-50k the feature
  guide is what holds the encoder down, in every form tried, while the label texts through the link
  guide help: the lead for GUDN's default there.
* The feature guide's weight (``feature_weight``; an addition, Eq. 6 has none).  Why the guide
  behaves so differently across label spaces: Eq. 1's classification loss is a mean over the model's
  outputs (L labels flat; K clusters plus the candidates clustered), so its pull on the encoder shrinks
  as they grow, while the guide's does not; and the guide's gradient points the same way batch after
  batch (the features together: the norm of its mean over 16 batches is 0.955-0.965 of its mean norm on
  all four sets below), the classification's much less (0.27 debtags, 0.48 reuters).

  - ``fixed``: weight 1, Eq. 6 as written (``config.paper.yaml``).
  - ``balanced``: at each step ``min(1, r)`` with ``r = ||dL_class/dE_t|| / ||dL_feature/dE_t||`` at
    the text features, so the guide never pulls the features harder than the classification loss.
    Not enough: on yso-finna-sv-50k (weight 0.04-0.32 over the first 1,180 steps) valid P@1 fell from the
    start's 0.132 to 0.0010 at step 562 and 0.0000 at step 1,124, the guide's loss from 0.038 to 0.0068:
    bounded at every step, the pull still always points the same way and collapses the features; stopped
    there.  On debtags the weight stayed 1 at every logged step (192 of the first 1,920), i.e. ``fixed``.
    With ``relative`` the weight on yso was 0.003-0.006, but on debtags 0.985-1, which is ``relative``
    unweighted: valid P@1 0.822 at step 272 against ``mean``'s 0.861 (the full run's test P@1: 90.69,
    above); not a default.
  - ``gated`` (**the default**): decided once, at the start, on the start's own model
    (:func:`.loss.gate_ratio`): the mean norm of the classification loss's gradient over the encoder's
    parameters divided by the feature guide's (``mean``; 16 batches of 16 spread over the training set).
    At 1 or more the guide is on at Eq. 6's weight 1 for the whole run (the run is bit for bit
    ``fixed``'s, tests/test_gudn.py), below 1 it is off (the link guide alone).  The stage logs the
    ratio and records it (``feature_gate_ratio``, ``lightxml.json``'s ``gudn.feature_gate``); a resumed
    run keeps its start's decision.  Measured at the linear starts:

    | set (default config) | outputs | gate ratio | the text-feature ratio ``r`` | guide on? | evidence |
    |---|---|---|---|---|---|
    | debtags | 572 flat | 2.72 | 60.2 | on | the guide adds P@5 and PSP@5 (below) |
    | reuters21578/modapte-all5 | 368 flat | 1.96 | 32.2 | on | ahead of LightXML on every metric |
    | yso-finna-sv-50k, clustered | 512 clusters + ~360 candidates | 0.69 | 10.2 | off | see below |
    | yso-finna-sv-50k | 18,056 flat | 0.026 | 0.141 | off | the probes above |

    On yso's clusters (``bench/clustered.yaml``, linear label embeddings) valid P@1 after 562 steps was
    0.0035 with the guide at weight 1 (last stop), 0.0345 with the link guide alone, 0.024 for LightXML.
    The first version of this gate compared ``r`` at the text features and would have opened there
    (10.2): the head's gradient at the features says little about what reaches the encoder's weights,
    and the feature guide reaches them through the label sequences too.  The threshold is where the
    two pulls are equal; it was not fitted, but it was chosen after these four sets were measured, and
    the closest of them sit 1.96x above and 1.45x below it.
  The default on yso-finna-sv-50k (gate shut, flat, 2 epochs, one CPU thread beside other runs, 7,243 s of
  stage time): valid P@1 0.132 at the start, 0.0025 / 0.041 / 0.075 / 0.101 / 0.113 / 0.125 / 0.133 /
  0.138 / 0.145 / 0.151 every 562 steps (LightXML: 0.0005 / 0.018 / 0.045 / 0.067 / 0.081 / ... / 0.109),
  0.147 with the weight average, 0.167 with the re-fit generator (kept); **test P@1 15.97, P@3 10.36,
  P@5 7.89, nDCG@5 16.62, PSP@5 12.08, R@10 22.18, R@100 35.43**, against LightXML's 13.66 / 8.72 / 6.76,
  PSP@5 10.20, R@100 32.08 (same recipe), xr-linear's 15.79 / 9.04 / 6.37, R@100 20.11 and the reference
  XR-Transformer's 14.94 / 8.59 / 5.99, R@100 20.47: the label texts, through the link guide, put GUDN
  ahead of LightXML on every metric there too.
* Link guide (Eq. 3): the backbone's classification loss with the label features in place of the
  text's: BCE over all labels for a flat model; LightXML's ``L_g + L_d`` for a clustered one,
  the candidates drawn from the label features' generator.
* Overall (Eq. 6): ``L_class + L_feature + L_link``; ``feature_guide`` / ``link_guide`` switch a
  guide off (the ``gudn-no-feature-guide`` and ``gudn-no-link-guide`` targets, Table 3).
* Prediction uses the text alone: the saved model is a LightXML network
  (``python -m xmc_steps.stages.lightxml predict``).
* A dataset without label texts (ingest found no ``label_texts.txt``) stops the stage with an
  error naming that file.

Measured on debtags (572 labels named like "Role: Program", default config: LightXML's start,
rates and ``head_refit``, MiniLM's 6 layers; one CPU thread beside another run, 97 minutes of stage
time): valid P@1 0.863 at the linear start, 0.911 trained, 0.923 with the re-fit generator; test
P@1 92.21, P@3 64.64, P@5 48.71, nDCG@5 88.93, PSP@5 68.98, R@100 97.71, against LightXML's 92.26,
64.28, 48.15, 88.35, 66.64, 97.94 with the same settings: the label texts buy P@3/P@5 and the
tail (PSP@5 +2.3), not P@1.
At the default precision since (bf16 autocast on this AVX512-BF16 CPU, :mod:`xmc_steps.neural`),
alone on 2 cores: **2,309 s of stage time** (38.5 minutes: 2,727 steps at 19-27 seq/s, the re-fit
160 s); valid P@1 0.863 at the start, 0.912 trained, 0.922 re-fit; test P@1 92.09, P@3 64.73, P@5
48.64, nDCG@5 88.81, PSP@5 68.90, R@100 97.65.  Against LightXML's three bf16 training seeds (P@1
92.15 +- 0.18, P@5 48.16 +- 0.08, PSP@5 66.74 +- 0.24) the same picture: level at P@1, ahead at P@5
(+0.48, six standard deviations of the seeds) and on rare labels (PSP@5 +2.2).
With the ``gated`` default (the gate open: 2.72, or 60.2 by its first version, which this run used;
the ``fixed`` run's trajectory, the same valid
P@1 at every evaluation as a ``balanced`` run whose weight stayed 1), one CPU thread beside another training:
2,235 s of stage time; valid P@1 0.863 / 0.913 / 0.924; test P@1 92.14, P@3 64.55, P@5 48.71, nDCG@5
88.88, PSP@5 69.03, R@100 97.70.

Files: :mod:`.params` (:class:`GUDNParams`), :mod:`.loss` (Eqs. 2-4, and :class:`GuideNetwork`: the guide
as :func:`xmc_steps.lightxml.train.train_lightxml` takes it), :mod:`.labels` (the label sequences).  The
stage is :mod:`xmc_steps.stages.gudn` (``python -m xmc_steps.stages.gudn train``): it builds the guide and
trains the backbone with it through LightXML's own training run (:func:`xmc_steps.lightxml.run.run_training`).
"""

from ..methods import lazy_exports

#: the public names, each imported from its submodule on first use (``import xmc_steps.gudn.spec`` costs no torch)
_EXPORTS = {
    "GUDNParams": ".params",
    "GuideNetwork": ".loss",
    "feature_guide": ".loss",
    "gate_ratio": ".loss",
    "guide_loss": ".loss",
    "label_sequences": ".labels",
    "label_tokens": ".labels",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
