"""The evidence of one diagnosis, each piece computed once and lazily, in the order the steps produce it: the
inputs (the model file and its config, the prompt's tokens); the engine's runs through the engine interface
(subjects/engines); what the reference takes from them (replay.py: the model it reads, the engine's discrete
choices); the reference's runs (float32, and the run that emulates the engine's arithmetic). A step reads only
what the steps before it produce. The session holds evidence and judges nothing: the checks in checks/, asked
by the hypotheses, do."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..reference.device_cache import DeviceBudget
from ..reference.points import REFERENCE_POINTS
from ..reference.stages import stage
from ..subjects.engines import create, engine_class
from ..subjects.engines.base import Budget, Deployment, Engine, EngineError, EngineRun, Generation, NotOffered
from . import replay
from .replay import choices as replay_choices
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
        # torch's thread count for every reference run: --threads, else the count at the start. It is
        # one setting for the whole process (an in-process engine or a dequant pool may change it) and
        # a reduction's bits may depend on it (MKL's [54, 256] x [256, 54] product differs from 8 threads
        # on), which the emulated run's Q8 rounding would turn into another noise budget: pinned, so that
        # the same command gives the same budgets (issue 18).
        self.threads = inputs.threads or torch.get_num_threads()
        # every reference model's dequantized weights on --device, together, within --max-gpu-memory
        self.device_budget = DeviceBudget(inputs.max_gpu_memory)
        # randomized draws of the engine's arithmetic that set the allowances (checks/compute/allowance.py);
        # fewer than its MIN_DRAWS: the single emulated run's K-times rule
        from ..checks.compute.allowance import N_DRAWS

        self.n_draws = N_DRAWS

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
    def given_checkpoint(self) -> Path | None:
        """The HF checkpoint directory given as the model (--hf DIR with safetensors and no --gguf), or None."""
        from ..reference.checkpoint import is_checkpoint

        hf = self.inputs.hf
        return Path(hf) if self.inputs.gguf is None and hf is not None and is_checkpoint(hf) else None

    def checkpoint(self) -> Path | None:
        """The HF checkpoint directory the reference reads: the one given, or the checkpoint the engine ran in
        place of a GGUF it could not run (replay.py: then this waits for the engine's run), or None."""
        return self.engine_reads() or self.given_checkpoint()

    def gguf_path(self) -> Path:
        """--gguf, or a Skip saying why a hypothesis that needs a GGUF cannot run."""
        if self.inputs.gguf is None:
            raise Skip(NO_GGUF if self.given_checkpoint() is not None else "no model file (--gguf)")
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
        """The config of the model the reference reads."""
        return self._config(self.checkpoint())

    def given_config(self):
        """The config of the model as given (what the engine is asked to run, before anything is replayed)."""
        return self._config(self.given_checkpoint())

    def _config(self, checkpoint: Path | None):
        from ..reference.config import from_gguf, from_hf

        if checkpoint is not None:
            return self.once(f"config-{checkpoint}", lambda: from_hf(checkpoint))
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
    def model(self, dtype: str = "float32", path: Path | None = None):
        """The reference model in `dtype` of what the reference reads (or of `path`: the file itself, for the
        file's own checks), its dequantized weights cached for every later use."""
        self.require_consistent()
        path = self.reference_path() if path is None else path

        def make():
            from ..reference import load

            device = self.inputs.device
            return load(path, dtype=getattr(torch, dtype), cache=True, device=device,
                        budget=self.device_budget, capture_to=None if device == "cpu" else "cpu")

        return self.once(f"model-{dtype}-{path}", make)

    def reference(self, dtype: str = "float32", emulate=None, tokens: list[int] | None = None, replay: bool = True):
        """(logits [T, V], captures, per-layer stats) of the reference run in `dtype`, optionally with
        an engine's arithmetic emulated (`emulate`: a reference/emulate.py EnginePrecision), of the prompt's
        tokens or of other `tokens` (the decode path's prompt + the engine's continuation). `replay`: the run
        takes the discrete choices (MoE experts, DSA keys) of the engine's run of the same tokens (replay.py);
        else the float32 reference's own (the model as specified, which the engine may legitimately leave at a
        near-tie), which the other dtypes and the emulated run then take too, so that a pair differs in
        arithmetic only (taking their own, a bfloat16 run's near-tie taken the other way made the noise 0.24
        where the arithmetic's is 0.0002). One run where nothing is replayed (a dense model, an engine that
        exposes no choices)."""
        ids = self.tokens() if tokens is None else list(tokens)
        other = ids != self.tokens()
        own = not replay and self.replays(ids)

        def make():
            extra = None if own and dtype == "float32" and emulate is None else self._choices(ids, own)
            self.progress(f"reference forward pass ({dtype}{', ' + emulate.name + ' arithmetic' if emulate else ''}"
                          f"{f', {len(ids)} tokens' if other else ''}{', its own choices' if own else ''})")
            model = self.model(dtype)
            with stage("reference"), self.pinned_threads():
                logits, caps = model.forward(ids, capture=set(REFERENCE_POINTS), emulate=emulate, extra=extra)
            return logits.cpu(), caps, [st.as_dict() for st in model.stats]

        key = f"reference-{dtype}-{emulate.name if emulate else None}-{self.reference_path()}"
        return self.once(key + (f"-on-{tuple(ids)}" if other else "") + ("-own-choices" if own else ""), make)

    def _choices(self, ids: list[int], own: bool) -> dict | None:
        """The discrete choices a run of `ids` other than the float32 reference's own takes: the engine's, replayed,
        or (`own`) the float32 reference's own run's."""
        if not own:
            return self.replayed_choices(None if ids == self.tokens() else ids)
        caps = self.reference("float32", tokens=ids, replay=False)[1]
        return replay_choices(self.config(), caps, len(ids), self.inputs.device)

    def replays(self, tokens: list[int] | None = None) -> bool:
        """Whether the reference's runs of `tokens` (default the prompt's) replay any choice of the engine's, so
        that `reference(..., replay=False)` is another run."""
        ids = self.tokens() if tokens is None else list(tokens)
        return self.replayed_choices(None if ids == self.tokens() else ids) is not None

    def choices_unseen(self, tokens: list[int] | None = None) -> bool:
        """Whether the model makes discrete choices (MoE experts, DSA keys) and the engine's run of `tokens` exposes
        none of some kind of them, so that every run takes its own near-ties there (layers.py `drawn_criteria`
        then counts the positions beyond their threshold)."""
        cfg = self.config()
        if self.inputs.engine is None or not replay.has_choices(cfg):
            return False
        ids = self.tokens() if tokens is None else list(tokens)
        got = self.replayed_choices(None if ids == self.tokens() else ids) or {}
        return replay.unseen(cfg, got)

    def budget(self) -> Budget:
        """Which reference run emulates the engine's arithmetic (the engine's answer, from its run)."""
        return self.engine().noise_budget(self.engine_run())

    def budget_reference(self):
        """The reference run with the engine's arithmetic: how far a healthy engine may be."""
        b = self.budget()
        return self.reference(b.dtype, emulate=b.emulate)

    def draw(self, i: int, summarize: Callable[[torch.Tensor, dict], Any], tokens: list[int] | None = None,
             replay: bool = True, key: str = "") -> Any:
        """Randomized draw `i` of the budget run (reference/draws.py: the engine's arithmetic rounded
        stochastically, standing for another machine's healthy engine) of the prompt's tokens or of other
        `tokens`, taking the discrete choices every reference run of them takes (`replay`: as `reference`), kept
        as `summarize(logits, captures)` (a draw's [T, V] logits are not held) and cached by `i`, the tokens,
        the choice set and `key` (which names the summary). The weights are the budget model's, dequantized
        before the first draw (a draw rounds the computation, not the weights). A float32 engine (budget
        float64) is drawn in float32 with float32 rounded stochastically; every other in the budget's dtype and
        emulation."""
        from ..reference.draws import draw_dtypes, randomized

        b = self.budget()
        float32 = b.dtype == "float64"
        dtype = "float32" if float32 else b.dtype
        ids = self.tokens() if tokens is None else list(tokens)
        other = ids != self.tokens()
        own = not replay and self.replays(ids)

        def make():
            self.budget_reference()
            self.reference("float32")
            extra = self._choices(ids, own)
            model = self.model(dtype)
            self.progress(f"randomized draw {i + 1} of the engine's arithmetic ({dtype}"
                          f"{', ' + b.emulate.name if b.emulate else ''}{f', {len(ids)} tokens' if other else ''}"
                          f"{', the reference choices' if own else ''})")
            seed = self.inputs.seed * 1000 + i
            with stage("reference"), self.pinned_threads(), randomized(seed, draw_dtypes(float32)):
                logits, caps = model.forward(ids, capture=set(REFERENCE_POINTS), emulate=b.emulate, extra=extra)
            return summarize(logits.cpu(), caps)

        return self.once(f"draw-{i}-{self.reference_path()}" + (f"-on-{tuple(ids)}" if other else "")
                         + ("-own-choices" if own else "") + key, make)

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
                                             device=i.device, engine_args=i.engine_args))
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
                    return engine.run(self.tokens(), self.given_config())
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
                    return engine.run(list(tokens), self.given_config())
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

    # ---- what the reference takes from the engine (replay.py) -----------------------------------
    def engine_reads(self) -> Path | None:
        """The HF checkpoint the engine ran in place of the GGUF, or None: read from the engine's run, which
        runs first where the engine may substitute one (replay.may_substitute); an engine that cannot run
        substituted nothing."""
        if not replay.may_substitute(self.inputs):
            return None
        try:
            return replay.reads(self.engine_run())
        except Skip:
            return None

    def replayed_choices(self, tokens: list[int] | None = None) -> dict | None:
        """The engine's discrete choices (DSA key selections, MoE experts) every reference run of these tokens
        replays (replay.py), from the engine's run of the prompt or of other `tokens` (`engine_run_on`); None
        where the model makes none, no engine ran or it could not run."""
        cfg = self.config()
        if self.inputs.engine is None or not replay.has_choices(cfg):
            return None
        try:
            caps = (self.engine_run() if tokens is None else self.engine_run_on(tokens)).captures
        except Skip:
            return None
        return replay.choices(cfg, caps, len(self.tokens() if tokens is None else tokens), self.inputs.device)
