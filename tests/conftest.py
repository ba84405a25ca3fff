import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
SHARED_DATA = SHARED / "data"


@pytest.fixture(autouse=True)
def _no_tracking_by_default(monkeypatch):
    """Unit tests do not touch MLflow unless they opt in (tests of tracking set it back)."""
    monkeypatch.setenv("XMC_TRACKING", os.environ.get("XMC_TEST_TRACKING", "0"))


@pytest.fixture(autouse=True)
def _no_gpu_claims_by_default(monkeypatch):
    """The test process claims no GPU (xmc_steps.devices.claim_gpus) unless a test opts in: on a GPU
    machine it would narrow CUDA_VISIBLE_DEVICES for the rest of the session."""
    monkeypatch.setenv("XMC_GPU_CLAIM", "0")


@pytest.fixture(autouse=True)
def _seeded_global_rngs():
    """Each test starts from the same state of the global RNGs (torch, numpy, random), whatever ran
    before it: a test that draws from them (a model's random start) then sees the same numbers alone or
    in the whole suite (CI once saw a random-start prior of 0.3225 that the test alone never drew)."""
    import random

    import numpy as np
    import torch

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session", autouse=True)
def slurm_background_run(request, tmp_path_factory):
    """tests/test_slurm.py's SLURM run, started with the session when that test is selected and a SLURM
    node is up (its jobs mostly wait on the scheduler: it overlaps the other tests); None otherwise."""
    if not any(item.path.name == "test_slurm.py" for item in request.session.items):
        yield None
        return
    from test_slurm import start_background_run

    run = start_background_run(tmp_path_factory)
    yield run
    if run is not None:
        run.stop()


def load_bench(name: str):
    """The script ``bench/<name>.py`` as a module (the bench folder is not a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def shared_dataset(*parts: str) -> Path:
    p = SHARED_DATA.joinpath(*parts)
    if not p.is_dir():
        pytest.skip(f"{p} is absent (../shared is not beside the checkout)")
    return p


def write_raw_dataset(folder: Path, train, test, label_ids=None, label_texts=None) -> Path:
    """Write a tiny AttentionXML-layout dataset: train/test are lists of (text, labels)."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", train), ("test", test)):
        (folder / f"{split}_texts.txt").write_text("".join(t + "\n" for t, _ in rows), encoding="utf-8")
        (folder / f"{split}_labels.txt").write_text("".join(" ".join(l) + "\n" for _, l in rows), encoding="utf-8")
    if label_ids is not None:
        (folder / "label_ids.txt").write_text("".join(x + "\n" for x in label_ids))
    if label_texts is not None:
        (folder / "label_texts.txt").write_text("".join(x + "\n" for x in label_texts))
    return folder


@pytest.fixture(scope="session")
def toy_linear_run(tmp_path_factory):
    """The toy dataset's xr-linear and parabel targets, run once through the DAG (MLflow on)
    and shared by the tests that read such a run (end to end, `snakemake --report`)."""
    from test_workflow import _run, _toy

    tmp = tmp_path_factory.mktemp("toy-linear")
    _toy(tmp)
    _run(tmp, "results/toy/xr-linear.json", "results/toy/parabel.json")
    return tmp


#: the neural toy run's longest chains, started first (Snakemake's scheduler does not look ahead: left alone it
#: kept the second ELIAS seed's serial chain for the end, one core idle)
PRIORITY = ("results/toy/elias-ensemble.json", "results/toy/lightxml-ensemble.json", "results/toy/gudn.json",
            "results/toy/dual-encoder-ranker.json")


@pytest.fixture(scope="session")
def neural_toy_run(tmp_path_factory):
    """The toy's neural targets run once through the DAG: MiniLM, 16 tokens, a few steps; read by
    the end-to-end test, copied by the guard test (which then needs only its matcher job) and the
    local half of the SLURM test (which adds its own two targets to it).

    Without MLflow tracking: every job's run and every target's logged model (about 1.2 GB of copied
    weights here) cost minutes, and the tests reading this folder assert no tracking; the linear toy run
    (``toy_linear_run``) and tests/test_tracking.py cover the tracking of stages and targets."""
    from test_workflow import NEURAL_OVERRIDES, NEURAL_TARGETS, UNTRACKED, _run, _toy

    tmp = tmp_path_factory.mktemp("toy-neural")
    _toy(tmp)
    _run(tmp, *NEURAL_TARGETS, "results/toy/xtransformer-selection.md", overrides=NEURAL_OVERRIDES,
         env=UNTRACKED, extra=("--prioritize", *PRIORITY))
    return tmp


class TarballServer:
    """A loopback HTTP server (127.0.0.1, a free port) for the fetch tests: it serves ``files``
    (path -> bytes) with HTTP ranges (206, 416), and can cut its next answer halfway
    (``cut_next``: the whole Content-Length, half the bytes, then the connection closes) or refuse
    every request (``refuse``: a status to answer with).  ``requests`` lists (path, Range header)."""

    def __init__(self, files: dict[str, bytes]):
        import http.server
        import threading

        self.files, self.cut_next, self.refuse, self.requests = dict(files), False, None, []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                rng = self.headers.get("Range")
                server.requests.append((self.path, rng))
                if server.refuse:
                    self.send_error(server.refuse)
                    return
                data = server.files.get(self.path)
                if data is None:
                    self.send_error(404)
                    return
                start = int(rng[len("bytes="):].split("-")[0]) if rng else 0
                if start >= len(data) and rng:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(206 if rng else 200)
                if rng:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Content-Length", str(len(data) - start))
                self.send_header("ETag", '"v1"')
                self.end_headers()
                body = data[start:]
                if server.cut_next:
                    server.cut_next = False
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def tarball_server():
    """A :class:`TarballServer` with no files yet (``server.files[path] = bytes``), closed after the test."""
    server = TarballServer({})
    yield server
    server.close()


def xmc_base_tarball(tmp_path: Path, archive: str, n_train: int = 60, n_test: int = 20) -> bytes:
    """A small xmc-base tarball (``xmc-base/<archive>/...``, synthetic, 8 labels) as PECOS ships them."""
    import io as _io
    import tarfile

    from xmc_steps import synth

    shape = synth.Shape("tiny", n_train, n_test, 8, 2.0, 12.0, vocab=60, topic_words=3, signal=0.5)
    folder = tmp_path / "tarball-src" / archive
    synth.write(shape, 1.0, folder, seed=0, layout="xmc-base")
    (folder / "synth.json").unlink()
    buf = _io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        tf.add(folder, arcname=f"xmc-base/{archive}")
    return buf.getvalue()
