"""`llmdoctor probe` against the real llama-cpp-python server (no mocks of the engine): healthy on
the demo model, degraded/garbage with the right symptom on corrupted copies, and every proxy fault
classified as expected. One server per model file; the proxy faults share the healthy one."""

from __future__ import annotations

import json
import math
import re
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
from typer.testing import CliRunner

from llmdoctor.checks.metrics import topk_tail
from llmdoctor.checks.endpoint.answers import expected_stats
from llmdoctor.checks.endpoint.probes import DEFAULT_STEPS, probe
from llmdoctor.checks.endpoint.prompts import batch_requests, counting_run
from llmdoctor.checks.endpoint.verdict import THRESHOLDS, ProbeReport
from llmdoctor.reference.chat_template import render_chat_template
from llmdoctor.cli import app
from llmdoctor.demo import model_path
from llmdoctor.errors import InputError
from llmdoctor.faults import all_faults, get
from llmdoctor.subjects.endpoint import Endpoint
from llmdoctor.subjects.engines.endpoint import EndpointEngine
from servers import free_port, serve


@contextmanager
def llama_server(model: Path, log: Path) -> Iterator[str]:
    """`python -m llama_cpp.server` on 127.0.0.1 (2 threads, small context), ready, then stopped."""
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--n_threads", "2", "--n_threads_batch", "2", "--n_ctx", "1024"]
    with serve(cmd, port, log, name="llama_cpp.server", health="/v1/models", ready_s=180) as url:
        yield url


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with llama_server(model_path(), tmp_path_factory.mktemp("srv") / "server.log") as url:
        yield url


def probe_url(url: str, *, timeout: float = 60.0, retries: int = 2, **kw) -> ProbeReport:
    """The probe as `llmdoctor probe` runs it: the caller opens the endpoint and hands it, and itself as
    the front end's engine, to the check."""
    with Endpoint(url, timeout=timeout, retries=retries) as ep:
        return probe(ep, EndpointEngine.over(ep), **kw)


def _symptoms(rep) -> str:
    return "; ".join(f"{f.status} {f.target} {f.metrics.get('symptom', '')} {f.reason}{f.explanation}"
                     for f in rep.findings if f.status != "pass")


# ---------------------------------------------------------------------------- no server needed

def test_expected_stats_counts_every_prefix_token() -> None:
    top = {" Fr": -1.0, " France": -1.0, " the": -0.5}
    st = expected_stats(top, " France")
    assert st["expected_rank"] == 2 and st["top1"] == " the"
    assert st["expected_logprob"] == pytest.approx(-1.0 + 0.6931471805599453)


def test_topk_tail_is_a_lower_bound_of_the_true_kl() -> None:
    import torch

    torch.manual_seed(0)
    p, q = torch.randn(50).log_softmax(0), (torch.randn(50) * 2).log_softmax(0)  # want, got
    true_kl = float((p.exp() * (p - q)).sum())
    top = {i: float(q[i]) for i in q.topk(10).indices.tolist()}
    m = topk_tail(top, {i: float(p[i]) for i in range(50)}, want_complete=True)
    assert 0 <= m["kl"] <= true_kl
    assert topk_tail({"a": -0.01}, {"b": -0.01})["top1_agree"] is False  # disjoint: top-1 catches it


def test_counting_run_asks_for_the_units_digit() -> None:
    assert counting_run(12) == ("1 2 3 4 5 6 7 8 9 10 11 12 1", "3")


def test_chat_template_is_sandboxed() -> None:
    from jinja2.exceptions import SecurityError

    msgs = [{"role": "user", "content": "hi"}]
    assert render_chat_template("{{ bos_token }}{{ messages[0]['content'] }}", msgs, bos="<s>", eos="") == "<s>hi"
    with pytest.raises(SecurityError):
        render_chat_template("{{ messages.append(1) }}", msgs, bos="", eos="")


def test_api_key_comes_from_the_environment_and_is_never_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLMDOCTOR_TEST_KEY", raising=False)
    with pytest.raises(InputError, match="LLMDOCTOR_TEST_KEY"):
        Endpoint("http://127.0.0.1:1", api_key_env="LLMDOCTOR_TEST_KEY")
    monkeypatch.setenv("LLMDOCTOR_TEST_KEY", "sk-secret-123")
    ep = Endpoint("http://127.0.0.1:1/v1/", api_key_env="LLMDOCTOR_TEST_KEY")
    assert ep.base == "http://127.0.0.1:1" and "sk-secret" not in repr(ep)
    ep.close()


def test_faults_are_registered() -> None:
    names = {f.name: f.kind for f in all_faults()}
    for n in [*_PROXY, "swap-responses"]:
        assert names[n] == "endpoint"
    assert names["attn-block-scales"] == names["rope-base"] == "file"


# ---------------------------------------------------------------------------- the real server

@pytest.mark.slow
def test_healthy_real_server_with_reference(server: str) -> None:
    rep = probe_url(server, gguf=model_path(), concurrency=3, steps=[*DEFAULT_STEPS, "echo"])
    assert rep.verdict == "healthy", _symptoms(rep)
    assert rep.features["echo"] and rep.features["tokenize_route"] == "/extras/tokenize"
    assert rep.exit_code == 0 and not rep.symptoms and not rep.transport_events
    ref = next(f for f in rep.findings if f.target == "reference")
    assert ref.status == "pass" and ref.metrics["top1_agreement"] == 1.0
    assert ref.metrics["kl_max"] <= THRESHOLDS["reference_kl_max"]["value"]
    assert any(r.get("probe", "").startswith("echo/") for r in ref.evidence)  # per prompt position
    # llama-cpp-python ignores return_tokens_as_token_ids: compared by text, the collisions stated
    assert rep.features["top_logprobs_keys"] == ref.metrics["top_logprobs_keys"] == "text"
    assert ref.evidence[0]["note"] == f"top_logprobs keyed by text: {ref.metrics['colliding_pieces']} " \
        "colliding pieces (each stands for more than one token id: their reference probabilities are summed, " \
        "the server lists one of them)"
    assert next(f for f in rep.findings if f.target == "echo/tokens").status == "pass"
    fe = next(f for f in rep.findings if f.target == "front-end")  # diagnose's front-end check, through the route
    assert fe.status == "pass" and fe.metrics["engine_front_end"]["route"] == "/extras/tokenize", fe.explanation
    print(f"\nhealthy probe: {rep.wall_s:.0f} s, {rep.n_requests} requests, reference KL max "
          f"{ref.metrics['kl_max']:.2e} mean {ref.metrics['kl_mean']:.2e}, by text: "
          f"{ref.metrics['colliding_pieces']} colliding pieces")


@pytest.mark.slow
@pytest.mark.parametrize("name, verdicts, symptom", [
    ("attn-block-scales", {"garbage"}, "wrong-answers"),
    ("rope-base", {"degraded", "garbage"}, "position-dependent"),
])
def test_corrupted_file(name: str, verdicts: set[str], symptom: str, tmp_path: Path) -> None:
    bad = get(name).build(model_path(), tmp_path)
    with llama_server(bad, tmp_path / "server.log") as url:
        rep = probe_url(url, gguf=model_path(), steps=["positions", "reference"])
    assert rep.verdict in verdicts, _symptoms(rep)
    assert symptom in rep.symptoms, _symptoms(rep)
    ref = next(f for f in rep.findings if f.target == "reference")
    assert ref.status == "fail"
    print(f"\n{name}: {rep.verdict} {sorted(rep.symptoms)} reference KL max {ref.metrics['kl_max']:.2f}, "
          f"Spearman(position, KL) {ref.metrics['kl_position_spearman']:.2f}, {rep.wall_s:.0f} s")


# Each proxy fault with the probe steps that can see it (knowledge always runs) and client options.
_PROXY = {
    "crosstalk": (["batch"], {}, {}),
    "ignore-eos": (["front_end"], {}, {}),
    "decode-perturb": (["repeat", "prefill_decode"], {}, {}),
    "nondeterministic": (["repeat"], {}, {}),
    "http-500": ([], {}, {}),
    "malformed-json": (None, {"retries": 1}, {}),
    "no-logprobs": ([], {}, {}),
    "slow": (None, {"timeout": 2.0, "retries": 1}, {"delay": 3.0}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(_PROXY))
def test_proxy_fault_is_classified(name: str, server: str) -> None:
    steps, client, options = _PROXY[name]
    fault = get(name)
    with fault.build(server, **options) as proxy:
        rep = probe_url(proxy.url, steps=steps, concurrency=3, **client)
    assert rep.verdict != "healthy"
    assert fault.expect in rep.symptoms, _symptoms(rep)


@pytest.mark.slow
def test_a_completion_handed_to_another_request_is_named(server: str) -> None:
    """The swapping proxy hands the first finished completions to the wrong requests while the last
    one to finish gets its own (the request the old batch probe judged, alone): every request is
    judged, and the misdelivered ones are named with the request whose completion they got."""
    fault = get("swap-responses")
    with fault.build(server) as proxy:
        rep = probe_url(proxy.url, steps=["batch"], concurrency=3)
    assert fault.expect in rep.symptoms, _symptoms(rep)
    batch = next(f for f in rep.findings if f.target == "batch")
    assert batch.status == "fail" and batch.metrics["symptom"] == "swapped-responses", _symptoms(rep)
    assert re.search(r"request \d received request \d's completion", batch.explanation), batch.explanation
    assert any(r.get("own") for r in batch.evidence) and not all(r.get("own") for r in batch.evidence)
    assert rep.verdict == "degraded"


def test_a_passed_over_end_token_is_found_and_a_followed_one_is_not() -> None:
    from llmdoctor.checks.endpoint.front_end_steps import _skipped_end_token
    from llmdoctor.completion import Completion

    tops = [{"": -0.14, "\n": -3.8}, {"I": -0.2, "": -2.0}]
    ignored = Completion("\nI", "length", {}, tokens=["\n", "I"], token_logprobs=[-3.8, -0.2], top_logprobs=tops)
    assert _skipped_end_token(ignored, {"<eos>"}) == {"step": 0, "top1": "", "top1_logprob": -0.14, "generated": "\n"}
    talkative = Completion("I", "length", {}, tokens=["I"], token_logprobs=[-0.2], top_logprobs=tops[1:])
    assert _skipped_end_token(talkative, {"<eos>"}) is None


def test_batch_requests_are_distinct_and_ragged() -> None:
    for n in (2, 4, 9):
        reqs = batch_requests(n)
        assert len(reqs) == n and len({p for p, _ in reqs}) == n
        assert len({m for _, m in reqs}) > 1 and len({len(p) for p, _ in reqs}) > 1


@pytest.mark.slow
def test_logprob_limit_is_detected_not_blamed(server: str) -> None:
    from llmdoctor.faults.endpoint import FaultProxy, LogprobCap

    with FaultProxy(server, LogprobCap(5)) as proxy:
        rep = probe_url(proxy.url, steps=[])
    assert rep.verdict == "healthy", _symptoms(rep)
    assert rep.features["top_logprobs"] == 5 and not rep.transport_events


@pytest.mark.slow
def test_cli_json_inconclusive_and_key_never_written(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMDOCTOR_TEST_KEY", "sk-secret-123")
    with get("slow").build(server, delay=3.0) as proxy:
        res = CliRunner().invoke(app, ["probe", proxy.url, "--api-key-env", "LLMDOCTOR_TEST_KEY",
                                       "--timeout", "1", "--json"])
    assert res.exit_code == 2, res.output
    assert "sk-secret" not in res.output
    out = json.loads(res.stdout)
    assert out["schema"] == "llmdoctor.probe/1" and out["verdict"] == "inconclusive"
    assert "timeout" in out["result"]["symptoms"] and out["result"]["thresholds"]


@pytest.mark.parametrize("args,says", [
    (["not-a-url"], "expected an http:// or https:// URL"),
    (["http://[::1"], "not a URL"),
    (["http://127.0.0.1:9", "--timeout", "-1"], "must be > 0"),
])
def test_probe_bad_input_is_one_line_and_exit_2(args, says):
    r = CliRunner().invoke(app, ["probe", *args])
    assert r.exit_code == 2 and r.stderr.startswith("error: ") and says in r.stderr, r.stderr


def test_human_output_renders_every_finding_shape(capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The terminal table shows each probe's row with its status, symptom and numbers in every metrics
    shape (determinism findings carry kl without top1_agree: a KeyError once), the thresholds and the
    verdict with its symptoms."""
    from llmdoctor.checks.base import Finding
    from llmdoctor.report.terminal import render_probe

    fs = [Finding("probe", "s", "repeat", "pass", metrics={"kl": 1e-4, "max_abs_dlogprob": 0.01, "same_text": True}),
          Finding("probe", "s", "batch", "pass", metrics={"kl": 2e-4, "top1_agree": True}),
          Finding("probe", "s", "knowledge/count", "pass",
                  metrics={"expected_logprob": -0.05, "expected_rank": 1, "tail_mass": 0.01}),
          Finding("probe", "s", "echo", "skip", reason="no echo"),
          Finding("probe", "s", "position/40", "fail", metrics={"kl": 0.5, "top1_agree": False,
                                                                "symptom": "position-dependent"},
                  explanation="diverges at long positions"),
          Finding("probe", "s", "reference", "pass",
                  metrics={"kl_max": 1.2e-3, "kl_mean": 1e-4, "top1_agreement": 1.0, "positions": 12}),
          Finding("probe", "s", "transport", "pass", metrics={"requests": 40})]
    rep = ProbeReport("http://x", "m", "degraded", fs, {"position-dependent": [fs[4].id]}, {}, 1.0, 4, [])
    monkeypatch.setenv("COLUMNS", "250")  # one line per row
    render_probe(rep)
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "http://x  model m  (1 s, 4 requests)"

    def row(target: str) -> list[str]:
        cells = next([c.strip() for c in ln.split("│")] for ln in lines if f"│ {target} " in ln)
        assert len(cells) == 4, cells
        return cells

    assert row("repeat") == ["pass", "repeat", "", "max |dlogprob| 1.00e-02, same text True"]
    assert row("batch") == ["pass", "batch", "", "KL 2.00e-04, top-1 same"]
    assert row("knowledge/count") == ["pass", "knowledge/count", "", "expected logprob -0.050, rank 1, tail 0.010"]
    assert row("echo") == ["skip", "echo", "", "no echo"]
    assert row("position/40") == ["fail", "position/40", "position-dependent",
                                  "diverges at long positions (KL 5.00e-01, top-1 differs)"]
    assert row("reference") == ["pass", "reference", "", "KL max 1.20e-03, top-1 agreement 1.00 over 12 positions"]
    assert row("transport") == ["pass", "transport", "", "requests 40"]
    thresholds = next(ln for ln in lines if ln.startswith("thresholds: "))
    for k, v in THRESHOLDS.items():
        assert f"{k} {v['value']:.3g}" in thresholds
    assert lines[-1] == "verdict: degraded  symptoms: position-dependent"


def test_malformed_logprobs_are_an_endpoint_error():
    from llmdoctor.completion import EndpointError
    from llmdoctor.subjects.endpoint import _completion

    with pytest.raises(EndpointError, match="malformed"):
        _completion("http://x", {"choices": [{"text": "a", "logprobs": {"content": [{"logprob": -1.0}]}}]}, chat=False)


def _stub_endpoint(honours_ids: bool, detokenize: bool = True) -> tuple[Endpoint, list[dict]]:
    """An Endpoint over a stub transport answering one completion like vLLM does (top_logprobs keyed
    "token_id:<id>" when the request sets return_tokens_as_token_ids) or like a server that ignores
    the field (keyed by text). Token ids 7001 and 7002 both decode to "a": a text collision."""
    import httpx

    texts = {7001: "a", 7002: "a", 7003: "b"}
    bodies: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        if request.url.path == "/detokenize":
            if not detokenize:
                return httpx.Response(404, json={"detail": "Not Found"})
            return httpx.Response(200, json={"prompt": "".join(texts[i] for i in body["tokens"])})
        top = {7001: -0.2, 7002: -1.9, 7003: -3.0}
        if honours_ids and body.get("return_tokens_as_token_ids"):
            key = {i: f"token_id:{i}" for i in texts}
        else:
            key = texts  # the server keeps one of the colliding pieces
        lp = {"tokens": [key[7001]], "token_logprobs": [-0.2], "top_logprobs": [{key[i]: v for i, v in top.items()}]}
        return httpx.Response(200, json={"choices": [{"text": "a", "finish_reason": "length", "logprobs": lp}]})

    ep = Endpoint("http://stub", model="m", retries=0)
    ep._client = httpx.Client(base_url="http://stub", transport=httpx.MockTransport(handler))
    return ep, bodies


@pytest.mark.parametrize("honours_ids, detokenize", [(True, True), (False, True), (True, False)])
def test_logprobs_by_token_id_where_the_server_honours_it(honours_ids: bool, detokenize: bool) -> None:
    ep, bodies = _stub_endpoint(honours_ids, detokenize)
    c = ep.complete("x", logprobs=3)
    assert bodies[0]["return_tokens_as_token_ids"] is True  # always asked
    assert c.tokens == ["a"] and not ep.events
    if honours_ids and detokenize:
        assert c.token_ids == [7001] and c.top_ids == [{7001: -0.2, 7002: -1.9, 7003: -3.0}]
        assert c.step(0) == c.top_ids[0] and set(c.top_logprobs[0]) == {"a", "b"}  # text collides, ids do not
        ep.complete("x", logprobs=3)
        assert sum(b.get("tokens") is not None for b in bodies) == 3  # /detokenize once per id (cached)
    else:
        assert c.token_ids is None and c.top_ids is None and set(c.step(0)) == {"a", "b"}
    if honours_ids and not detokenize:  # ids nobody can name: asked again for text, and from then on
        assert not ep.token_ids and "return_tokens_as_token_ids" not in bodies[-1]
    ep.close()


def test_comparisons_use_ids_where_both_answers_have_them() -> None:
    """Two answers whose top-1 differs in id but not in text ("a" is ids 1 and 2): by id it is a
    difference, by text (what a text-keyed server shows) it is not."""
    from llmdoctor.checks.endpoint.answers import compare_completions
    from llmdoctor.checks.endpoint.reference_logprobs import id_lookup
    from llmdoctor.completion import Completion

    def answer(top_ids: dict[int, float]) -> Completion:
        return Completion("a", "length", {}, tokens=["a"], token_logprobs=[-0.1], top_logprobs=[{"a": -0.1}],
                          token_ids=[max(top_ids, key=top_ids.get)], top_ids=[top_ids])

    a, b = answer({1: -0.1, 2: -2.4}), answer({2: -0.1, 1: -2.4})
    assert not compare_completions(a, b)["top1_agree"]
    assert compare_completions(*(Completion(**{**x.__dict__, "top_ids": None}) for x in (a, b)))["same"]
    import torch

    lp = torch.tensor([0.1, 0.6, 0.3]).log()  # the reference's [V] log-probs
    assert id_lookup(lp, {0: -1.0, 5: -2.0}) == {0: pytest.approx(float(lp[0])), 5: -math.inf,
                                                  1: pytest.approx(float(lp[1]))}


# ---------------------------------------------------------------------------- the front end (issue 25)

@pytest.mark.slow
def test_the_front_end_check_serves_the_endpoint_and_a_mistokenizing_server_is_garbage(server: str) -> None:
    """diagnose's front-end check through the server's tokenize route (healthy as served: the healthy probe
    above); behind a proxy whose tokenize route drops BOS, every prompt differs (BOS missing, the route named)
    and the verdict is garbage."""
    with get("endpoint-tokenize-no-bos").build(server) as proxy:
        rep = probe_url(proxy.url, gguf=model_path(), steps=["front_end"])
    fe = next(f for f in rep.findings if f.target == "front-end")
    assert fe.status == "fail" and "BOS missing" in fe.explanation, fe.explanation
    assert fe.metrics["differ"] == fe.metrics["compared"] and "tokenizer-mismatch" in rep.symptoms
    assert fe.metrics["engine_front_end"]["route"] == "/extras/tokenize"
    assert rep.verdict == "garbage", _symptoms(rep)


@pytest.mark.slow
def test_a_chat_refused_for_want_of_a_template_is_not_a_server_error(server: str) -> None:
    fault = get("endpoint-chat-no-template")
    with fault.build(server) as proxy:
        rep = probe_url(proxy.url, gguf=model_path(), steps=["front_end"])
    chat = next(f for f in rep.findings if f.target == "chat")
    assert chat.status == "skip" and chat.reason.startswith(fault.expect), chat.reason
    assert "server-errors" not in rep.symptoms and not any(f.target.startswith("transport/") and f.status == "fail"
                                                           for f in rep.findings), _symptoms(rep)
