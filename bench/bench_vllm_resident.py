"""A vLLM diagnosis with the driver resident (the default) against one driver child per request
(LLMDOCTOR_VLLM_RESIDENT=0, the anchor): the same `diagnose --engine vllm` in both modes, the same run,
wall time of each and the ratio. The diagnosis on a checkpoint with its tokenizer runs the engine several
times (the main run, the front end's runs on its own and on the reference's tokens), each a model load
without the resident driver.

    python bench/bench_vllm_resident.py PYTHON_OF_THE_VLLM_ENV [kind] [dtype]   # kind: llama (default) qwen2

Prints one JSON line per mode, then the ratio (resident / one child per request).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "reference"))  # test modules imported by name
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "subjects" / "engines"))  # test modules imported by name

TOKENS = "3,17,42,5,77,8,23,61,9,30,55,14,2,88,40,19"
WORDS = ["<s>", "<unk>"] + [f"w{i}" for i in range(2, 96)]  # the tiny models' vocabulary (96), as bench/h200_vllm.py


def main(python: str, kind: str = "llama", dtype: str = "float32") -> None:
    import fixtures_hf
    from test_engine_vllm import vllm_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ckpt, _ = vllm_checkpoint(kind, Path(tmp) / kind)
        fixtures_hf.with_tokenizer(ckpt, WORDS)  # a deployment has one: the front end's runs happen
        took = {}
        for mode in ("0", "1"):
            env = {**os.environ, "LLMDOCTOR_VLLM_RESIDENT": mode, "HF_HUB_OFFLINE": "1"}
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, "-m", "llmdoctor.cli", "diagnose", "--hf", str(ckpt), "--engine", "vllm",
                                "--engine-python", python, "--engine-dtype", dtype, "--token-ids", TOKENS,
                                "--generate", "0", "--json-out", str(Path(tmp) / f"d{mode}.json")],
                               env=env, capture_output=True, text=True)
            took[mode] = time.perf_counter() - t0
            doc = json.loads((Path(tmp) / f"d{mode}.json").read_text())
            print(json.dumps({"kind": kind, "dtype": dtype, "resident": mode == "1", "exit": p.returncode,
                              "verdict": doc["verdict"][:80], "wall_s": round(took[mode], 1),
                              "stages_s": doc.get("stages_s")}), flush=True)
        print(f"ratio resident / one child per request: {took['1'] / took['0']:.2f}")


if __name__ == "__main__":
    main(*sys.argv[1:])
