"""`llmdoctor probe` against a real vLLM server (issue 12): vLLM for CPU's OpenAI-compatible server
(`vllm.entrypoints.openai.api_server`, LLMDOCTOR_VLLM_PYTHON's environment) started on 127.0.0.1 and
stopped by its PID. The model is the demo deployment's Gemma 3 270M as an HF checkpoint (the GGUF's
weights dequantized to float32 by our bit-exact kernels, transformers' layout through gguf/layout.py,
the GGUF's own tokenizer and chat template), so the probe's reference is the demo GGUF itself:
a healthy vLLM serving it must be called healthy. CI=true: a missing vLLM environment fails."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from llmdoctor.demo import model_path
from llmdoctor.subjects.engines import vllm as vllm_engine
from servers import free_port, serve
from test_probe import probe_url

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_server(vllm_python: str, demo_hf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    ckpt = demo_hf
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    port = free_port()
    cmd = vllm_engine.server_command(vllm_python, ckpt, port, dtype="float32", name="demo")
    # stopped by its PID: the server, and with it the engine-core process it started
    with serve(cmd, port, log, name="vLLM's server", health="/health", ready_s=600, stop_s=30) as url:
        yield url


def test_healthy_vllm_server_is_called_healthy(vllm_server: str) -> None:
    rep = probe_url(vllm_server, gguf=model_path(), concurrency=3)
    bad = [(f.target, f.reason or f.explanation) for f in rep.findings if f.status != "pass"]
    assert rep.verdict == "healthy" and rep.exit_code == 0, (rep.symptoms, bad)
    assert rep.features["tokenize_route"] == "/tokenize"
    ref = next(f for f in rep.findings if f.target == "reference")
    assert ref.status == "pass" and ref.metrics["kl_max"] < 1e-4, ref.metrics
    # the probe asked for token ids and vLLM honoured them: every comparison was by id, no collisions
    assert rep.features["top_logprobs_keys"] == ref.metrics["top_logprobs_keys"] == "token ids"
    assert ref.metrics["colliding_pieces"] == 0 and ref.evidence[0]["note"] == "compared by token id"
    assert all(isinstance(r["server_top"][0][0], int) for r in ref.evidence[1:]), ref.evidence
    print(f"\nvLLM probe: {rep.wall_s:.0f} s, {rep.n_requests} requests, by token id, reference KL max "
          f"{ref.metrics['kl_max']:.2e} mean {ref.metrics['kl_mean']:.2e} over {ref.metrics['positions']} positions")
