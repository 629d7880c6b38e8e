"""`llmdoctor probe` against a real vLLM server (issue 12): vLLM for CPU's OpenAI-compatible server
(`vllm.entrypoints.openai.api_server`, LLMDOCTOR_VLLM_PYTHON's environment) started on 127.0.0.1 and
stopped by its PID. The model is the demo deployment's Gemma 3 270M as an HF checkpoint (the GGUF's
weights dequantized to float32 by our bit-exact kernels, transformers' layout through gguf/layout.py,
the GGUF's own tokenizer and chat template), so the probe's reference is the demo GGUF itself:
a healthy vLLM serving it must be called healthy. CI=true: a missing vLLM environment fails."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from llmdoctor.checks.probes import probe
from llmdoctor.demo import model_path
from llmdoctor.subjects.engines import vllm as vllm_engine


@pytest.fixture(scope="module")
def vllm_python() -> str:
    path = os.environ.get("LLMDOCTOR_VLLM_PYTHON")
    if not path or not Path(path).exists():
        why = f"no vLLM environment (LLMDOCTOR_VLLM_PYTHON={path!r})"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI: {why}; .ci/run builds it")
        pytest.skip(why)
    return path


def demo_checkpoint(out: Path) -> Path:
    """The demo GGUF as an HF checkpoint: float32 weights, the GGUF's tokenizer and chat template."""
    import torch
    import transformers

    from llmdoctor.gguf import open_gguf
    from llmdoctor.subjects.engines.transformers import build

    gguf = model_path()
    model, _ = build(gguf, torch.float32)
    model.save_pretrained(out)
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    with open_gguf(gguf) as g:
        tok.chat_template = str(g.get("tokenizer.chat_template"))
    tok.save_pretrained(out)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_server(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    ckpt = demo_checkpoint(tmp_path_factory.mktemp("demo-hf"))
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    port = _free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(vllm_engine.server_command(vllm_python, ckpt, port, dtype="float32", name="demo"),
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM's server exited {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM's server not ready after 600 s: {log.read_text()[-2000:]}")
            time.sleep(1)
        yield url
    finally:
        proc.terminate()  # by its PID: the server and the engine-core process it started
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_healthy_vllm_server_is_called_healthy(vllm_server: str) -> None:
    rep = probe(vllm_server, gguf=model_path(), concurrency=3)
    bad = [(f.target, f.reason or f.explanation) for f in rep.findings if f.status != "pass"]
    assert rep.verdict == "healthy" and rep.exit_code == 0, (rep.symptoms, bad)
    assert rep.features["tokenize_route"] == "/tokenize"
    ref = next(f for f in rep.findings if f.target == "reference")
    assert ref.status == "pass" and ref.metrics["kl_max"] < 1e-4, ref.metrics
