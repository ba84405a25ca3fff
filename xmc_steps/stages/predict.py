"""Ask a trained target about new text: the top labels, with their names and scores.

    python -m xmc_steps.stages.predict --model results/debtags/lightxml --top-k 10 < texts.txt
    python -m xmc_steps.stages.predict --model results/debtags/xr-linear --input texts.txt --out top.jsonl

``--model`` is a target of the DAG, ``results/<dataset>/<method>`` (any method or variant the
DAG evaluates: ``xr-linear``, ``parabel``, ``xtransformer[-<variant>]``, ``elias[-<row>]``,
``lightxml[-ensemble|-static]``, ``gudn[-<ablation>]``).  The target's effective settings
(``results/<dataset>/config/<method>.json``, written by the DAG) say which trained artifacts
make it up (:mod:`xmc_steps.layout`); each is checked before anything is computed, and a
missing one is an error naming it and the command that builds it.

The input is one text per line (``--input FILE`` or stdin), UTF-8; ``FILE`` may be a pipe
(``--input <(head -1 texts.txt)``, a FIFO), read once.  A line that is not valid
UTF-8 or is empty (nothing but white space) is an error naming the file and the line, unless
``--skip-empty``: such lines are then answered with no labels.  The texts go through the same
code as the DAG's test split: the fitted TF-IDF (``features/tfidf/vocab.parquet`` and the
tfidf settings), the encoder's tokenizer at the target's length, then the method's own scoring
functions (the ones its predict stage calls), and ensembles combine their members as the
ensemble stage does.

Output: one JSON object per input line, in order: ``{"line": n, "labels": [{"label": id,
"name": text, "score": s}, ...]}`` (best first; with ``--ids FILE``, one id per input line, also
``"id"``) on stdout, or with ``--out FILE`` written to that file, which appears only when every
line is done (no half-written file); ``--out X.parquet`` writes a table instead, one row per text
and label (``line``, ``id``, ``rank``, ``label``, ``name``, ``score``).  Lines are read and
answered in batches of ``--batch-size`` with a progress bar on stderr.  ``--device`` picks CPU or
CUDA for the neural methods (``auto``: CUDA when visible).

stdout carries the answers and nothing else: while a batch is scored, file descriptor 1 points at
stderr (:func:`xmc_steps.proc.stdout_to_stderr`), since native code (omikuji's Rust logger) prints
to the descriptor itself.  ``--ids`` with stdin input reads the input first (its lines must be
counted against the ids before any answer is printed).  A UTF-8 byte-order mark at the start of the
input or of the ids file is not part of the first line.
"""

from __future__ import annotations

import argparse
import io as _io
import logging
import os
import sys
from pathlib import Path

from .. import io
from ..serving import PredictError, Target, answers, read_ids, read_texts, write_jsonl, write_parquet


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m xmc_steps.stages.predict", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a trained target: results/<dataset>/<method>")
    p.add_argument("--top-k", type=int, default=10, help="labels per text (default 10)")
    p.add_argument("--input", default="-", help="texts, one per line (default: stdin)")
    p.add_argument("--out", help="write to this file instead of stdout: JSON lines, or a table (one row per text "
                                 "and label) when it ends in .parquet")
    p.add_argument("--ids", help="a file of ids, one per input line, written beside each answer")
    p.add_argument("--batch-size", type=int, default=256, help="texts per batch (default 256)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:n] (neural methods)")
    p.add_argument("--skip-empty", action="store_true", help="answer empty lines with no labels instead of failing")
    return p


def check_out(path: Path) -> None:
    """A :class:`PredictError` naming why ``--out`` cannot be written, before any text is answered."""
    if path.is_dir():
        raise PredictError(f"--out {path}: is a folder; give a file name (.jsonl, or .parquet for a table)")
    parent = path.parent
    for anc in [parent, *parent.parents]:
        if anc.exists():
            if not anc.is_dir():
                raise PredictError(f"--out {path}: {anc} is a file, not a folder")
            if anc == parent and not os.access(anc, os.W_OK | os.X_OK):
                raise PredictError(f"--out {path}: no permission to write in {anc}")
            break
    if not parent.exists():
        raise PredictError(f"--out {path}: the folder {parent} does not exist")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.top_k < 1 or args.batch_size < 1:
        print("error: --top-k and --batch-size must be at least 1", file=sys.stderr)
        return 2
    try:
        if args.device not in ("auto", "cpu"):
            from ..neural import resolve_device

            try:
                resolve_device(args.device)
            except (ValueError, RuntimeError) as e:
                raise PredictError(f"--device {args.device}: {e}") from None
        if args.out:
            check_out(Path(args.out))
        source = Path(args.input) if args.input != "-" else None
        if source is not None and source.is_dir():
            raise PredictError(f"--input {source}: is a folder, not a file of texts (one per line)")
        if source is not None and not source.exists():
            raise PredictError(f"--input {source}: no such file")
        target = Target.load(args.model)
        if source is not None and not source.is_file():
            # a pipe (process substitution, /dev/fd/N) is read once: into memory, then counted
            with open(source, "rb") as fh:
                data = fh.read()
            stream, name = _io.BytesIO(data), str(source)
            total = sum(1 for _ in _io.BytesIO(data))
        elif args.input == "-" and args.ids:
            # the ids are checked against the number of texts before anything is answered
            data = sys.stdin.buffer.read()
            stream, name = _io.BytesIO(data), "<stdin>"
            total = sum(1 for _ in _io.BytesIO(data))
        elif args.input == "-":
            stream, name, total = sys.stdin.buffer, "<stdin>", None
        else:
            path = source
            with open(path, "rb") as fh:
                total = sum(1 for _ in fh)
            stream, name = open(path, "rb"), str(path)
        try:
            ids = read_ids(args.ids, total) if args.ids else None
            results = answers(target, read_texts(stream, name, args.skip_empty), args.top_k, args.batch_size,
                              args.device, total)
            if args.out and args.out.endswith(".parquet"):
                n = write_parquet(args.out, results, ids)
            elif args.out:
                with io.atomic_path(args.out) as tmp, open(tmp, "w", encoding="utf-8") as out:
                    n = write_jsonl(out, results, ids)
            else:
                write_jsonl(sys.stdout, results, ids)
            if args.out:
                print(f"{n} texts -> {args.out}", file=sys.stderr)
        finally:
            if stream is not sys.stdin.buffer:
                stream.close()
    except PredictError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
