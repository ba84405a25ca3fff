"""X-Transformer (Chang et al., KDD 2020): a transformer *matcher* that maps a text to the top-``b``
of ``K`` label clusters (§3.3), and linear one-vs-all *rankers* that score the labels of those
clusters, combined by Eq. 2 (§3.4).

Readings and measured choices: docs/methods/xtransformer.md (what makes it learn at every K, the
rankers and the final score of Eq. 2, the validation tables behind the defaults).

Modules
-------
* :mod:`.params`: :class:`MatcherParams` (the ``xtransformer.matcher`` section) and its training
  recipe :data:`TRAIN_DEFAULTS`;
* :mod:`.matcher`: :class:`MatcherModel` and Eq. 3's loss, the least-squares heads, training
  (:func:`train_matcher`), the cluster scores (:func:`predict_clusters`, :func:`topb_from_emb`,
  :func:`head_linear_topb`), :func:`finish_matcher` and :func:`load_matcher`; the matcher's prediction
  (:class:`PredictParams`, saved with it; :func:`embed_texts` and :func:`top_clusters`, the end-of-training
  pass's and serving's :func:`predict_matcher`);
* :mod:`.run`: the matcher's training run its stage calls (as ELIAS's and LightXML's ``run``);
* :mod:`.guard`: on the shared :mod:`xmc_steps.guard`, the cluster metrics, the trivial matchers, :class:`GuardReport`,
  :func:`check_matcher` (the matcher stage's test) and :func:`alone_failure` / :func:`check_guard`
  (the rankers' test with ``candidates: matcher``);
* :mod:`.ranker`: :class:`XTransformerRankerParams` (``xtransformer.ranker``), the candidate clusters,
  the rankers' training, Eq. 2 (``ranker.train``, ``ranker.predict``; ``ranker.predict_model``, the
  prediction the predict stage and serving share), the model folder and
  :func:`load_head`.  It loads no torch, nor does :mod:`.guard`.

The names above can be imported from the package itself (``from xmc_steps.xtransformer import
MatcherParams``); each is imported from its module on first use, so importing the package loads
nothing, and the rankers' stage starts without torch.

The stages: ``python -m xmc_steps.stages.matcher`` (:mod:`xmc_steps.stages.matcher`) and
``python -m xmc_steps.stages.xtransformer train|predict|select`` (:mod:`xmc_steps.stages.xtransformer`).
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
        "MatcherModel", "PredictParams", "build_model", "cluster_targets", "embed_texts", "evaluate_clusters",
        "finish_matcher", "head_linear_topb", "linear_head", "load_cluster_assignment", "load_matcher", "matcher_bytes",
        "predict_clusters", "predict_matcher", "refit_head", "squared_hinge_loss", "top_clusters", "topb_from_emb",
        "train_matcher")},
    **{name: ".params" for name in ("HEAD_INITS", "SCORERS", "TRAIN_DEFAULTS", "TRAIN_MOVED", "MatcherParams")},
    **{name: ".ranker" for name in ("CANDIDATES", "COMBINERS", "RANKER_INPUTS", "XTransformerRankerParams",
                                   "candidate_clusters", "load_head", "ranker_bytes")},
}
_MODULES = ("guard", "matcher", "params", "ranker")

__all__ = [*_MODULES, *_MODULE_OF]
__getattr__ = lazy_exports(__name__, _MODULE_OF, _MODULES)
