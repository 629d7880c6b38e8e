"""The evidence of one diagnosis, each piece computed once and lazily: the model file and its config, the
prompt's tokens, the reference's runs (float32, and the run that emulates the engine's arithmetic), and
the engine's run through the engine interface (subjects/engines)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from ..reference.device_cache import DeviceBudget
from ..reference.points import REFERENCE_POINTS
from ..reference.stages import stage
from ..subjects.engines import create, engine_class
from ..subjects.engines.base import Budget, Deployment, Engine, EngineError, EngineRun, Generation, NotOffered
from .inputs import Inputs

NO_GGUF = "no GGUF file (the reference reads the HF checkpoint)"


class Skip(Exception):
    """A hypothesis that cannot run here; the message is the reason."""


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
        # every reference model's dequantized weights on --device, together, within --max-gpu-memory
        self.device_budget = DeviceBudget(inputs.max_gpu_memory)

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

    def once_or_skip(self, key: str, make: Callable[[], Any]) -> Any:
        """`once`, where `make` may return a Skip (an engine that could not run): remembered, so later
        hypotheses do not retry, and raised on every ask."""
        result = self.once(key, make)
        if isinstance(result, Skip):
            raise result
        return result

    # ---- the model ----------------------------------------------------------------------------
    def checkpoint(self) -> Path | None:
        """The HF checkpoint directory the reference reads (--hf DIR with safetensors and no --gguf, or the
        checkpoint the engine ran in place of a GGUF it could not run), or None."""
        from ..reference.checkpoint import is_checkpoint

        ran = self._cache.get("engine")
        if isinstance(ran, EngineRun) and ran.info.reference_reads:
            return Path(ran.info.reference_reads)
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
        from ..gguf import open_gguf

        path = self.gguf_path()
        return self.once("gguf", lambda: open_gguf(path))

    def config(self):
        from ..reference.config import from_gguf, from_hf

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
                from ..reference.hf_tokenizer import checkpoint_tokenizer

                return checkpoint_tokenizer(self.reference_path()).encode(self.inputs.prompt)
            from ..reference.tokenizer import Tokenizer

            return self.once("gguf-tokenizer", lambda: Tokenizer.from_gguf(self.gguf())).encode(self.inputs.prompt)

        return self.once("tokens", make)

    def inconsistency(self) -> str | None:
        """The first hard metadata problem of the GGUF (checks/file/plausibility.py), or None: a model whose
        metadata contradicts its tensors is neither built nor run."""
        def make():
            from ..checks.file.plausibility import hard_problems

            problems = hard_problems(self.gguf()) if self.inputs.gguf is not None else []
            return problems[0].message if problems else None

        return self.once("inconsistency", make)

    def require_consistent(self) -> None:
        if (why := self.inconsistency()) is not None:
            raise Skip(f"the metadata is inconsistent ({why})")

    # ---- the reference ------------------------------------------------------------------------
    def model(self, dtype: str = "float32"):
        """The reference model in `dtype`, its dequantized weights cached for every later use."""
        self.require_consistent()

        def make():
            from ..reference import load

            device = self.inputs.device
            return load(self.reference_path(), dtype=getattr(torch, dtype), cache=True, device=device,
                        budget=self.device_budget, capture_to=None if device == "cpu" else "cpu")

        return self.once(f"model-{dtype}-{self.reference_path()}", make)

    def reference(self, dtype: str = "float32", emulate=None, tokens: list[int] | None = None):
        """(logits [T, V], captures, per-layer stats) of the reference run in `dtype`, optionally with
        an engine's arithmetic emulated (`emulate`: a reference/emulate.py EnginePrecision), of the prompt's
        tokens or of other `tokens` (the decode path's prompt + the engine's continuation)."""
        ids = self.tokens() if tokens is None else list(tokens)
        other = ids != self.tokens()

        def make():
            extra = self.reference_extra(ids if other else None)
            self.progress(f"reference forward pass ({dtype}{', ' + emulate.name + ' arithmetic' if emulate else ''}"
                          f"{f', {len(ids)} tokens' if other else ''})")
            model = self.model(dtype)
            with stage("reference"), self.pinned_threads():
                logits, caps = model.forward(ids, capture=set(REFERENCE_POINTS), emulate=emulate, extra=extra)
            return logits.cpu(), caps, [st.as_dict() for st in model.stats]

        key = f"reference-{dtype}-{emulate.name if emulate else None}-{self.reference_path()}"
        return self.once(key + (f"-on-{tuple(ids)}" if other else ""), make)

    def budget(self) -> Budget:
        """Which reference run emulates the engine's arithmetic (the engine's answer, from its run)."""
        return self.engine().noise_budget(self.engine_run())

    def budget_reference(self):
        """The reference run with the engine's arithmetic: how far a healthy engine may be."""
        b = self.budget()
        return self.reference(b.dtype, emulate=b.emulate)

    def close(self) -> None:
        for key, value in self._cache.items():
            if key.startswith("model-") or key in ("gguf", "engine-instance"):
                value.close()

    # ---- the engine ---------------------------------------------------------------------------
    def engine_model(self) -> Path:
        """What the engine loads: its own copy when one is given (a planted fault), else the reference's model."""
        if self.inputs.gguf is None:
            return self.inputs.engine_hf or self.reference_path()
        return self.inputs.engine_gguf or self.inputs.gguf

    def engine(self) -> Engine:
        """The engine under test (--engine) for this deployment, through the registry; a Skip saying why
        when none is named or it cannot run this model's format."""
        name = self.inputs.engine
        if name is None:
            raise Skip("no in-process engine (--engine)")

        def make() -> Engine:
            i = self.inputs
            engine = create(name, Deployment(model=self.engine_model(), hf=i.hf if i.gguf is not None else None,
                                             dtype=i.engine_dtype, python=i.engine_python, threads=i.threads,
                                             dequant_kernel=i.dequant_kernel, tokenizer=i.tokenizer,
                                             device=i.device))
            return i.engine_plant(engine) if i.engine_plant is not None else engine

        if self.inputs.gguf is None and "hf" not in engine_class(name).traits.formats:
            raise Skip(f"{name} runs GGUF files only: no --gguf given")
        return self.once("engine-instance", make)

    def dequant_kernel(self) -> str | None:
        """The dequant kernel to check: --dequant-kernel, else the engine's built-in one (llama.cpp: ggml)."""
        if self.inputs.dequant_kernel:
            return self.inputs.dequant_kernel
        return engine_class(self.inputs.engine).traits.dequant_kernel if self.inputs.engine else None

    def engine_run(self) -> EngineRun:
        """The engine's teacher-forced run of the tokens: logits [T, V] and captures under the reference's
        names. An engine that cannot run the model is a skip with the reason, remembered so later
        hypotheses do not retry."""
        engine = self.engine()
        self.require_consistent()

        def make():
            self.progress(f"{engine.name} forward pass ({engine.traits.captures})")
            try:
                with stage("engine"):
                    return engine.run(self.tokens(), self.config())
            except EngineError as e:
                return Skip(f"the engine could not run the model: {e}")

        return self.once_or_skip("engine", make)

    def engine_run_on(self, tokens: list[int]) -> EngineRun:
        """The engine's teacher-forced run of other token ids (its own tokenization of a prompt, where it
        differs from the reference's), keyed by the ids; the run of the reference's tokens is `engine_run`'s.
        An EngineError is raised as a Skip with the reason."""
        if list(tokens) == self.tokens():
            return self.engine_run()
        engine = self.engine()

        def make():
            self.progress(f"{engine.name} forward pass on its own tokens ({len(tokens)})")
            try:
                with stage("engine"):
                    return engine.run(list(tokens), self.config())
            except EngineError as e:
                return Skip(f"the engine could not run its own tokens: {e}")

        return self.once_or_skip(f"engine-on-{tuple(tokens)}", make)

    def reference_logits_on(self, tokens: list[int]) -> torch.Tensor:
        """The float32 reference's logits [T, V] of other token ids, keyed by the ids (no captures)."""
        if list(tokens) == self.tokens():
            return self.reference("float32")[0]

        def make():
            self.progress(f"reference forward pass ({len(tokens)} other tokens)")
            with stage("reference"), self.pinned_threads():
                logits, _ = self.model().forward(list(tokens), capture=set())
            return logits.cpu()

        return self.once(f"reference-on-{tuple(tokens)}", make)

    def prefill_criteria(self) -> list:
        """The engine's next-token distributions of the prompt against the reference's, each criterion against
        the emulated run's noise (checks/compute/layers.py `distribution_criteria`), computed once: engine-vs-reference
        reports them, the decode path asks whether the prefill already disagrees (float64 over [T, V]: seconds)."""
        from ..checks.compute.layers import distribution_criteria

        return self.once("prefill-criteria", lambda: distribution_criteria(
            torch.as_tensor(self.engine_run().logits), self.reference("float32")[0], self.budget_reference()[0],
            self.tokens()))

    def generation(self, captures: bool = False) -> Generation:
        """The engine's greedy generation of `inputs.generate` new tokens after the prompt (Engine.generate),
        once. With `captures`, a second generation that also copies the decode steps' activations: capturing
        slows every step, so it runs only to localize a decode-path fault (the caller checks that it took
        the same tokens). A skip says why the engine cannot generate."""
        engine = self.engine()
        self.require_consistent()

        def make():
            self.progress(f"{engine.name} generating {self.inputs.generate} tokens"
                          f"{' (capturing the decode steps)' if captures else ''}")
            try:
                with stage("engine"):
                    return engine.generate(self.tokens(), self.inputs.generate, captures=captures)
            except NotOffered as e:
                return Skip(str(e))
            except EngineError as e:
                return Skip(f"the engine could not generate: {e}")

        return self.once_or_skip(f"generation-{captures}", make)

    def engine_info(self) -> dict[str, Any] | None:
        """What the engine reported of itself (versions, dtype, backends) if it ran in this session; never
        runs it."""
        ran = self._cache.get("engine")
        return ran.info.as_dict() if isinstance(ran, EngineRun) else None

    def reference_extra(self, tokens: list[int] | None = None) -> dict | None:
        """Per-run state for every reference forward pass of this diagnosis: the engine's discrete choices
        (DSA key selections, MoE experts) where the model has them and the engine exposes them. The model
        does not say which of the keys or experts tied (or within rounding of a tie) at the k-th score to
        take: ReLU index scores are often exactly 0, and a router's near-tie flips under any other
        arithmetic, which moves the output far more than the arithmetic itself. So every reference run
        takes the engine's choices, and whether each is one the scores allow is the dsa-selection and
        moe-routing checks' business. `tokens`: other token ids than the prompt's, whose choices come from
        the engine's run of those (`engine_run_on`)."""
        from ..reference.arch_deepseek import DSA_OVERRIDE, MOE_OVERRIDE

        cfg = self.config()
        if self.inputs.engine is None or (cfg.moe is None and (cfg.mla is None or cfg.mla.indexer is None)):
            return None
        try:
            caps = (self.engine_run() if tokens is None else self.engine_run_on(tokens)).captures
        except Skip:
            return None
        n_tokens = len(self.tokens() if tokens is None else tokens)
        dsa, moe = {}, {}
        for il in range(cfg.n_layer):
            sel = caps.get(f"top_k-{il} (view)", caps.get(f"top_k-{il}"))
            if sel is not None and cfg.mla is not None and cfg.mla.indexer is not None:
                dsa[il] = torch.as_tensor(np.asarray(sel, dtype=np.int64), device=self.inputs.device)
            experts = caps.get(f"ffn_moe_topk-{il}")
            if experts is not None and cfg.moe is not None and np.shape(experts) == (n_tokens, cfg.moe.n_used):
                moe[il] = torch.as_tensor(np.asarray(experts, dtype=np.int64), device=self.inputs.device)
        extra = {k: v for k, v in ((DSA_OVERRIDE, dsa), (MOE_OVERRIDE, moe)) if v}
        return extra or None

    def divergence(self):
        """(error curve, first divergent layer or None, its point) of the engine's activations against
        the reference, noise-aware (checks/compute/layers.py)."""
        def make():
            from ..checks.compute.layers import CURVE_POINTS, error_curve, first_divergent_layer

            engine_caps = self.engine_run().captures
            _, ref_caps, _ = self.reference("float32")
            _, emu_caps, _ = self.budget_reference()
            curve = error_curve(ref_caps, emu_caps, engine_caps, self.config().n_layer, points=CURVE_POINTS)
            return (curve, *first_divergent_layer(curve)) if curve else (curve, None, None)

        return self.once("divergence", make)
