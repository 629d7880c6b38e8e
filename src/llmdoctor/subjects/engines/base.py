"""The one engine interface: what every engine under test (llama.cpp, transformers, vLLM, an endpoint)
does for a diagnosis, in the order a user's request meets it.

How to add an engine: subclass `Engine` in a module of this folder, set `name`, `title`,
`distribution` and `traits`, implement `run` (and `tokenize` / `generate` / `describe` where the engine
offers them, and a capability below where it has one), and add one line to `REGISTRY` in `__init__.py`.
Nothing outside this folder names an engine: diagnose and the checks ask the registry for the class, the
class for its traits, and an instance whether it has a capability (`isinstance(engine, BackendSelecting)`).

    tokenize(text)          the token ids the deployment itself makes of `text` (its tokenizer, its
                            add-special rules)
    run(tokens, config)     teacher-forced: every position's full next-token distribution [T, V] and
                            the captures, already under the reference's point names and layout
                            (`config` is the reference's ModelConfig: what the layout follows)
    generate(tokens, n)     greedy decoding through the engine's own decode path: a Generation (the n
                            ids, each step's full next-token distribution [n, V], the decode steps'
                            captures where the engine exposes them and they are asked for)
    weights(layer)          one layer's weights as the engine holds them after its loader
    describe()              versions, device, dtype, backends: the engine's account of itself
    noise_budget(ran)       which reference run emulates this engine's arithmetic (its noise)
    close()                 release what it holds (its model, its child process); idempotent

Lifecycle: an engine loads its model once, lazily on first use, keeps it for every later run, generation and
weight read, and releases it in `close()` (a later call loads it again). An engine is a context manager:
`with create(name, deployment) as engine: ...`.

A method an engine cannot offer raises `NotOffered(reason)`; callers turn it into "skipped: reason".
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ...errors import EngineError as EngineError  # re-exported: the engines' errors, below every layer
from ...errors import EngineUnavailable as EngineUnavailable
from ...errors import NotOffered


@dataclass
class RunInfo:
    """The engine's account of one run or generation. The fields are what diagnose decides with; `details` is
    the rest the engine reports (versions, threads, cache type, step times, the model folder: engine-specific).
    `as_dict()` is the report's `engine_run` block: every key in the order the engine gave it (`of`), then
    the details and fields set later."""

    engine: str = ""
    dtype: str | None = None  # the precision it ran in (its noise budget follows it)
    arithmetic: dict[str, Any] | None = None  # what else decides its arithmetic (vLLM's driver: device,
    #                                           attention impls, linear methods, Triton's float32 dot)
    backends: dict[str, Any] | None = None  # the attention backends it built: {"decode": {layer: backend},
    #                                         "prefill": {...}, "fixed": {...}} (engines that select at run time)
    explained: dict[str, Any] | None = None  # its own backend selection under the config it ran with
    #                                          (as BackendSelecting.explain_backends answers)
    reference_reads: str | None = None  # the HF checkpoint it ran in place of a GGUF it could not run (the
    #                                     reference reads it too)
    details: dict[str, Any] = field(default_factory=dict)
    _order: tuple[str, ...] = field(default=(), repr=False, compare=False)

    @classmethod
    def of(cls, report: dict[str, Any]) -> RunInfo:
        """From an engine's report: the fields taken out by name, the rest kept as details, its order kept."""
        return cls(**{k: v for k, v in report.items() if k in _FIELDS},
                   details={k: v for k, v in report.items() if k not in _FIELDS}, _order=tuple(report))

    def as_dict(self) -> dict[str, Any]:
        named = {f: getattr(self, f) for f in _FIELDS}
        out: dict[str, Any] = {}
        for k in (*(self._order or _FIELDS), *self.details, *_FIELDS):
            if k in out or (k in named and named[k] is None and k not in self._order):
                continue
            out[k] = named[k] if k in named else self.details[k]
        return out


_FIELDS = tuple(f.name for f in fields(RunInfo) if f.name not in ("details", "_order"))  # the typed ones, in order


@dataclass
class EngineRun:
    """One teacher-forced forward pass: logits [T, V] (row p: the distribution of the token after
    position p; log-probabilities where the engine gives only those) and captures [T, ...] under the
    reference's point names, in the reference's layout."""

    logits: np.ndarray
    captures: dict[str, np.ndarray] = field(default_factory=dict)
    node_names: list[str] = field(default_factory=list)  # every node name the engine showed, in order
    info: RunInfo = field(default_factory=lambda: RunInfo())  # the engine's account of this run


@dataclass
class Generation:
    """Greedy decoding of n tokens after a prompt of P tokens, as the engine serves (its KV cache, its decode
    kernels). Step i (0-based) chose ids[i] from logits[i]: row 0 comes out of the prompt's prefill, rows
    1..n-1 out of the decode steps, which fed ids[i-1] at position P+i-1. Every step is taken: an end-of-
    sequence token does not stop it (the number of judged steps is fixed).

    logits: [n, V] (log-probabilities where the engine gives only those); None where the engine shows only
    the ids (an endpoint). captures: the decode steps' activations under the reference's point names,
    [n-1, ...] (row i-1: step i, position P+i-1); empty where the engine exposes none or none were asked."""

    ids: list[int]
    logits: np.ndarray | None
    captures: dict[str, np.ndarray] = field(default_factory=dict)
    info: RunInfo = field(default_factory=lambda: RunInfo())  # the engine's account (cache type, step times)


@dataclass(frozen=True)
class Deployment:
    """What the engine is asked to run: its model (a GGUF file or an HF checkpoint directory), in which
    precision and interpreter. Paths are absolute (resolved against the caller's directory)."""

    model: Path | None = None  # None: a query that needs no model (a backend selection for a bare shape)
    url: str | None = None  # an endpoint's base URL
    hf: Path | None = None  # an HF checkpoint beside a GGUF: what an engine may run when it cannot run the GGUF
    dtype: str | None = None  # float32 | float16 | bfloat16; None: the engine's default
    python: str | None = None  # the deployment's own interpreter (engines in their own environment)
    threads: int | None = None
    dequant_kernel: str | None = None  # the GGUF dequant kernel the deployment loads weights with
    tokenizer: Path | None = None  # the tokenizer folder the deployment loads (vLLM's --tokenizer); None: the engine's own
    device: str = "cpu"  # where an in-process engine runs: cpu or cuda[:N] (diagnose --device)
    engine_args: tuple[str, ...] | None = None  # the deployment's own engine command line (--engine-args:
    #                                             what follows `vllm serve`); None: the engine's defaults here

    @property
    def is_gguf(self) -> bool:
        # a GGUF is a file (a split set: its first shard), a checkpoint a folder
        return self.model is not None and not self.model.is_dir()


@dataclass(frozen=True)
class Budget:
    """The reference run that emulates an engine's arithmetic (`Session.reference(dtype, emulate)`) and
    the words the report uses for it."""

    dtype: str
    emulate: str | None
    words: str


@dataclass(frozen=True)
class Traits:
    formats: frozenset[str]  # "gguf", "hf": what model formats it loads
    dequant_kernel: str | None  # its built-in GGUF dequant kernel as `check dequant --kernel` names it
    captures: str  # what it exposes of its activations, in words
    noise: str  # how its noise budget is emulated, in words
    in_process: bool = True  # selectable with --engine (an endpoint is reached with --endpoint)
    selects_backends: bool = False  # chooses attention backends at run time (vLLM): the class is BackendSelecting
    #                                 (the trait answers before an instance exists: plan rows, check attention)
    quantized_indexer: bool = True  # loads a GGUF whose DSA indexer weights are quantized
    decode_captures: str | None = None  # what its generation exposes of the decode steps' activations, in words
    #                                     (None: nothing; the decode path then judges their distributions only)


class Engine:
    """Base of every engine adapter; see the module docstring for the contract."""

    name: ClassVar[str]  # as --engine and the registry name it
    title: ClassVar[str]  # as people write it ("vLLM")
    distribution: ClassVar[str]  # the Python distribution whose version identifies it (env block)
    traits: ClassVar[Traits]

    def __init__(self, deployment: Deployment):
        self.deployment = deployment

    @classmethod
    def parse_engine_args(cls, text: str, python: str | None) -> Any:
        """The deployment's own command line for this engine (--engine-args) as the engine's own parser reads
        it: an object with `argv`, and `model` and `tokenizer` (the paths it names; None: none). An engine
        that takes none refuses (InputError)."""
        from ...errors import InputError

        raise InputError(f"--engine-args: {cls.title} takes none (they are `vllm serve` arguments: --engine vllm)")

    def cannot_run(self) -> str | None:
        """Why this engine cannot run the deployment's model at all (None: it may try)."""
        if self.deployment.model is None:
            return f"{self.name}: no model given"
        fmt = "gguf" if self.deployment.is_gguf else "hf"
        if fmt not in self.traits.formats:
            what = {"gguf": "GGUF files", "hf": "HF checkpoints"}
            return f"{self.name} runs {' and '.join(what[f] for f in sorted(self.traits.formats))} only: " \
                   f"{self.deployment.model} is {'a GGUF file' if fmt == 'gguf' else 'not a GGUF file'}"
        return None

    def run(self, tokens: list[int], config: Any) -> EngineRun:
        raise NotImplementedError

    def tokenize(self, text: str) -> list[int]:
        raise NotOffered(f"{self.name}: tokenizing text as the deployment does is not offered yet")

    def chat_tokenize(self, messages: list[dict[str, str]]) -> tuple[str | None, list[int]]:
        """(the prompt text the deployment's chat template renders, or None where only ids are shown; the
        token ids its chat route runs) for `messages`, with the generation prompt added."""
        raise NotOffered(f"{self.name}: rendering a chat as the deployment does is not offered yet")

    def tokenize_all(self, texts: list[str], conversations: list[list[dict[str, str]]]
                     ) -> tuple[list[list[int]], list[tuple[str | None, list[int]] | NotOffered]]:
        """`tokenize` of every text and `chat_tokenize` of every conversation (a NotOffered in its place where
        the chat is not offered), in one call: an engine in a child process loads its tokenizer once."""
        chats: list[tuple[str | None, list[int]] | NotOffered] = []
        for conv in conversations:
            try:
                chats.append(self.chat_tokenize(conv))
            except NotOffered as e:
                chats.append(e)
        return [self.tokenize(t) for t in texts], chats

    def front_end(self) -> dict[str, Any]:
        """Which tokenizer and chat template the deployment uses and its add-special rule, for the report."""
        return {"tokenizer": None if self.deployment.tokenizer is None else os.fspath(self.deployment.tokenizer)}

    def generate(self, tokens: list[int], n: int, *, captures: bool = False) -> Generation:
        """Greedy decoding of n tokens after `tokens` (see Generation). `captures`: the decode steps'
        activations too (asked only to localize a fault: capturing slows an engine's every step)."""
        raise NotOffered(f"{self.name}: greedy generation through the decode path is not offered yet")

    def describe(self) -> dict[str, Any]:
        """Versions, device, dtype: what the engine is, before it runs (run's info adds what it built)."""
        model = self.deployment.model
        return {"engine": self.name, "model": None if model is None else os.fspath(model), "dtype": self.deployment.dtype}

    def noise_budget(self, ran: EngineRun) -> Budget:
        """Default: an engine whose float32 kernels sum in other orders than the reference's torch ops
        differs from the float32 reference by another draw of float32 rounding, whose size is the float32
        reference's own distance from float64 arithmetic; in another dtype, the reference in that dtype."""
        dtype = torch_dtype_name(str(ran.info.dtype or self.deployment.dtype or "float32"))
        if dtype == "float32":
            return Budget("float64", None, "float32 precision")
        return Budget(dtype, None, f"{dtype} precision")

    def weights(self, layer: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """The weights of one layer as the engine holds them after its loader, under its own (HF checkpoint)
        names and layout, and the config.json they follow: ({name: array}, config)."""
        raise NotOffered(f"{self.name} does not expose the weights it loaded")

    # ---- the lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        """Release what the engine holds (its model, its child process, its files); idempotent. Default:
        nothing held."""

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- capabilities only some engines have: a caller asks `isinstance(engine, Capability)` ---------------------
class BackendSelecting:
    """An engine that chooses its attention backends at run time (vLLM) answers for its own selection."""

    def explain_backends(self) -> dict[str, Any]:
        """The engine's own attention-backend selection for this model: {"kind", "selected", "knobs", "env",
        versions, "platform"}."""
        raise NotImplementedError

    def select_backend(self, head_size: int, dtype: str, *, use_mla: bool, use_sparse: bool) -> dict[str, Any]:
        """The engine's own attention-backend selection for a bare attention shape (no model)."""
        raise NotImplementedError


class PieceRendering:
    """An engine that renders single tokens of a GGUF's vocab (llama.cpp: the tokenizer audit's decode parity)."""

    def piece_reader(self):
        """`reader(token_id, special) -> bytes` with `close()` (a context manager)."""
        raise NotImplementedError


class Reconfigurable:
    """An engine run as the deployment's own command line configures it (vLLM's --engine-args, issue 34): it
    serves a request after others in the same engine (so that what they left in its prefix cache is read) and
    starts again with one option of that configuration put back (the configured ladder's rungs)."""

    def configured(self) -> dict[str, Any] | None:
        """The deployment's configuration as the engine resolved it (`RunInfo.engine_config`'s "resolved"
        summary) once a run has shown it, else None (no command line of the deployment's own)."""
        raise NotImplementedError

    def generate_after(self, earlier: list[list[int]], tokens: list[int], n: int) -> Generation:
        """`generate(tokens, n)` after the same engine served each of `earlier` (one token each); the info's
        `cached_tokens` says how many prompt tokens it read from the prefix cache."""
        raise NotImplementedError

    def reverted(self, option: str) -> Engine:
        """The same deployment with `option` put back to what it is without it (a sibling engine: closing it
        leaves this one's resources alone)."""
        raise NotImplementedError


class GGUFNameMapping:
    """An engine that loads a GGUF through a name map of its own (vLLM's GGUF plugin) shows it."""

    def gguf_name_map(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        """The engine's own GGUF->HF tensor name map for `hf_config`: {"map": {GGUF name: HF name}, ...}."""
        raise NotImplementedError


def torch_dtype_name(name: str) -> str:
    """A dtype as torch names it; an InputError for anything but float32/16, bfloat16, float64."""
    from ...errors import InputError

    aliases = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "float": "float32"}
    name = aliases.get(name.lower(), name.lower())
    if name not in ("float32", "float16", "bfloat16", "float64"):
        raise InputError(f"--engine-dtype {name!r}: expected float32, float16 or bfloat16")
    return name


def resolve(path: str | os.PathLike | None) -> Path | None:
    """A path option as the caller meant it: relative to the caller's directory, made absolute (an engine
    in a child process runs elsewhere; a relative `--hf` was read there as a hub repo id)."""
    return None if path is None else Path(os.path.abspath(os.path.expanduser(os.fspath(path))))
