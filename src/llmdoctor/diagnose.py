"""`llmdoctor diagnose`: the elimination plan.

An ordered list of hypotheses about the layers of the stack, cheapest first. Each runs only when its
inputs exist and otherwise reports "skipped: why". Each returns findings (hypothesis, evidence,
verdict, confidence). Failed findings are the suspects, ranked by the stack order of the plan (an
earlier layer's fault explains the later symptoms: a wrong dequant kernel also makes the logits and
the layer curve diverge), then by confidence.

    file integrity -> metadata semantics -> name map / layout -> dequant kernels -> float16 overflow
    -> attention kernels -> engine vs reference (distribution) -> symptom bisection -> layer localization

The session (`Session`) computes shared evidence once, lazily: the prompt's tokens, the reference's
float32 run with its per-layer statistics and captures, and the engine's run.
"""

from __future__ import annotations

import numpy as np
import torch


import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from .checks.base import Finding, count
from .errors import GGUFError, InputError

# A fixed, varied English prompt (counting included: the seed's first symptom).
DEFAULT_PROMPT = (
    "The quick brown fox jumps over the lazy dog. Counting: 1 2 3 4 5 6 7 8 9 10 11 12. "
    "Paris is the capital of France, and Berlin is the capital of"
)
FP16_MAX = 65504.0
NO_GGUF = "no GGUF file (the reference reads the HF checkpoint)"
ENGINES = ("llama.cpp", "transformers", "vllm")
CONFIDENCE_ORDER = {"high": 0, "medium": 1, "low": 2, "": 3}
# Reference capture points compared with an engine's (checks/layers.py POINTS).
REFERENCE_POINTS = ("l_out-*", "attn_norm-*", "q_pe-*", "k_pe-*", "Qcur-*", "Kcur-*", "kqv_out-*", "ffn_inp-*", "ffn_norm-*", "ffn_out-*", "ffn_moe_topk-*", "ffn_moe_scores-*",
                    "top_k-*", "indexer_score-*", "result_norm")


# The layer curve's points in graph order: the layer points of checks/layers.py plus q and k after RoPE
# where an engine exposes them (vLLM; MLA: the rope parts q_pe and k_pe), so a divergence inside
# attention is named to the op.
CURVE_POINTS = ("attn_norm", "q_pe", "k_pe", "Qcur", "Kcur", "kqv_out", "ffn_inp", "ffn_out", "l_out")


class Skip(Exception):
    """A hypothesis that cannot run here; the message is the reason."""


@dataclass
class Inputs:
    gguf: Path | None = None
    hf: Path | None = None
    endpoint: str | None = None
    engine: str | None = None
    engine_gguf: Path | None = None  # the file the engine loads when it differs from --gguf (demo faults)
    engine_hf: Path | None = None  # the checkpoint the engine loads when it differs from --hf (planted faults)
    engine_dtype: str | None = None
    manifest: Path | None = None  # a manifest of a known-good copy (llmdoctor manifest): compared in file-integrity
    engine_python: str | None = None  # the deployment's interpreter for engines run in their own environment (vLLM)
    dequant_kernel: str | None = None
    attention_impl: str | None = None
    attention_contract: str | None = None
    prompt: str = DEFAULT_PROMPT
    token_ids: list[int] | None = None  # instead of the prompt (models without a tokenizer)
    seed: int = 0
    threads: int | None = None


@dataclass
class Hypothesis:
    key: str
    question: str
    run: Callable[["Session"], list[Finding]]


@dataclass
class Diagnosis:
    findings: list[Finding]
    suspects: list[Finding]
    ruled_out: list[Finding]
    verdict: str
    exit_code: int
    curve: list[dict] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    reference_threads: int | None = None  # torch's thread count in every reference run (Session.threads)
    # what the engine said of itself when it ran: its versions as its own environment has them (vLLM's
    # driver reports the deployment's vLLM, torch and transformers; env.engines is llmdoctor's environment)
    engine_run: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "suspects": [f.id for f in self.suspects],
            "ruled_out": [f.id for f in self.ruled_out],
            "layer_curve": self.curve,
            "engine_run": self.engine_run,
            "reference_threads": self.reference_threads,
            "timings_s": self.timings,
        }


class Session:
    """Shared, lazily computed evidence for one diagnosis."""

    def __init__(self, inputs: Inputs, progress: Callable[[str], None] = lambda s: None):
        self.inputs = inputs
        self.progress = progress
        self._cache: dict[str, Any] = {}
        self.curve: list[dict] = []
        # torch's thread count for every reference run: --threads, else the count at the start. It is
        # one setting for the whole process (an in-process engine or a dequant pool may change it) and
        # a reduction's bits may depend on it (MKL's [54, 256] x [256, 54] product differs from 8 threads
        # on), which the emulated run's Q8 rounding would turn into another noise budget: pinned, so that
        # the same command gives the same budgets (issue 18).
        self.threads = inputs.threads or torch.get_num_threads()
        # set when vLLM could not run --gguf and ran --hf DIR instead: from then on the reference reads
        # that checkpoint too, so the engine is compared with the model it ran, not the quantized file
        self.engine_ran_checkpoint: Path | None = None

    @contextlib.contextmanager
    def pinned_threads(self) -> Iterator[None]:
        """torch on `self.threads` threads meanwhile (for a reference forward pass)."""
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def once(self, key: str, make: Callable[[], Any]) -> Any:
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    # ---- evidence ----------------------------------------------------------------------------
    def checkpoint(self) -> Path | None:
        """The HF checkpoint directory the reference reads (--hf DIR with safetensors and no --gguf), or None."""
        from .reference.checkpoint import is_checkpoint

        if self.engine_ran_checkpoint is not None:
            return self.engine_ran_checkpoint
        hf = self.inputs.hf
        return Path(hf) if self.inputs.gguf is None and hf is not None and is_checkpoint(hf) else None

    def gguf_path(self) -> Path:
        """--gguf, or a Skip saying why a hypothesis that needs a GGUF cannot run."""
        if self.inputs.gguf is None:
            raise Skip(NO_GGUF if self.checkpoint() is not None else "no model file (--gguf)")
        return self.inputs.gguf

    def reference_path(self) -> Path:
        """What the reference reads: the GGUF, else the HF checkpoint directory (reference/checkpoint.py)
        -- also when the engine ran the checkpoint in place of a GGUF it could not run."""
        ckpt = self.checkpoint()
        if self.inputs.gguf is not None and ckpt is None:
            return self.inputs.gguf
        if ckpt is None:
            raise Skip("no model for the reference (--gguf FILE, or --hf DIR with config.json and safetensors)")
        return ckpt

    def gguf(self):
        from .gguf import open_gguf

        path = self.gguf_path()
        return self.once("gguf", lambda: open_gguf(path))

    def config(self):
        from .reference.config import from_gguf, from_hf

        if self.checkpoint() is not None:
            return self.once(f"config-{self.reference_path()}", lambda: from_hf(self.reference_path()))
        return self.once("config", lambda: from_gguf(self.gguf()))

    def tokens(self) -> list[int]:
        """--token-ids as given, else the prompt through the model's own tokenizer (the GGUF's, or the
        checkpoint's: reference/hf_tokenizer.py, an InputError when it ships none)."""
        if self.inputs.token_ids is not None:
            return list(self.inputs.token_ids)

        def make() -> list[int]:
            if self.inputs.gguf is None:
                from .reference.hf_tokenizer import checkpoint_tokenizer

                return checkpoint_tokenizer(self.reference_path()).encode(self.inputs.prompt)
            from .reference.tokenizer import Tokenizer

            return Tokenizer.from_gguf(self.gguf()).encode(self.inputs.prompt)

        return self.once("tokens", make)

    def inconsistency(self) -> str | None:
        """The first hard metadata problem of the GGUF (checks/plausibility.py), or None: a model whose
        metadata contradicts its tensors is neither built nor run."""
        def make():
            from .checks.plausibility import hard_problems

            problems = hard_problems(self.gguf()) if self.inputs.gguf is not None else []
            return problems[0].message if problems else None

        return self.once("inconsistency", make)

    def require_consistent(self) -> None:
        if (why := self.inconsistency()) is not None:
            raise Skip(f"the metadata is inconsistent ({why})")

    def model(self, dtype: str = "float32"):
        """The reference model in `dtype`, its dequantized weights cached for every later use."""
        self.require_consistent()

        def make():
            import torch

            from .reference import load

            return load(self.reference_path(), dtype=getattr(torch, dtype), cache=True)

        return self.once(f"model-{dtype}-{self.reference_path()}", make)

    def reference(self, dtype: str = "float32", emulate: str | None = None):
        """(logits [T, V], captures, per-layer stats) of the reference run in `dtype`, optionally with
        an engine's arithmetic emulated (reference/emulate.py)."""

        def make():
            from .reference.emulate import LLAMA_CPP_CPU

            extra = self.reference_extra()
            self.progress(f"reference forward pass ({dtype}{', ' + emulate + ' arithmetic' if emulate else ''})")
            model = self.model(dtype)
            with self.pinned_threads():
                logits, caps = model.forward(self.tokens(), capture=set(REFERENCE_POINTS),
                                             emulate=LLAMA_CPP_CPU if emulate == "llama.cpp" else None, extra=extra)
            return logits, caps, [st.as_dict() for st in model.stats]

        return self.once(f"reference-{dtype}-{emulate}-{self.reference_path()}", make)

    def close(self) -> None:
        for key, value in self._cache.items():
            if key.startswith("model-") or key == "gguf":
                value.close()

    def engine_run(self):
        """The in-process engine's logits [T, V] and captures (reference capture names). An engine that
        cannot run the model is a skip with the reason, remembered so later hypotheses do not retry."""
        name = self.inputs.engine
        if name is None:
            raise Skip("no in-process engine (--engine)")
        if name == "llama.cpp" and self.inputs.gguf is None:
            raise Skip("llama.cpp runs GGUF files only: no --gguf given")
        self.require_consistent()

        def make():
            from .subjects.engines.llama_cpp import EngineError

            try:
                return self._run_engine(name)
            except EngineError as e:
                return Skip(f"the engine could not run the model: {e}")

        result = self.once("engine", make)
        if isinstance(result, Skip):
            raise result
        return result

    def engine_info(self) -> dict[str, Any] | None:
        """What the engine reported of itself (versions, dtype, backends) if it ran in this session; never
        runs it."""
        ran = self._cache.get("engine")
        return ran[2] if isinstance(ran, tuple) else None

    def engine_model(self) -> Path:
        """What the engine loads: its own copy when one is given (a planted fault), else the reference's model."""
        if self.inputs.gguf is None:
            return self.inputs.engine_hf or self.reference_path()
        return self.inputs.engine_gguf or self.inputs.gguf

    def _run_engine(self, name: str):
        path = self.engine_model()
        if name == "llama.cpp":
            from .checks.layers import LLAMA_CPP_ALIASES, engine_names_to_reference
            from .subjects.engines import llama_cpp

            self.progress("llama.cpp forward pass (capturing every layer)")
            # in a child process: an abort inside llama.cpp must not end the diagnosis
            run = llama_cpp.run_isolated(
                path, self.tokens(), n_threads=self.inputs.threads,
                capture=("l_out-*", "attn_norm-*", "kqv_out-*", "sa_out-*", "ffn_norm-*", "ffn_out-*", "ffn_moe_topk-*",
                         "top_k-*", "result_norm"))
            return run.logits, engine_names_to_reference(run.captures, LLAMA_CPP_ALIASES), run.info
        if name == "vllm":
            return self._run_vllm(path)
        from .subjects.engines import transformers as hf_engine

        dtype = self.inputs.engine_dtype or "float32"
        self.progress(f"transformers forward pass ({dtype})")
        run = hf_engine.run(path, self.tokens(), dtype=dtype, n_threads=self.inputs.threads,
                            dequant_kernel=self.inputs.dequant_kernel)
        return run.logits, run.captures, run.info

    def _run_vllm(self, path: Path):
        """vLLM in the deployment's interpreter (subjects/engines/vllm.py). A GGUF it cannot run is a
        skip quoting vLLM, unless an HF checkpoint (--hf DIR) is given too: vLLM then runs that."""
        from .reference.checkpoint import is_checkpoint
        from .subjects.engines import vllm

        python = vllm.find_python(self.inputs.engine_python)
        dtype = _torch_dtype_name(self.inputs.engine_dtype) if self.inputs.engine_dtype else None
        self.progress(f"vLLM forward pass ({dtype or 'the model dtype'}, {python})")
        try:
            run = vllm.run(python, path, self.tokens(), dtype=dtype, threads=self.inputs.threads)
        except vllm.EngineError as e:
            hf = self.inputs.hf
            if Path(path).suffix != ".gguf" or hf is None or not is_checkpoint(hf):
                raise
            self.progress(f"vLLM could not run the GGUF ({e}); running the checkpoint {hf}, the reference too")
            run = vllm.run(python, hf, self.tokens(), dtype=dtype, threads=self.inputs.threads)
            run.info["gguf_error"] = str(e)
            run.info["reference_reads"] = str(hf)
            self.engine_ran_checkpoint = Path(hf)
        run.info["python"] = python
        cfg = self.config()
        return run.logits, vllm.reference_layout(run.captures, rope_neox=cfg.rope_neox, rope_dim=cfg.rope_dim), run.info

    def reference_extra(self) -> dict | None:
        """Per-run state for every reference forward pass of this diagnosis: the engine's discrete choices
        (DSA key selections, MoE experts) where the model has them and the engine exposes them. The model
        does not say which of the keys or experts tied (or within rounding of a tie) at the k-th score to
        take: ReLU index scores are often exactly 0, and a router's near-tie flips under any other
        arithmetic, which moves the output far more than the arithmetic itself. So every reference run
        takes the engine's choices, and whether each is one the scores allow is the dsa-selection and
        moe-routing checks' business."""
        from .reference.arch_deepseek import DSA_OVERRIDE, MOE_OVERRIDE

        cfg = self.config()
        if self.inputs.engine is None or (cfg.moe is None and (cfg.mla is None or cfg.mla.indexer is None)):
            return None
        try:
            _, caps, _ = self.engine_run()
        except Skip:
            return None
        dsa, moe = {}, {}
        for il in range(cfg.n_layer):
            sel = caps.get(f"top_k-{il} (view)", caps.get(f"top_k-{il}"))
            if sel is not None and cfg.mla is not None and cfg.mla.indexer is not None:
                dsa[il] = torch.as_tensor(np.asarray(sel, dtype=np.int64))
            experts = caps.get(f"ffn_moe_topk-{il}")
            if experts is not None and cfg.moe is not None and np.shape(experts) == (len(self.tokens()), cfg.moe.n_used):
                moe[il] = torch.as_tensor(np.asarray(experts, dtype=np.int64))
        extra = {k: v for k, v in ((DSA_OVERRIDE, dsa), (MOE_OVERRIDE, moe)) if v}
        return extra or None

    def divergence(self):
        """(error curve, first divergent layer or None, its point) of the engine's activations against
        the reference, noise-aware (checks/layers.py)."""
        def make():
            from .checks.layers import error_curve, first_divergent_layer

            _, engine_caps, _ = self.engine_run()
            _, ref_caps, _ = self.reference("float32")
            _, emu_caps, _ = self.budget_reference()
            curve = error_curve(ref_caps, emu_caps, engine_caps, self.config().n_layer, points=CURVE_POINTS)
            return (curve, *first_divergent_layer(curve)) if curve else (curve, None, None)

        return self.once("divergence", make)

    def budget_reference(self):
        """The reference run with the engine's arithmetic: how far a healthy engine may be."""
        if self.inputs.engine == "llama.cpp":
            return self.reference("float32", emulate="llama.cpp")
        if self.inputs.engine == "vllm":
            # vLLM's float32 kernels (oneDNN GEMMs, its own attention kernels, the fused add + RMSNorm)
            # sum in other orders than the reference's torch ops: a healthy vLLM differs from the float32
            # reference by another draw of float32 rounding, whose size is the float32 reference's own
            # distance from float64 arithmetic. In another dtype: the reference in that dtype.
            dtype = _torch_dtype_name(str(self.engine_run()[2].get("dtype") or "float32"))
            return self.reference("float64" if dtype == "float32" else dtype)
        # transformers in float32: the same argument (its eager ops, SDPA and grouped expert GEMMs sum in
        # other orders). Measured on DeepSeek-V3 with real MLA dims (tests/test_reference_hf.py): its l_out-1
        # is 1.1e-6 (rel. L2) from our float32 run, over the 1e-6 floor a bit-exact budget leaves, but 8.6e-7
        # from float64 arithmetic, where our float32 run itself is 9.0e-7 from it.
        dtype = _torch_dtype_name(self.inputs.engine_dtype or "float32")
        return self.reference("float64" if dtype == "float32" else dtype)


def _torch_dtype_name(name: str) -> str:
    aliases = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "float": "float32"}
    name = aliases.get(name.lower(), name.lower())
    if name not in ("float32", "float16", "bfloat16", "float64"):
        raise InputError(f"--engine-dtype {name!r}: expected float32, float16 or bfloat16")
    return name


# ---- the hypotheses ------------------------------------------------------------------------------

def _finding(check: str, subject: str, target: str, status: str, **kw: Any) -> Finding:
    return Finding(check=check, subject=subject, target=target, status=status, **kw)


def h_file_integrity(s: Session) -> list[Finding]:
    """The file parses under the hardened reader, every weight decodes to finite numbers, and no tensor
    stands out from its role siblings (checks/forensics.py: block scales and weight statistics). When
    the reference reads this same file, one more finding says what that cannot see."""
    from .checks import forensics
    from .gguf import GGUFError

    try:
        g = s.gguf()
    except GGUFError as e:
        at = f" at offset {e.offset}" if e.offset is not None else ""
        return [_finding("file-integrity", "gguf", str(s.inputs.gguf), "fail", reason=str(e),
                         hypothesis="the model file is intact", confidence="high",
                         metrics={"problem": e.problem, "offset": e.offset},
                         explanation=f"the model file is broken: {e.problem}{at} (no engine can load it correctly)")]
    s.progress(f"decoding all {len(g.tensors)} tensors (finite values, block-scale forensics)")
    # decoded once, reused by the reference runs (a model whose metadata is inconsistent is not built)
    weights = s.model().weights if s.inconsistency() is None else None
    stats = [forensics.tensor_stats(t, weights.get(t.name) if weights is not None and weights.has(t.name) else None)
             for t in g.tensors if t.supported]
    found = forensics.compare(stats, file=s.inputs.gguf)
    nonfinite = [f for f in found if f.status == "fail" and "outliers" not in f.metrics]
    out = [_finding(
        "file-integrity", "gguf", str(s.inputs.gguf), "fail" if nonfinite else "pass", confidence="high",
        hypothesis="the model file is intact: it parses and every weight is finite",
        metrics={"tensors": len(g.tensors), "values": sum(st.n_values for st in stats),
                 "tensors_with_non_finite": len(nonfinite)},
        evidence=[{"tensor": f.target, "problem": f.explanation} for f in nonfinite[:5]],
        explanation=(nonfinite[0].explanation + (f" (and {len(nonfinite) - 1} more tensors)" if len(nonfinite) > 1
                                                 else "") if nonfinite
                     else f"{len(g.tensors)} tensors parse and decode to finite values"))]
    for f in found:  # sibling outliers are this step's suspects too; the forensics summary stays itself
        if f.status == "fail" and "outliers" in f.metrics:
            f.check, f.confidence = "file-integrity", "medium"
        if not any(f is n for n in nonfinite):
            out.append(f)
    if (s.inputs.engine is not None or s.inputs.endpoint is not None) and s.inputs.engine_gguf is None \
            and s.inputs.hf is None and s.inputs.manifest is None:
        out.append(_finding(
            "file-provenance", "reference", str(s.inputs.gguf), "skip", hypothesis="the file is the model that was published",
            reason="the reference reads the deployment's own file: a corrupted or mis-converted file misleads engine "
                   "and reference alike, so their agreement cannot see it (only the forensics above look at the "
                   "file itself). Close it with --hf DIR (the original checkpoint), --manifest m.json (hashes of a "
                   "known-good copy) or `llmdoctor diff FILE KNOWN_GOOD.gguf`"))
    return out + _manifest_findings(s, g)


def _manifest_findings(s: Session, g: Any) -> list[Finding]:
    """With --manifest: every tensor and metadata key that differs from the known-good copy's manifest."""
    if s.inputs.manifest is None:
        return []
    from .checks.manifest import compare

    s.progress("hashing every tensor against the manifest")
    return compare(g, s.inputs.manifest)


def h_engine_file(s: Session) -> list[Finding]:
    """When the engine loads another file than the reference: does it describe the same model?"""
    s.gguf_path()
    other = s.inputs.engine_gguf
    if other is None or s.inputs.engine is None:
        raise Skip("the engine loads the reference file itself")
    from .gguf import open_gguf

    g = s.gguf()
    diffs = []
    with open_gguf(other) as e:
        for key, f in g.fields.items():
            ef = e.fields.get(key)
            if ef is None or _meta_value(ef.value) != _meta_value(f.value):
                diffs.append({"key": key, "reference": _meta_value(f.value), "engine": None if ef is None
                              else _meta_value(ef.value)})
        changed = [t.name for t in g.tensors if not e.has_tensor(t.name)
                   or bytes(e.tensor(t.name).data) != bytes(t.data)]
    status = "fail" if diffs or changed else "pass"
    what = [f"metadata {d['key']}: {d['reference']} -> {d['engine']}" for d in diffs[:3]]
    what += [f"tensor {n} bytes differ" for n in changed[:3]]
    return [_finding("engine-file", s.inputs.engine, str(other), status, confidence="high",
                     hypothesis="the engine's model file is the reference file",
                     metrics={"metadata_diffs": len(diffs), "tensors_changed": len(changed)},
                     evidence=diffs[:5] + [{"tensor": n} for n in changed[:5]],
                     explanation=("the engine's model file differs from the reference: " + "; ".join(what))
                     if what else "same metadata and tensor bytes")]


def _meta_value(v: Any) -> Any:
    if hasattr(v, "tolist"):
        v = v.tolist()
    if isinstance(v, list) and len(v) > 64:
        return f"<array of {len(v)}>"
    return v


def h_metadata(s: Session) -> list[Finding]:
    """Metadata plausibility (checks/plausibility.py): hard inconsistencies between the hyperparameters
    and the tensors (the steps that need a consistent model are then skipped), and advisories for values
    far from the architecture's published configs; then the front end the file carries
    (checks/frontend.py): chat template, vocab, and llama.cpp's decoding of a sample of tokens."""
    from .checks import frontend, plausibility

    s.gguf_path()
    g = s.gguf()
    out = plausibility.run(g, s.inputs.gguf)
    try:
        from .subjects.engines.llama_cpp import VocabPieces

        pieces = VocabPieces(s.inputs.gguf)
    except Exception:  # no llama-cpp-python, or it cannot read this vocab: parity is then a skip
        pieces = None
    try:
        fe = frontend.run(g, s.inputs.gguf, pieces, sample=frontend.PARITY_SAMPLE)
    finally:
        if pieces is not None:
            pieces.close()
    for f in fe:  # a front-end fault ranks with this step (its own check stays in the target)
        f.confidence = f.confidence or "high"
        if f.status == "fail":
            f.check, f.target = "metadata", f"{f.check}: {f.target}"
    return out + fe


def h_mapping(s: Session) -> list[Finding]:
    """GGUF<->HF names, shapes, quant types and metadata semantics (checks/mapping.py); with --hf DIR
    also each tensor's numbers. The passing numeric findings are summarized in one."""
    from .checks import mapping

    s.gguf_path()
    s.progress("name map, shapes and metadata vs " + (str(s.inputs.hf) if s.inputs.hf else "the file's own metadata"))
    res = mapping.run(s.inputs.gguf, s.inputs.hf, consumer=s.inputs.engine)
    config_only = s.inputs.hf is not None and Path(s.inputs.hf).is_file()
    out, numeric = [], []
    for f in res.findings:
        f.confidence = "high"
        if config_only and f.target == "numeric":
            continue  # a config.json asks for names, shapes and metadata only: no numbers were requested
        (numeric if f.status == "pass" and f.target.startswith("numeric/") else out).append(f)
    if numeric:
        worst = max(numeric, key=lambda f: f.metrics["rel_l2"] / f.budget["rel_l2_max"])
        out.append(_finding("mapping", "gguf<->hf", "numeric", "pass", confidence="high",
                            metrics={"tensors": len(numeric), "worst": worst.target,
                                     "worst_ratio": worst.metrics["rel_l2"] / worst.budget["rel_l2_max"]},
                            explanation=f"{len(numeric)} tensors match the HF checkpoint within their "
                                        f"quantization band; worst {worst.target}"))
    return out


def _fold(findings: list[Finding], check: str, hypothesis: str, none_compared: str,
          most: int = 8) -> tuple[list[Finding], list[Finding]]:
    """A sub-check's findings as diagnose sees them: (its first `most` failures relabelled as `check`,
    the passes). Nothing compared at all is a Skip with the sub-check's reasons."""
    failed = [f for f in findings if f.status == "fail"][:most]
    for f in failed:
        f.check, f.confidence, f.hypothesis = check, "high", hypothesis
    compared = [f for f in findings if f.status == "pass"]
    if not failed and not compared:
        reasons = sorted({f.reason for f in findings if f.status == "skip"})
        raise Skip(f"{none_compared}: " + "; ".join(reasons[:2]))
    return failed, compared


DEQUANT_BLOCKS = 32  # blocks compared per tensor: first, last and 30 seeded ones


def h_dequant(s: Session) -> list[Finding]:
    """The engine's dequant kernel against the reference, on every tensor of the file."""
    from .checks import dequant

    s.gguf_path()
    kernel = s.inputs.dequant_kernel or ("ggml" if s.inputs.engine == "llama.cpp" else None)
    if kernel is None:
        raise Skip("no dequant kernel to check (--dequant-kernel, or an engine whose kernel is built in)")
    s.progress(f"dequant kernel {kernel!r} vs the reference")
    res = dequant.run(s.inputs.gguf, kernel=kernel, blocks=DEQUANT_BLOCKS, seed=s.inputs.seed)
    failed, compared = _fold(res.findings, "dequant", f"the dequant kernel {kernel!r} is right",
                             f"kernel {kernel!r} compared no tensor")
    if failed:
        return failed
    g = s.gguf()
    types = sorted({g.tensor(f.target).type.name for f in compared if g.has_tensor(f.target)})
    return [_finding("dequant", kernel, f"{len(compared)} tensors", "pass", confidence="high",
                     hypothesis=f"the dequant kernel {kernel!r} is right",
                     metrics={"tensors_compared": len(compared), "types": types,
                              "tensors_skipped": len(res.findings) - len(compared),
                              "blocks_per_tensor": DEQUANT_BLOCKS, "seconds": round(res.seconds, 1)},
                     explanation=f"bit-exact on {len(compared)} tensors ({', '.join(types)})")]


def h_fp16_overflow(s: Session) -> list[Finding]:
    """Would float16 overflow? Margin of the float32 reference's max |activation| to 65504, per layer."""
    _, _, stats = s.reference("float32")
    peak = max(stats, key=lambda st: st["max_abs"])
    over = [st for st in stats if st["max_abs"] > FP16_MAX]
    first = over[0] if over else None
    dtype = (s.inputs.engine_dtype or "").lower()
    margins = [{"layer": st["layer"], "max_abs": st["max_abs"], "margin": FP16_MAX / st["max_abs"]
                if st["max_abs"] else math.inf} for st in stats]
    metrics = {"peak_abs": peak["max_abs"], "peak_layer": peak["layer"], "peak_at": peak["max_at"],
               "first_overflow_layer": first["layer"] if first else None, "engine_dtype": dtype or None}
    if first is None:
        return [_finding("fp16-overflow", "reference", "activations", "pass", confidence="high",
                         hypothesis="activations fit in float16", metrics=metrics, evidence=margins,
                         explanation=f"peak |activation| {peak['max_abs']:.4g} at {peak['max_at']}: "
                                     f"float16 margin x{FP16_MAX / peak['max_abs']:.2f}")]
    msg = (f"the float32 residual stream reaches {first['max_abs']:.4g} at layer {first['layer']} "
           f"({first['max_at']}), beyond float16's 65504")
    if dtype in ("float16", "fp16", "half"):
        # confirm: the reference itself in float16 turns inf/NaN where predicted
        _, _, stats16 = s.reference("float16")
        nonfinite = next((st for st in stats16 if st["n_inf"] or st["n_nan"]), None)
        metrics["fp16_first_nonfinite_layer"] = nonfinite["layer"] if nonfinite else None
        return [_finding("fp16-overflow", s.inputs.engine or "deployment", "activations", "fail",
                         confidence="high" if nonfinite else "medium",
                         hypothesis="the deployment's float16 arithmetic overflows", metrics=metrics,
                         evidence=margins,
                         explanation=msg + (f"; the reference run in float16 turns inf/NaN at layer "
                                            f"{nonfinite['layer']} ({nonfinite['first_nonfinite']})"
                                            if nonfinite else "") +
                         ". Run the model in bfloat16 (same range as float32) instead of float16.")]
    return [_finding("fp16-overflow", "reference", "activations", "pass", confidence="high",
                     hypothesis="the deployment's arithmetic does not overflow (it does not run in float16)",
                     metrics={**metrics, "advisory": True},
                     evidence=margins,
                     explanation=f"advisory: {msg}. Harmless unless the deployment runs in float16 "
                                 f"(deployment precision: {dtype or 'unknown'}); use bfloat16 there.")]


def h_engine_finite(s: Session) -> list[Finding]:
    """inf/NaN in the engine's logits or captured activations where the reference's are finite: their own
    finding in words (checks/finite.py), never a "KL nan" or an "off by nan"."""
    from .checks import finite

    logits, caps, _ = s.engine_run()
    ref, ref_caps, _ = s.reference("float32")
    out = [finite.logits_finding(s.inputs.engine, logits, ref)]
    if (acts := finite.captures_finding(s.inputs.engine, caps, ref_caps)) is not None:
        out.append(acts)
    return out


def h_engine_vs_reference(s: Session) -> list[Finding]:
    """The engine's next-token distributions match the reference within the engine's own noise: every
    criterion (finite logits, KL, top-1) against what the emulated run's arithmetic explains
    (checks/layers.py `distribution_criteria`); the failing criteria are named."""
    from .checks import metrics as M
    from .checks.layers import distribution_criteria

    logits, _, _ = s.engine_run()
    ref, _, _ = s.reference("float32")
    emu, _, _ = s.budget_reference()
    got = torch.as_tensor(logits)
    crit = distribution_criteria(got, ref, emu, s.tokens())
    failed = [c for c in crit if not c.ok]
    by = {c.name: c for c in crit}
    metrics: dict[str, Any] = {}  # the numbers first: the terminal shows the first few
    budget: dict[str, Any] = {}
    if "kl" in by:
        top1 = M.top1_agreement(got, ref)
        worst = by["kl"].evidence[0]  # the position of the largest KL
        metrics.update(kl_mean=by["kl"].value, kl_max=worst["kl"], top1_agreement=top1,
                       top1_flips_beyond_noise=int(by["top1"].value), worst_position=worst["position"])
        budget.update(kl_mean_limit=by["kl"].limit, kl_noise_mean=by["kl"].noise,
                      top1_flips_allowed=int(by["top1"].limit))
    metrics.update(positions=got.shape[0], failed_criteria=[c.name for c in failed],
                   reference_reads=str(s.reference_path()))
    return [_finding(
        "engine-vs-reference", s.inputs.engine, "next-token distributions", "fail" if failed else "pass",
        confidence="high", hypothesis="the engine computes the model's distribution", metrics=metrics,
        budget=budget, evidence=[c.as_dict() for c in crit],
        explanation=("; ".join(f"the {c.name} criterion fails: {c.reason}" for c in failed) if failed else
                     f"KL {by['kl'].value:.3g} (noise {by['kl'].noise:.3g}), top-1 {top1:.0%}: every top-1 flip "
                     "and the KL within the engine's noise"),
    )]


def h_engine_backends(s: Session) -> list[Finding]:
    """Which attention backends vLLM selects for this model, dtype and platform, asked of vLLM's own
    selection code in the deployment's interpreter, against the backends the running engine built
    (subjects/engines/vllm.py). The finding lists what each backend setting would select instead."""
    if s.inputs.engine != "vllm":
        raise Skip("only --engine vllm selects attention backends at run time")
    from .subjects.engines import vllm

    try:  # the run asks vLLM's selection under the config the engine was built with
        _, _, info = s.engine_run()
        built, explained = info["backends"], info["explained"]
    except Skip as e:  # ask the selection alone: vLLM's own reason the model cannot run
        built, ran, dtype = None, str(e), s.inputs.engine_dtype
        try:
            python = vllm.find_python(s.inputs.engine_python)
            s.progress("vLLM's own attention-backend selection")
            explained = vllm.explain(python, s.engine_model(), dtype=_torch_dtype_name(dtype) if dtype else None)
        except vllm.EngineError as e:
            raise Skip(f"{ran}; vLLM's backend selection could not run either: {e}") from None
    sel = explained["selected"]
    metrics = {"kind": explained["kind"], "selected": sel, "built": built, "knobs": explained["knobs"],
               "env": explained["env"], "vllm": explained["vllm"], "platform": explained["platform"]}
    if built is None:
        raise Skip(f"{ran}; vLLM's own selection for this model: "
                   + (sel["error"] if sel.get("error") else f"{sel['decode']} (prefill {sel['prefill']})"))
    wrong = vllm.built_matches_selected(built, explained)
    what = f"{sel['decode']}" + (f", prefill {sel['prefill']}" if explained["kind"] == "mla" else "")
    return [_finding("engine-backends", "vllm", f"{explained['kind']} attention", "fail" if wrong else "pass",
                     confidence="high", hypothesis="the engine runs the attention backends vLLM selects for this model",
                     metrics=metrics, evidence=[{"mismatch": w} for w in wrong[:5]],
                     explanation=(f"the engine built other backends than vLLM's selection ({what}): {wrong[0]}"
                                  if wrong else f"vLLM {explained['vllm']} on {explained['platform']} selects {what} "
                                  f"for {explained['dtype']}, head size {explained['head_size']}, and built it in every "
                                  f"layer; settings that change it: {', '.join(sorted(explained['knobs'])) or 'none'}"))]


def h_dsa_selection(s: Session) -> list[Finding]:
    """Per layer with a DSA indexer (GLM-5 glm-dsa): whether the keys the engine's indexer selects for
    each query (`top_k-{i}`) are among the reference's top k by the reference's own index scores (ties
    at the k-th score may go either way), against what the engine's own arithmetic explains (the
    emulated run's). A wrong indexer (rope on the wrong dims, a missing weight, the wrong scale) shows
    here before the attention output does."""
    from .checks.layers import routing_limit, selection_disagreement

    m = s.config().mla
    if m is None or m.indexer is None:
        raise Skip(f"{s.config().arch} has no sparse-attention indexer")
    if len(s.tokens()) <= m.indexer.top_k:
        raise Skip(f"{len(s.tokens())} tokens, top-k {m.indexer.top_k}: every query selects every key it sees "
                   "(give a longer prompt to test the indexer)")
    _, engine_caps, _ = s.engine_run()
    _, ref_caps, _ = s.reference("float32")
    _, emu_caps, _ = s.budget_reference()
    rows, scores, emu_scores, k = [], None, None, m.indexer.top_k
    for il in range(s.config().n_layer):
        # a shared layer uses the last full layer's scores
        scores = ref_caps.get(f"indexer_score-{il}", scores)
        emu_scores = emu_caps.get(f"indexer_score-{il}", emu_scores)
        name = f"top_k-{il}"
        # llama.cpp: the view of the selection that layer il's attention reads is "top_k-{il} (view)" (its
        # own indexer's or the shared one's); the bare "top_k-{il}" node name is not reliably that layer's
        engine_sel = engine_caps.get(f"{name} (view)", engine_caps.get(name))
        if scores is not None and emu_scores is not None and engine_sel is not None:
            # the noise: what the engine's arithmetic would pick from the same state (the emulated run's
            # own top k; its selections themselves are the engine's, swapped in, see Session.reference_extra)
            emu_sel = np.argsort(-np.asarray(emu_scores, dtype=np.float64), axis=1, kind="stable")[:, :k]
            rows.append({"layer": il, "disagreement": selection_disagreement(scores, engine_sel, k),
                         "noise": selection_disagreement(scores, emu_sel, k), "limit": 0.0})
            rows[-1]["limit"] = routing_limit(rows[-1]["noise"], int(scores.shape[0]))
    if not rows:
        raise Skip("the engine exposed no indexer selections (top_k)")
    bad = [r for r in rows if r["disagreement"] > r["limit"]]
    if not bad:
        return [_finding("dsa-selection", s.inputs.engine, f"{len(rows)} indexer layers", "pass", confidence="high",
                         hypothesis="the engine's indexer selects the reference's keys",
                         metrics={"layers": len(rows), "max_disagreement": max(r["disagreement"] for r in rows)},
                         evidence=rows, explanation=f"key selections agree in {len(rows)} indexer layers")]
    first = bad[0]
    _, layer, point = s.divergence()
    if layer is not None and (layer < first["layer"] or layer == first["layer"] and point.point == "attn_norm"):
        raise Skip(f"the indexer's inputs already differ: the engine diverges at {point.point}-{layer}, upstream of "
                   f"the first layer whose key selection differs ({first['layer']})")
    return [_finding("dsa-selection", s.inputs.engine, f"layer {first['layer']}", "fail", confidence="high",
                     hypothesis="the engine's indexer selects the reference's keys",
                     metrics={"first_layer": first["layer"], **first}, evidence=rows,
                     explanation=f"the sparse-attention indexer selects other keys from layer {first['layer']}: "
                                 f"{first['disagreement']:.0%} of queries (its arithmetic explains {first['limit']:.0%}); "
                                 f"check the indexer's rope dims and order, k norm, head weights and scale")]


# Capture points of a layer that come before its MoE router (which reads the normed FFN input).
_BEFORE_ROUTER = frozenset({"attn_norm", "kqv_out", "ffn_inp"})


def h_moe_routing(s: Session) -> list[Finding]:
    """Per MoE layer: whether the experts the engine chose (`ffn_moe_topk-{i}`) are a top-k choice the
    reference's selection scores allow, within what the engine's own arithmetic moves a score (the
    emulated run's score error, checks/layers.py routing_tolerance). Every reference run takes the
    engine's choices (Session.reference_extra), so a near-tie flip is neither a routing fault nor a
    divergence downstream. A missing score-correction bias, a wrong grouped top-k or a wrong gating
    function chooses experts the scores do not allow."""
    from .checks.layers import routing_inadmissible, routing_tolerance

    moe = s.config().moe
    if moe is None:
        raise Skip(f"{s.config().arch} has no MoE layers")
    _, engine_caps, _ = s.engine_run()
    _, ref_caps, _ = s.reference("float32")
    _, emu_caps, _ = s.budget_reference()
    rows = []
    for il in range(s.config().n_layer):
        name, scores = f"ffn_moe_topk-{il}", f"ffn_moe_scores-{il}"
        if name in engine_caps and scores in ref_caps and scores in emu_caps:
            tol = routing_tolerance(ref_caps[scores], emu_caps[scores])
            bad = routing_inadmissible(ref_caps[scores], engine_caps[name], moe.n_used, tol, moe.n_group,
                                       moe.topk_group)
            # not the reference's own top k, yet allowed: a near-tie the engine's arithmetic took the other way
            other = routing_inadmissible(ref_caps[scores], engine_caps[name], moe.n_used, 0.0, moe.n_group,
                                         moe.topk_group) & ~bad
            rows.append({"layer": il, "disagreement": float(bad.mean()), "tolerance": tol,
                         "positions": [int(p) for p in np.nonzero(bad)[0][:8]], "near_ties_taken": int(other.sum())})
    if not rows:
        raise Skip("the engine exposed no routing decisions (ffn_moe_topk)")
    curve, _, _ = s.divergence()
    diverged = {(p.layer, p.point) for p in curve if p.divergent}
    for r in rows:  # the first MoE layer whose routing is wrong given the same inputs
        if not r["disagreement"]:
            continue
        il = r["layer"]
        upstream = _router_inputs_differ(s, il, engine_caps, ref_caps, emu_caps, diverged)
        if upstream:
            raise Skip(f"the router's inputs already differ at layer {il} ({upstream}); routing there "
                       f"({r['disagreement']:.0%} of positions chose other experts) cannot be judged apart from "
                       "that divergence")
        return [_finding("moe-routing", s.inputs.engine, f"layer {il}", "fail", confidence="high",
                         hypothesis="the engine routes tokens to the reference's experts",
                         metrics={"first_layer": il, **r}, evidence=rows,
                         explanation=f"MoE routing differs from layer {il}: {r['disagreement']:.0%} of positions "
                                     f"chose experts the router's scores do not allow (positions {r['positions']}; "
                                     f"near-ties within {r['tolerance']:.2g} may go either way): check the "
                                     "score-correction bias, grouped top-k and gating function")]
    return [_finding("moe-routing", s.inputs.engine, f"{len(rows)} MoE layers", "pass", confidence="high",
                     hypothesis="the engine routes tokens to the reference's experts",
                     metrics={"layers": len(rows), "max_disagreement": max(r["disagreement"] for r in rows),
                              "near_ties_taken": sum(r["near_ties_taken"] for r in rows)},
                     evidence=rows, explanation=f"expert choices are ones the router's scores allow in "
                                                f"{len(rows)} MoE layers ({sum(r['near_ties_taken'] for r in rows)} "
                                                "near-ties taken the other way, which rounding may do)")]


def _router_inputs_differ(s: Session, il: int, engine_caps, ref_caps, emu_caps, diverged: set) -> str:
    """Why layer il's router does not see the reference's input ("" when it does): its input itself
    (`ffn_norm-{il}`) beyond the engine's noise when both sides expose it, else a divergent point
    upstream of the router in the layer curve."""
    from .checks import metrics as M
    from .checks.layers import PointError

    name = f"ffn_norm-{il}"
    if name in engine_caps and name in ref_caps and name in emu_caps:
        p = PointError(il, "ffn_norm", M.rel_l2(engine_caps[name], ref_caps[name]),
                       M.rel_l2(emu_caps[name], ref_caps[name]))
        return f"{name} {_off_by(p)}" if p.divergent else ""
    before = sorted((layer, pt) for layer, pt in diverged if layer < il or layer == il and pt in _BEFORE_ROUTER)
    return f"the engine diverges at {before[0][1]}-{before[0][0]}" if before else ""


def _off_by(p) -> str:
    """How far a capture point (checks/layers.PointError) is from the reference, in words; a non-finite
    error is said as such (never "off by nan")."""
    if not math.isfinite(p.error):
        return "is not finite in the engine (inf/NaN) where the reference is finite"
    return f"is off by {p.error:.3g} (rel. L2) where the engine's noise is {p.noise:.3g}"


def h_layer_localization(s: Session) -> list[Finding]:
    """Where the engine's activations leave the reference (noise-aware, layer by layer)."""
    curve, layer, point = s.divergence()
    if not curve:
        raise Skip("the engine exposed no activations that map onto the reference's capture points")
    s.curve = [p.as_dict() for p in curve]
    if layer is None:
        worst = max(curve, key=lambda p: p.error / p.limit)
        return [_finding("layer-localization", s.inputs.engine, "layers", "pass", confidence="high",
                         hypothesis="every layer stays within the engine's noise",
                         metrics={"points": len(curve), "worst_ratio": worst.error / worst.limit,
                                  "worst": f"{worst.point}-{worst.layer}"},
                         explanation=f"{len(curve)} points within budget; worst {worst.point}-{worst.layer} "
                                     f"at {worst.error / worst.limit:.2f} of its limit")]
    swaps = substitutions(s, point)
    confirmed = [w for w in swaps if w["reproduces"]]
    return [_finding("layer-localization", s.inputs.engine, f"layer {layer}", "fail", confidence="high",
                     hypothesis="every layer stays within the engine's noise",
                     metrics={"first_divergent_layer": layer, "point": point.point, "error": point.error,
                              "noise": point.noise, "limit": point.limit,
                              "substitutions": swaps},
                     evidence=[p.as_dict() for p in curve if p.layer in (layer - 1, layer, layer + 1)],
                     explanation=f"first divergent layer {layer}: {point.point}-{layer} {_off_by(point)}"
                                 + (f"; swapping {confirmed[0]['swap']} into the reference alone reproduces it"
                                    if confirmed else
                                    ("; no single swap into the reference reproduces it" if swaps else "")))]


def substitutions(s: Session, point) -> list[dict[str, Any]]:
    """Op substitution: rerun the reference with one suspect component swapped in (the engine's
    precision; the --dequant-kernel; the --attention-impl under the prefill contract, dense models)
    and ask whether that swap alone reproduces the engine's divergence at its first divergent point
    (error at least half the engine's, or non-finite like it)."""
    from .checks import metrics as M

    name = f"{point.point}-{point.layer}"
    _, ref_caps, _ = s.reference("float32")

    def reproduces(caps) -> tuple[bool, float]:
        if name not in caps:
            return False, math.nan
        err = M.rel_l2(caps[name], ref_caps[name])
        return (not math.isfinite(err) and not math.isfinite(point.error)) or \
            (math.isfinite(err) and err >= 0.5 * point.error), err

    out = []
    precision = "llama.cpp arithmetic (Q8 activations, F16 KV)" if s.inputs.engine == "llama.cpp" \
        else f"{_torch_dtype_name(s.inputs.engine_dtype or 'float32')} precision"
    ok, err = reproduces(s.budget_reference()[1])
    out.append({"swap": f"the engine's {precision}", "reproduces": ok, "error": err})
    if s.inputs.dequant_kernel and s.inputs.gguf is not None:
        from .subjects.substitution import KernelDequantizer

        s.progress(f"reference with the dequant kernel {s.inputs.dequant_kernel!r} swapped in")
        try:
            with KernelDequantizer(s.inputs.dequant_kernel) as kd:
                from .reference import load

                with load(s.inputs.gguf, dequantizer=kd) as model:
                    with s.pinned_threads():
                        _, caps = model.forward(s.tokens(), capture={name}, extra=s.reference_extra())
            ok, err = reproduces(caps)
            out.append({"swap": f"the dequant kernel {s.inputs.dequant_kernel!r}", "reproduces": ok, "error": err})
        except Exception as e:  # the suspect kernel may crash: that is evidence too, not our failure
            out.append({"swap": f"the dequant kernel {s.inputs.dequant_kernel!r}", "reproduces": None,
                        "error": None, "could_not_run": f"{type(e).__name__}: {e}"})
    if s.inputs.attention_impl and (s.inputs.attention_contract or "prefill") == "prefill" and s.config().mla is None:
        from .subjects.substitution import PrefillAttention

        s.progress(f"reference with the attention kernel {s.inputs.attention_impl!r} swapped in")
        try:
            with PrefillAttention(s.inputs.attention_impl) as swapped:
                with s.pinned_threads():
                    _, caps = s.model().forward(s.tokens(), capture={name}, attention=swapped,
                                                extra=s.reference_extra())
            ok, err = reproduces(caps)
            out.append({"swap": f"the attention kernel {s.inputs.attention_impl!r}", "reproduces": ok, "error": err})
        except Exception as e:
            out.append({"swap": f"the attention kernel {s.inputs.attention_impl!r}", "reproduces": None,
                        "error": None, "could_not_run": f"{type(e).__name__}: {e}"})
    return out


def h_attention(s: Session) -> list[Finding]:
    """`check attention` of the given kernel on this model's attention shape (checks/attention.py)."""
    if not s.inputs.attention_impl:
        raise Skip("no attention kernel given (--attention-impl)")
    from .checks import attention

    shape = attention.shape_from_config(s.config(), Path(s.reference_path()).name)
    dtype = _torch_dtype_name(s.inputs.engine_dtype) if s.inputs.engine_dtype else "float32"
    res = attention.run(shape, [(s.inputs.attention_impl, s.inputs.attention_contract)],
                        dtypes=(dtype,), explicit=(s.inputs.attention_impl,), seed=s.inputs.seed,
                        on_step=s.progress)
    failed, compared = _fold(res.findings, "attention", "the attention kernel computes the reference's attention",
                             "the attention kernel compared no case")
    if failed:
        return failed
    return [_finding("attention", s.inputs.attention_impl, f"{len(compared)} cases", "pass", confidence="high",
                     hypothesis="the attention kernel computes the reference's attention",
                     metrics={"cases_passed": len(compared),
                              "cases_skipped": sum(f.status == "skip" for f in res.findings), "dtype": dtype},
                     explanation=f"{len(compared)} cases within the {dtype} budget (float32: the any-order "
                                 "rounding bound; half precision: 4x the noise floor)")]


def h_symptom_bisection(s: Session) -> list[Finding]:
    """Black-box probes of the endpoint (checks/probes.py), against the reference when --gguf is given."""
    if not s.inputs.endpoint:
        raise Skip("no endpoint given (--endpoint)")
    from .checks.probes import probe

    rep = probe(s.inputs.endpoint, gguf=s.inputs.gguf, seed=s.inputs.seed, progress=s.progress)
    if rep.verdict == "inconclusive" and not any(f.status == "fail" for f in rep.findings):
        raise Skip(f"the endpoint probes were inconclusive: {', '.join(rep.symptoms) or 'no evidence'}")
    out = []
    for f in rep.findings:
        f.target = f"{f.check}: {f.target}"
        f.check = "symptom-bisection"
        f.confidence = f.confidence or "medium"
        out.append(f)
    return out


def plan(inputs: Inputs) -> list[Hypothesis]:
    """The ordered hypotheses, cheapest first."""
    return [
        Hypothesis("file-integrity", "Is the model file intact?", h_file_integrity),
        Hypothesis("engine-file", "Does the engine load the same model?", h_engine_file),
        Hypothesis("metadata", "Does the metadata describe the tensors?", h_metadata),
        Hypothesis("mapping", "Are the GGUF<->HF names and layouts right?", h_mapping),
        Hypothesis("dequant", "Is the engine's dequant kernel right?", h_dequant),
        Hypothesis("fp16-overflow", "Does the model overflow in float16?", h_fp16_overflow),
        Hypothesis("attention", "Are the attention kernels right?", h_attention),
        Hypothesis("dsa-selection", "Does the engine's sparse-attention indexer select the reference's keys?",
                   h_dsa_selection),
        Hypothesis("moe-routing", "Does the engine route tokens to the reference's experts?", h_moe_routing),
        Hypothesis("engine-backends", "Which attention backends does vLLM select, and did it build them?",
                   h_engine_backends),
        Hypothesis("engine-finite", "Does the engine compute finite numbers?", h_engine_finite),
        Hypothesis("engine-vs-reference", "Does the engine compute the model's distribution?",
                   h_engine_vs_reference),
        Hypothesis("symptom-bisection", "Which symptom class does the endpoint show?", h_symptom_bisection),
        Hypothesis("layer-localization", "Where does the engine leave the reference?", h_layer_localization),
    ]


def run(inputs: Inputs, progress: Callable[[str], None] = lambda s: None) -> Diagnosis:
    if inputs.engine is not None and inputs.engine not in ENGINES:
        raise InputError(f"unknown engine {inputs.engine!r} (known: {', '.join(ENGINES)})")
    s = Session(inputs, progress)
    try:
        return _run(s, inputs, progress)
    finally:
        s.close()


def _named_subjects(inputs: Inputs) -> set[str]:
    """Hypotheses whose subject the user named explicitly: if one cannot run, nothing healthy can be
    concluded about it (exit 2), unlike a hypothesis merely implied by the plan."""
    named = set()
    if inputs.dequant_kernel:
        named.add("dequant")
    if inputs.attention_impl:
        named.add("attention")
    if inputs.endpoint:
        named.add("symptom-bisection")
    if inputs.hf and inputs.gguf is not None:  # an HF checkpoint alone is the reference's model, not a mapping
        named.add("mapping")
    if inputs.engine:
        named.add("engine-vs-reference")
    return named


def _run(s: Session, inputs: Inputs, progress: Callable[[str], None]) -> Diagnosis:
    findings: list[Finding] = []
    timings: dict[str, float] = {}
    for h in plan(inputs):
        progress(h.question)
        t0 = time.perf_counter()
        try:
            fs = h.run(s)
        except Skip as e:
            fs = [_finding(h.key, inputs.engine or "-", "-", "skip", reason=str(e), hypothesis=h.question)]
        except GGUFError as e:  # the file-integrity finding already names the problem
            fs = [_finding(h.key, inputs.engine or "-", "-", "skip", hypothesis=h.question,
                           reason=f"the model file cannot be read: {e.problem}")]
        timings[h.key] = round(time.perf_counter() - t0, 2)
        for f in fs:
            f.hypothesis = f.hypothesis or h.question
        findings.extend(fs)
    order = {h.key: i for i, h in enumerate(plan(inputs))}
    suspects = sorted((f for f in findings if f.status == "fail"),
                      key=lambda f: (order.get(f.check, 99), CONFIDENCE_ORDER.get(f.confidence, 3)))
    ruled_out = [f for f in findings if f.status == "pass"]
    c = count(findings)
    if suspects:
        verdict, code = f"fault found: {suspects[0].explanation}", 1
        layer = next((f for f in suspects if f.check == "layer-localization"), None)
        if layer is not None and suspects[0] is not layer:
            verdict += f" (first divergent layer: {layer.metrics['first_divergent_layer']})"
    elif missing := [f for f in findings if f.status == "skip" and f.check in _named_subjects(inputs)
                     and not any(g.check == f.check and g.status != "skip" for g in findings)]:
        verdict, code = f"could not diagnose: {missing[0].check} could not run: {missing[0].reason}", 2
    elif c["passed"] == 0 or not any(f.check in ("engine-vs-reference", "layer-localization")
                                     and f.status == "pass" for f in findings) and inputs.engine:
        verdict, code = "could not diagnose: nothing was compared", 2
    else:
        verdict, code = "healthy", 0
    return Diagnosis(findings, suspects, ruled_out, verdict, code, s.curve, timings, s.threads,
                     engine_run=s.engine_info())
