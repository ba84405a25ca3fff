"""One line per results file of the GPU scripts (bench/gpu_*.sh): P@1 P@3 P@5 PSP@5 R@100, training
seconds, the training sequences/s and peak GPU memory of its stages, prediction ms/document, device.

    python3 bench/results_table.py results/debtags/elias.json results/yso-finna-sv-50k/lightxml.json ...
"""

import json
import os
import sys


def row(path: str) -> str:
    if not os.path.exists(path):
        return f"{path} missing"
    d = json.load(open(path))
    m = d["metrics"]
    rates, gpu = [], []
    for s in d["stages"]:
        try:
            r = json.load(open(s["record"]))
        except (OSError, ValueError):
            continue
        if "train_seq_per_s" in r.get("metrics", {}):
            rates.append(round(r["metrics"]["train_seq_per_s"], 1))
        if "peak_gpu_mem_mb" in r.get("metrics", {}):
            gpu.append(round(r["metrics"]["peak_gpu_mem_mb"]))
    return " ".join(str(x) for x in [path, *(round(m[k], 2) for k in ("p_at_1", "p_at_3", "p_at_5", "psp_at_5",
                                                                       "recall_at_100")),
                                     "train_s", d.get("total_train_time_s"), "seq/s", rates, "gpu_MiB", gpu,
                                     "ms/doc", d.get("predict_latency_ms_per_doc"), d.get("device")])


if __name__ == "__main__":
    for f in sys.argv[1:]:
        print(row(f))
