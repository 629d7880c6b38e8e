"""The reference from an HF checkpoint (reference/checkpoint.py) against the reference from the F32 GGUF
converted from the same checkpoint (the anchor), in one run: load + one forward pass each, uncached
(layer streaming, as `logits` and a first diagnose run read), and the same cached (as diagnose keeps
the blocks). Also transformers' own from_pretrained + forward of the checkpoint, for scale.

The model: a random llama (n_embd 512, 8 layers, ffn 1536, 8 heads / 4 KV heads, vocab 32000; 60M
parameters), saved as a bfloat16 checkpoint (what checkpoints ship) and converted to an F32 GGUF of the
same values; 128 tokens. The two references must give bit-identical logits (checked here too).

    python bench/bench_reference_hf.py [--keep DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "reference"))  # test modules imported by name


def build(out: Path) -> tuple[Path, Path]:
    import json

    import transformers
    from safetensors.torch import load_file

    from llmdoctor.gguf import layout
    from test_reference_dense import write_gguf

    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    ckpt = out / "hf"
    model.save_pretrained(ckpt)
    sd = {k: v.float() for k, v in load_file(ckpt / "model.safetensors").items()}
    d = json.loads((ckpt / "config.json").read_text())
    path = out / "model.gguf"
    write_gguf(path, "llama", d, layout.to_gguf(layout.plan("llama", list(sd), d), sd))
    return ckpt, path


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def reference(path: Path, ids: list[int], cache: bool) -> tuple[torch.Tensor, float]:
    from llmdoctor.reference import load

    def run():
        with load(path, cache=cache) as m:
            return m.forward(ids)[0]

    return timed(run)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep", type=Path, help="build into DIR and keep it")
    args = ap.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.keep or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        (ckpt, gguf), t_build = timed(lambda: build(out))
        ids = [int(i) for i in np.random.default_rng(0).integers(0, 32000, size=128)]
        print(f"built in {t_build:.1f} s: checkpoint {sum(p.stat().st_size for p in ckpt.glob('*.safetensors')) / 2**20:.0f} MiB "
              f"(bf16), GGUF {gguf.stat().st_size / 2**20:.0f} MiB (F32)")
        reference(gguf, ids[:4], False)  # warm the page cache and torch's kernels
        rows = []
        for cache in (False, True):
            a, t_hf = reference(ckpt, ids, cache)
            b, t_gg = reference(gguf, ids, cache)
            assert torch.equal(a, b), float((a - b).abs().max())
            rows.append((cache, t_hf, t_gg))
        import transformers

        def hf_run():
            m = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
            with torch.no_grad():
                return m(torch.tensor([ids])).logits[0]

        _, t_tf = timed(hf_run)
        for cache, t_hf, t_gg in rows:
            print(f"{'cached' if cache else 'streamed'}: checkpoint {t_hf:.2f} s, GGUF (anchor) {t_gg:.2f} s, "
                  f"ratio {t_hf / t_gg:.2f}; logits bit-identical")
        print(f"transformers from_pretrained + forward (float32): {t_tf:.2f} s")


if __name__ == "__main__":
    main()
