"""What a diagnosis is asked to examine, and the policy that turns command-line options into it, in one
place: what `--gguf`, `--hf`, `--prompt`, `--token-ids` and the engine default mean."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..errors import InputError
from ..subjects.engines.base import resolve

# A fixed, varied English prompt (counting included: the seed's first symptom).
DEFAULT_PROMPT = (
    "The quick brown fox jumps over the lazy dog. Counting: 1 2 3 4 5 6 7 8 9 10 11 12. "
    "Paris is the capital of France, and Berlin is the capital of"
)


@dataclass
class Inputs:
    gguf: Path | None = None
    hf: Path | None = None
    endpoint: str | None = None
    engine: str | None = None
    engine_gguf: Path | None = None  # the file the engine loads when it differs from --gguf (demo faults)
    engine_hf: Path | None = None  # the checkpoint the engine loads when it differs from --hf (planted faults)
    tokenizer: Path | None = None  # the tokenizer folder the deployment loads (--tokenizer); None: the engine's own
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
    generate: int = 16  # new tokens each engine generates greedily for the decode path (--generate; 0: not examined)
    # a planted engine fault (faults/decode.py; tests and --demo-fault only): applied to the engine instance
    engine_plant: Callable[[Any], Any] | None = None
    device: str = "cpu"  # where the reference and an in-process engine run: cpu or cuda[:N] (--device)
    max_gpu_memory: int | None = None  # bytes the reference's weights may hold on that device (--max-gpu-memory)
    engine_args: tuple[str, ...] | None = None  # the deployment's own engine command line (--engine-args), as split

    @classmethod
    def from_options(cls, *, gguf: Path | None, hf: Path | None, endpoint: str | None, engine: str | None,
                     prompt: str | None, token_ids: str | None, default_gguf: Callable[[], Path],
                     device: str = "cpu", max_gpu_memory: str | int | None = None, **rest) -> "Inputs":
        """The command line's options as a diagnosis. Paths are taken relative to the caller's directory
        and made absolute (an engine in a child process runs elsewhere). The rules:
        - `--prompt` or `--token-ids`, not both; neither: the built-in prompt.
        - the reference reads `--gguf`; without it an HF checkpoint given with `--hf` (config.json and
          safetensors); with neither, the demo model (`default_gguf()`).
        - the engine: `--engine`; none named and nothing else to examine: the demo deployment, the GGUF in
          llama.cpp; a checkpoint alone: transformers, the in-process engine that runs safetensors.
        - `--tokenizer DIR`: the tokenizer folder the deployment loads, for every engine (vLLM's option of that
          name; transformers' AutoTokenizer; llama-cpp-python's hf_pretrained_model_name_or_path). The
          reference's tokenizer stays the model file's.
        - `--engine-args "ARGS"` (with --engine): the deployment's own engine command line, what follows `vllm
          serve`, read by the engine's own parser; the model and tokenizer it names count as given
          (`_take_engine_args`).
        - `--device cpu|cuda[:N]`: where the reference's forward passes and an in-process engine run; CUDA
          asked for where there is none is bad input. `--max-gpu-memory 8GB`: the most the reference's
          dequantized weights hold on that device at once (reference/device_cache.py; on the CPU it bounds
          the same counts, which is how CI tests it).
        """
        from ..reference.checkpoint import is_checkpoint
        from ..reference.device_cache import parse_bytes
        from ..reference.hf_tokenizer import parse_token_ids
        from ..subjects.engines import DEFAULT_FOR_CHECKPOINT, DEFAULT_FOR_GGUF, engine_class

        gguf, hf = resolve(gguf), resolve(hf)
        if gguf is not None and not gguf.is_file():
            raise InputError(f"{gguf}: no such file")
        if engine is not None:
            engine_class(engine)  # an unknown name is bad input, before any work
        if rest.get("engine_args") is not None:
            gguf, hf = _take_engine_args(engine, gguf, hf, rest)
        if prompt and token_ids is not None:
            raise InputError("--prompt and --token-ids: give one")
        if gguf is None and hf is not None and hf.is_dir() and not is_checkpoint(hf):
            raise InputError(f"{hf}: no config.json with *.safetensors: without --gguf, the reference runs from an "
                             "HF checkpoint's safetensors")
        inputs = cls(gguf=gguf, hf=hf, endpoint=endpoint, engine=engine, device=_device(device),
                     max_gpu_memory=None if max_gpu_memory is None else parse_bytes(str(max_gpu_memory)), **rest)
        for name in ("manifest", "engine_gguf", "engine_hf", "tokenizer"):
            setattr(inputs, name, resolve(getattr(inputs, name)))
        if prompt:
            inputs.prompt = prompt
        if token_ids is not None:
            inputs.token_ids = parse_token_ids(token_ids)
        if inputs.gguf is None and not (hf is not None and is_checkpoint(hf)):
            inputs.gguf = default_gguf()
        if inputs.max_gpu_memory is not None and inputs.gguf is not None:
            _check_cap(inputs.gguf, inputs.max_gpu_memory)
        examined = (engine, endpoint, inputs.dequant_kernel, inputs.attention_impl)
        if not any((*examined, hf)):
            inputs.engine = DEFAULT_FOR_GGUF  # the demo deployment: the file in the built-in engine
        elif not any((*examined, gguf)):
            inputs.engine = DEFAULT_FOR_CHECKPOINT  # a checkpoint alone: the engine that runs safetensors
        return inputs


def _take_engine_args(engine: str | None, gguf: Path | None, hf: Path | None, rest: dict) -> tuple[Path | None, Path | None]:
    """--engine-args: the deployment's own engine command line, read by the engine's own parser (vLLM's serve
    parser in the deployment's interpreter; its refusal is bad input). The model it names is what the engine
    loads: the reference's too when neither --gguf nor --hf names one, else the engine's own copy where it
    differs (engine_gguf / engine_hf, as a planted copy is given). The tokenizer it names is the deployment's
    (--tokenizer). Returns (gguf, hf); `rest` gets the split arguments, the tokenizer and the engine's copy."""
    from ..subjects.engines import engine_class

    if engine is None:
        raise InputError("--engine-args: name the engine they are for (--engine vllm)")
    got = engine_class(engine).parse_engine_args(rest["engine_args"], rest.get("engine_python"))
    rest["engine_args"] = got.argv
    if got.tokenizer is not None:
        given = resolve(rest.get("tokenizer"))
        if given is not None and given != got.tokenizer:
            raise InputError(f"--tokenizer {given} and the --tokenizer of --engine-args, {got.tokenizer}: give one")
        rest["tokenizer"] = got.tokenizer
    model = got.model
    if model is None:
        return gguf, hf
    if model.is_file():  # a GGUF
        if gguf is not None and gguf.resolve() != model.resolve():
            rest["engine_gguf"] = model
        return gguf or model, hf
    if gguf is not None:
        raise InputError(f"--engine-args names the checkpoint {model}, --gguf the file {gguf}: the engine would load "
                         "the file; give the checkpoint with --hf alone")
    if hf is not None and hf.resolve() != model.resolve():
        rest["engine_hf"] = model
    return gguf, hf or model


def _device(device: str) -> str:
    """--device as given, checked: cpu, or cuda[:N] where CUDA is available."""
    import torch

    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
        raise InputError(f"--device {device!r}: expected cpu or cuda[:N]")
    if kind == "cuda" and not torch.cuda.is_available():
        raise InputError(f"--device {device}: CUDA is not available here")
    if index and int(index) >= torch.cuda.device_count():
        raise InputError(f"--device {device}: only {torch.cuda.device_count()} CUDA devices here")
    return device


def _check_cap(path: Path, cap: int) -> None:
    """An InputError before any work when --max-gpu-memory cannot hold one layer of the float32 reference (a
    later run in float64 checks its own minimum when its model is built)."""
    from ..errors import GGUFError
    from ..gguf import open_gguf
    from ..reference.device_cache import DeviceBudget, minimum_bytes

    try:
        g = open_gguf(path)
    except GGUFError:
        return  # a broken file is the diagnosis's first finding, not bad input
    with g:
        DeviceBudget(cap).require(minimum_bytes(g, 4), f"{path.name} in float32")
