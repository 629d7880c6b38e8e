"""The `llmdoctor` command line (typer). Conventions: ../shared/DESIGN.md and README.md.

Every command: a model-file subject defaults to the demo model; `--json` prints exactly one JSON
object (the common envelope) on stdout; exit 0 passed, 1 a fault found, 2 could not run / bad input;
errors are one line on stderr (tracebacks only with --debug).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from .errors import InputError, LLMDoctorError
from .report import terminal
from .report.envelope import check_writable, dumps, envelope, write_atomic
from .report.verdicts import verdict_word

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="llmdoctor: find out why an LLM deployment produces garbage.",
    pretty_exceptions_enable=False,
)
check_app = typer.Typer(no_args_is_help=True, help="Run one check against its reference.")
app.add_typer(check_app, name="check")

_state = {"debug": False}


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="Show tracebacks on errors.")) -> None:
    _state["debug"] = debug


def model_file(path: Optional[Path]) -> Path:
    """The command's model file: the given path or the demo model."""
    if path is not None:
        return path
    from .demo import model_path

    return model_path()


def json_path_option() -> Any:
    """The `--json-out PATH` option every command with `--json` takes (parameter name `json_path`)."""
    return typer.Option(None, "--json-out", help="Write the JSON object of --json to PATH (atomically).")


def sarif_option() -> Any:
    """The `--sarif PATH` option (parameter name `sarif_path`): the findings as SARIF 2.1.0 (report/sarif.py)."""
    return typer.Option(None, "--sarif", help="Write the findings as SARIF 2.1.0 to PATH (atomically).")


def emit(doc: dict, json_out: bool, json_path: Optional[Path], sarif_path: Optional[Path] = None) -> None:
    """The envelope to --json-out PATH (temp file + rename), as SARIF to --sarif PATH, and, with --json,
    to stdout."""
    if json_path is not None:
        write_atomic(json_path, dumps(doc))
    if sarif_path is not None:
        from .report import sarif

        sarif.write(sarif_path, doc)
    if json_out:
        print(dumps(doc))


def guarded(command: str) -> Callable:
    """Turn LLMDoctorError into one line on stderr (and an envelope with --json / --json-out) and exit
    code 2. A --json-out folder that cannot be written is found before the work."""

    def deco(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                check_writable(kwargs.get("json_path"))
                check_writable(kwargs.get("sarif_path"))
                return fn(*args, **kwargs)
            except LLMDoctorError as e:
                if _state["debug"]:
                    raise
                terminal.error_line(str(e))
                path = kwargs.get("json_path")
                if kwargs.get("json_out") or path:
                    env = envelope(command, argv=sys.argv[1:], verdict="error", exit_code=2, error=str(e))
                    try:
                        emit(env, bool(kwargs.get("json_out")), path)
                    except LLMDoctorError:
                        pass  # the report's own path is what failed: already said
                raise typer.Exit(2) from None

        return wrapper

    return deco


@app.command()
@guarded("inspect")
def inspect(
    file: Optional[Path] = typer.Argument(None, help="GGUF file (default: the demo model)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    json_path: Optional[Path] = json_path_option(),
    tensors: bool = typer.Option(False, "--tensors", help="Include the tensor table."),
) -> None:
    """Architecture, hyperparameters, tokenizer and tensor statistics of a GGUF file."""
    from .gguf import open_gguf
    from .gguf.summary import summarize

    path = model_file(file)
    with open_gguf(path) as g:
        summary = summarize(g, tensors=tensors)
    if json_out or json_path:
        emit(envelope("inspect", argv=sys.argv[1:], verdict="parsed", exit_code=0, file=path, result=summary),
             json_out, json_path)
    if not json_out:
        terminal.render_inspect(summary)



@check_app.command("dequant")
@guarded("check.dequant")
def check_dequant(
    file: Optional[Path] = typer.Argument(None, help="GGUF file (default: the demo model)."),
    kernel: str = typer.Option("torch", "--kernel", help="reference | torch | native | ggml | vllm | module:function."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda: where the kernel's input lives."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float32 | float16 | bfloat16, passed as dtype=."),
    only: Optional[str] = typer.Option(None, "--only", help="Check only tensors whose name matches this glob."),
    blocks: Optional[int] = typer.Option(None, "--blocks", help="Blocks compared per tensor (default 256)."),
    all_blocks: bool = typer.Option(False, "--all", help="Compare every block."),
    seed: int = typer.Option(0, "--seed", help="Seed of the block sample."),
    timeout: float = typer.Option(120.0, "--timeout", help="Seconds one kernel call may take."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    json_path: Optional[Path] = json_path_option(),
    sarif_path: Optional[Path] = sarif_option(),
) -> None:
    """Does a dequant kernel give the reference's numbers? Names the layout bug when not."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .checks.kernels import dequant
    from .checks.base import exit_code
    from .subjects.kernels import IsolatedKernel

    if blocks is not None and all_blocks:
        raise InputError("--blocks and --all exclude each other")
    path = model_file(file)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=terminal.stderr, transient=True) as bar:
        task = bar.add_task(f"dequant {kernel}", total=None)

        def on_tensor(i: int, n: int, name: str) -> None:
            bar.update(task, completed=i, total=n, description=f"dequant {kernel}: {name}")

        res = dequant.run(path, IsolatedKernel, kernel=kernel, device=device, dtype=dtype, only=only,
                          blocks=dequant.DEFAULT_BLOCKS if blocks is None else blocks, all_blocks=all_blocks, seed=seed,
                          timeout=timeout, on_tensor=on_tensor)
    code = exit_code(res.findings, required_ran=res.loaded)
    verdict = verdict_word("check.dequant", code)
    by_type = dequant.summary(res)
    if json_out or json_path or sarif_path:
        emit(envelope("check.dequant", argv=sys.argv[1:], verdict=verdict, exit_code=code,
                      findings=res.findings, file=path, seed=seed,
                      kernel={"spec": kernel, "device": device, "dtype": dtype, "restarts": res.restarts},
                      by_type=by_type, seconds=res.seconds), json_out, json_path, sarif_path)
    if not json_out:
        terminal.render_dequant(kernel, by_type, res.findings, verdict)
    raise typer.Exit(code)


@check_app.command("mapping")
@guarded("check.mapping")
def check_mapping(
    file: Optional[Path] = typer.Argument(None, help="GGUF file (default: the demo model)."),
    hf: Optional[Path] = typer.Option(None, "--hf", help="HF checkpoint directory (config.json + safetensors: "
                                      "adds the numeric check) or a config.json alone."),
    arch: Optional[str] = typer.Option(None, "--arch", help="GGUF architecture of the name map (default: the file's)."),
    engine: Optional[str] = typer.Option(None, "--engine", help="vllm: also diff vLLM's own GGUF name map."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    json_path: Optional[Path] = json_path_option(),
    sarif_path: Optional[Path] = sarif_option(),
) -> None:
    """Do the GGUF and the HF model describe the same network? Names, shapes, types, metadata, numbers."""
    from .checks.layout import mapping
    from .checks.base import exit_code

    path = model_file(file)
    subject = None
    if engine is not None:  # its own name map is diffed: an engine that has one (GGUFNameMapping)
        from .subjects.engines import create
        from .subjects.engines.base import Deployment, GGUFNameMapping

        subject = create(engine, Deployment(model=Path(path)))
        if not isinstance(subject, GGUFNameMapping):
            raise InputError(f"--engine {engine!r}: {subject.name} exposes no GGUF name map of its own")
    res = mapping.run(path, hf, arch=arch, engine=subject, quantized_indexer=subject is not None
                      and subject.traits.quantized_indexer)
    # an engine named with --engine that could not run means its map was not compared: exit 2
    engine_ran = engine is None or any(f.subject == engine and f.status != "skip" for f in res.findings)
    code = exit_code(res.findings, required_ran=engine_ran)
    verdict = verdict_word("check.mapping", code)
    if json_out or json_path or sarif_path:
        emit(envelope("check.mapping", argv=sys.argv[1:], verdict=verdict, exit_code=code,
                      findings=res.findings, file=path, arch=res.arch, hf_source=res.hf_source,
                      seconds=res.seconds), json_out, json_path, sarif_path)
    if json_out:
        raise typer.Exit(code)
    terminal.stdout.print(f"{path.name} ({res.arch}) vs {res.hf_source}")
    terminal.findings_table([f for f in res.findings if f.status != "pass" or not f.target.startswith("numeric/")])
    terminal.summary_line(verdict, res.findings, seconds=res.seconds)
    raise typer.Exit(code)

@app.command()
@guarded("probe")
def probe(
    url: str = typer.Argument(..., help="Base URL of an OpenAI-compatible server (with or without /v1)."),
    model: Optional[str] = typer.Option(None, "--model", help="Model name to request (default: the first listed)."),
    gguf: Optional[Path] = typer.Option(None, "--gguf", help="The GGUF the server claims to serve: compare "
                                        "against the reference forward pass and the file's tokenizer."),
    api_key_env: Optional[str] = typer.Option(None, "--api-key-env", help="Environment variable holding the API key."),
    concurrency: int = typer.Option(4, "--concurrency", min=2, help="Requests in flight for the batch probe."),
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds one request may take."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random string of the copy probe."),
    echo: bool = typer.Option(False, "--echo", help="Also ask for the prompt's own log-probs (echo): "
                              "prefill vs decode and per-position reference KL (slow on llama-cpp-python)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    json_path: Optional[Path] = json_path_option(),
) -> None:
    """Black-box checks of a live OpenAI-compatible endpoint: healthy, degraded, garbage or inconclusive."""
    from .checks.endpoint.probes import DEFAULT_STEPS
    from .checks.endpoint.probes import probe as run_probe
    from .subjects.endpoint import Endpoint
    from .subjects.engines.endpoint import EndpointEngine

    import httpx

    if gguf is not None:
        from .gguf import open_gguf

        open_gguf(gguf).close()  # a broken --gguf is bad input, found before any request
    if timeout <= 0:
        raise InputError(f"--timeout {timeout:g}: must be > 0")
    try:
        scheme = httpx.URL(url).scheme
    except (httpx.InvalidURL, ValueError) as e:
        raise InputError(f"{url}: not a URL ({e})") from None
    if scheme not in ("http", "https"):
        raise InputError(f"{url}: expected an http:// or https:// URL")
    with Endpoint(url, model=model, api_key_env=api_key_env, timeout=timeout) as ep:
        rep = run_probe(ep, EndpointEngine.over(ep), gguf=gguf, concurrency=concurrency, seed=seed,
                        progress=lambda msg: terminal.stderr.print(msg),
                        steps=[*DEFAULT_STEPS, "echo"] if echo else None)
    if json_out or json_path:
        emit(envelope("probe", argv=sys.argv[1:], verdict=rep.verdict, exit_code=rep.exit_code,
                      findings=rep.findings, file=gguf, seed=seed, result=rep.to_dict()), json_out, json_path)
    if not json_out:
        terminal.render_probe(rep)
    raise typer.Exit(rep.exit_code)


@app.command()
@guarded("diagnose")
def diagnose(
    gguf: Optional[Path] = typer.Option(None, "--gguf", help="The model file (default: the demo model)."),
    hf: Optional[Path] = typer.Option(None, "--hf", help="An HF checkpoint directory or config.json."),
    endpoint: Optional[str] = typer.Option(None, "--endpoint", help="A live OpenAI-compatible endpoint URL."),
    engine: Optional[str] = typer.Option(None, "--engine", help="In-process engine: llama.cpp, transformers, vllm."),
    engine_dtype: Optional[str] = typer.Option(None, "--engine-dtype", help="The deployment's precision."),
    engine_python: Optional[str] = typer.Option(None, "--engine-python", help="The deployment's interpreter for "
                                                "--engine vllm (default: the python on PATH if it imports vllm)."),
    dequant_kernel: Optional[str] = typer.Option(None, "--dequant-kernel", help="Kernel spec to check."),
    attention_impl: Optional[str] = typer.Option(None, "--attention-impl", help="Attention kernel spec."),
    attention_contract: Optional[str] = typer.Option(None, "--attention-contract", help="Its contract."),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="The text run through engine and reference."),
    token_ids: Optional[str] = typer.Option(None, "--token-ids", help="The prompt as token ids, e.g. 1,2,3 "
                                            "(for a checkpoint without a tokenizer)."),
    demo_fault: Optional[str] = typer.Option(None, "--demo-fault", help="Diagnose a deliberately broken demo "
                                             "deployment; 'list' lists them."),
    threads: Optional[int] = typer.Option(None, "--threads", help="CPU threads for the engines."),
    manifest: Optional[Path] = typer.Option(None, "--manifest", help="A manifest of a known-good copy "
                                            "(llmdoctor manifest): every tensor and key that differs is named."),
    generate: int = typer.Option(16, "--generate", help="New tokens each engine generates greedily for the decode "
                                 "path (judged against the reference; 0: not examined)."),
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", help="The tokenizer folder the deployment loads "
                                             "(vLLM's --tokenizer; default: the engine's own)."),
    engine_args: Optional[str] = typer.Option(None, "--engine-args", help="The deployment's own engine command line, "
                                              "e.g. \"MODEL --kv-cache-dtype fp8 --enable-prefix-caching\" (what "
                                              "follows `vllm serve`), parsed by vLLM's own parser."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda[:N]: where the reference and an in-process "
                               "engine run."),
    max_gpu_memory: Optional[str] = typer.Option(None, "--max-gpu-memory", help="The most the reference's "
                                                 "dequantized weights hold on --device at once, e.g. 8GB (layers "
                                                 "streamed, the rest not cached; captures kept on the CPU)."),
    seed: int = typer.Option(0, "--seed"),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    json_path: Optional[Path] = json_path_option(),
    sarif_path: Optional[Path] = sarif_option(),
    html_path: Optional[Path] = typer.Option(None, "--html", help="Write a self-contained HTML report to PATH."),
) -> None:
    """Find the first broken layer of a deployment. No arguments: the demo model in llama.cpp."""
    import tempfile

    from . import diagnose as dg
    from .faults import demo as demo_faults
    from .report import diagnosis as diag_report
    from .report import html as html_report
    from .subjects.kernels import validate_spec

    check_writable(html_path)
    if dequant_kernel:
        try:
            validate_spec(dequant_kernel)
        except LLMDoctorError as e:
            raise InputError(str(e).replace("--kernel", "--dequant-kernel", 1)) from None
    if demo_fault == "list":
        for f in demo_faults.all_demo_faults():
            print(f"{f.name}\t{f.description}")
        return
    if manifest is not None:
        from .checks.file.manifest import load

        load(manifest)  # a bad manifest is bad input, found before the diagnosis
    if generate < 0:
        raise InputError("--generate: a number of new tokens, 0 or more")
    inputs = dg.Inputs.from_options(gguf=gguf, hf=hf, endpoint=endpoint, engine=engine, prompt=prompt,
                                    token_ids=token_ids, default_gguf=lambda: model_file(None),
                                    engine_dtype=engine_dtype, engine_python=engine_python,
                                    dequant_kernel=dequant_kernel, attention_impl=attention_impl,
                                    attention_contract=attention_contract, seed=seed, threads=threads, manifest=manifest,
                                    tokenizer=tokenizer, generate=generate, device=device, max_gpu_memory=max_gpu_memory,
                                    engine_args=engine_args)
    with tempfile.TemporaryDirectory(prefix="llmdoctor-demo-") as tmp:
        if demo_fault:
            demo_faults.apply(demo_fault, inputs, Path(tmp))
        with _step_progress("diagnosing") as step:
            result = dg.run(inputs, progress=step)
    doc = envelope("diagnose", argv=sys.argv[1:], verdict=result.verdict, exit_code=result.exit_code,
                   findings=result.findings, file=inputs.gguf, seed=seed, **result.to_dict())
    terminal.stderr.print("stages: " + ", ".join(f"{k} {v:.2f} s" for k, v in sorted(
        result.stages.items(), key=lambda kv: -kv[1])))
    emit(doc, json_out, json_path, sarif_path)
    if html_path:
        write_atomic(html_path, html_report.render(doc))
    if not json_out:
        diag_report.render(doc, terminal.stdout)
    raise typer.Exit(result.exit_code)


_DTYPES = {"float64": "float64", "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


@app.command()
@guarded("logits")
def logits(
    prompt: Optional[str] = typer.Argument(None, help="The prompt text (or --token-ids)."),
    gguf: Optional[Path] = typer.Option(None, "--gguf", help="GGUF file (default: the demo model)."),
    hf: Optional[Path] = typer.Option(None, "--hf", help="HF checkpoint directory (config.json + safetensors) "
                                      "instead of a GGUF."),
    token_ids: Optional[str] = typer.Option(None, "--token-ids", help="The prompt as token ids, e.g. 1,2,3 "
                                            "(for a model without a tokenizer)."),
    top: int = typer.Option(5, "--top", min=1, help="How many most likely tokens to show per position."),
    greedy: int = typer.Option(0, "--greedy", min=0, help="Continue greedily for N tokens."),
    prompt_logprobs: bool = typer.Option(False, "--prompt-logprobs", help="Logprob and rank of each prompt token."),
    dtype: str = typer.Option("float32", "--dtype", help="float64 | float32 | bfloat16 | float16."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    json_path: Optional[Path] = json_path_option(),
) -> None:
    """Top-K next-token logprobs of a prompt from the reference forward pass (and greedy steps)."""
    import torch

    from .reference import load
    from .reference.checkpoint import is_checkpoint
    from .reference.hf_tokenizer import checkpoint_tokenizer, parse_token_ids
    from .reference.logits import render_text, report
    from .reference.tokenizer import Tokenizer

    if dtype not in _DTYPES:
        raise InputError(f"--dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    if device != "cpu" and not device.split(":")[0] == "cuda":
        raise InputError(f"--device {device!r}: expected cpu or cuda[:N]")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"--device {device}: CUDA is not available")
    if (prompt is None) == (token_ids is None):
        raise InputError("give the prompt as PROMPT or as --token-ids (one of them)")
    if hf is not None and gguf is not None:
        raise InputError("--gguf and --hf: give one model")
    if hf is not None and not is_checkpoint(hf):
        raise InputError(f"{hf}: not an HF checkpoint directory (config.json and *.safetensors)")
    ids = parse_token_ids(token_ids) if token_ids is not None else None
    path = hf if hf is not None else model_file(gguf)
    with load(path, dtype=getattr(torch, _DTYPES[dtype]), device=device, cache=greedy > 0) as model:
        tok = checkpoint_tokenizer(path) if hf is not None else Tokenizer.from_gguf(model.g)
        result = report(model, tok, prompt, top=top, greedy=greedy, prompt_logprobs=prompt_logprobs, ids=ids)
    source = None if hf is not None else path  # provenance hashes one file: a checkpoint directory has none
    result.update(dtype=dtype, device=device)
    if json_out or json_path:
        emit(envelope("logits", argv=sys.argv[1:], verdict="computed", exit_code=0, file=source, result=result),
             json_out, json_path)
    if not json_out:
        print(render_text(result))


@check_app.command("attention")
@guarded("check.attention")
def check_attention(
    preset: Optional[str] = typer.Option(None, "--preset", help="glm-5 | deepseek-v3 | gemma3-270m | llama-3-8b "
                                         "(default glm-5)."),
    config: Optional[Path] = typer.Option(None, "--config", help="HF config.json giving the attention shape."),
    gguf_file: Optional[Path] = typer.Option(None, "--gguf", help="GGUF file giving the attention shape."),
    impl: Optional[str] = typer.Option(None, "--impl", help="module:function (or file.py:function) kernel to test."),
    contract: Optional[str] = typer.Option(None, "--contract", help="--impl's contract: prefill | mla-decode | "
                                           "mla-sparse-decode | mla-sparse-prefill."),
    subjects: Optional[str] = typer.Option(None, "--subjects", help="all | comma list of built-ins (default: all, "
                                           "or none with --impl)."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Comma list of float32, bfloat16, float16 (default all)."),
    only_cases: Optional[str] = typer.Option(None, "--cases", help="Comma list of case names (default all)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the case inputs."),
    timeout: float = typer.Option(300.0, "--timeout", help="Seconds one kernel call may take."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    json_path: Optional[Path] = json_path_option(),
    sarif_path: Optional[Path] = sarif_option(),
) -> None:
    """Attention kernels (prefill, MLA decode, sparse MLA) against the float64 reference, case by case."""
    from .checks.kernels import attention as ca
    from .checks.kernels.attention_budgets import K_FLOOR
    from .checks.kernels.attention_shapes import load_shape
    from .checks.kernels.attention_suite import cases
    from .checks.base import exit_code
    from .subjects import attention as subj

    shape = load_shape(preset, config, gguf_file)
    if impl is not None and contract not in subj.CONTRACTS:
        raise InputError(f"--impl needs --contract, one of {', '.join(subj.CONTRACTS)}")
    if impl is None and contract is not None:
        raise InputError("--contract applies to --impl only")
    if timeout <= 0:
        raise InputError(f"--timeout {timeout:g}: must be > 0")
    picked = [(impl, contract)] if impl else []
    if subjects is not None or impl is None:
        picked += subj.builtin_subjects(subjects or "all", {c.contract for c in cases(shape)})
    if not picked:
        raise InputError(f"--subjects {subjects!r}: names no subject")
    if impl and not any(c.contract == contract for c in cases(shape)):
        raise InputError(f"--contract {contract}: the {shape.name} shape has no {contract} cases "
                         f"(an MLA contract needs an MLA shape)")
    explicit = {f"{impl} ({contract})"} if impl else set()
    if subjects not in (None, "all"):  # the names typed; a group's other members are implied, as by `all`
        explicit |= {s for s, _ in picked if s != impl and s in {n.strip() for n in subjects.split(",")}}
    dtypes = tuple(d.strip() for d in dtype.split(",")) if dtype else ca.DTYPES
    only = {c.strip() for c in only_cases.split(",")} if only_cases else None
    if only is not None:
        unknown = only - {c.name for c in cases(shape)}
        if unknown:
            raise InputError(f"--cases: unknown {sorted(unknown)}; known: {', '.join(c.name for c in cases(shape))}")
    res = ca.run(shape, picked, subj.IsolatedAttention, device=device, dtypes=dtypes, timeout=timeout, seed=seed, only=only,
                 on_step=lambda s: terminal.stderr.print(s, style="dim"))
    # every subject the user named must have been compared on at least one case (pass or fail):
    # one that loaded but skipped everything (e.g. NotImplementedError) did not run
    compared = {f.subject for f in res.findings if f.status != "skip"}
    loaded = all(res.subjects.get(s, {}).get("loaded", False) and s in compared for s in explicit)
    code = exit_code(res.findings, required_ran=loaded)
    verdict = verdict_word("check.attention", code)
    m = shape.mla  # the engine is asked about the head its kernels see: MLA's latent cache row
    engine = subj.engine_backends(m.kv_lora_rank + m.qk_rope if m else shape.head_dim,
                                  dtypes[0] if dtypes[0] != "float32" else "bfloat16", use_mla=m is not None,
                                  use_sparse=bool(shape.top_k))
    if json_out or json_path or sarif_path:
        emit(envelope("check.attention", argv=sys.argv[1:], verdict=verdict, exit_code=code,
                      findings=res.findings, seed=seed, shape=_shape_dict(shape), device=device,
                      subjects=res.subjects, patterns=res.patterns, engine=engine, seconds=res.seconds),
             json_out, json_path, sarif_path)
    if json_out:
        raise typer.Exit(code)
    import torch

    cc = ".".join(map(str, torch.cuda.get_device_capability())) if torch.cuda.is_available() else "none"
    try:
        import triton
        tv = triton.__version__
    except ImportError:
        tv = "not installed"
    terminal.stdout.print(f"shape {shape.name}: H={shape.n_head} Hk={shape.n_head_kv} Dqk={shape.head_dim} "
                          f"Dv={shape.head_dim_v} scale={shape.scale:.6g}; torch {torch.__version__}, triton {tv}, "
                          f"compute capability {cc}")
    terminal.attention_cases_table(res.findings, K_FLOOR)
    for s, pats in res.patterns.items():
        terminal.stdout.print(f"{s}: {'; '.join(pats)}")
    terminal.stdout.print(f"engine explainer: {engine.get('skipped') or engine}")
    c = ca.count_line(res.findings)
    terminal.stdout.print(f"{verdict}: {c} in {res.seconds:.1f} s")
    raise typer.Exit(code)


@contextlib.contextmanager
def _step_progress(what: str) -> Any:
    """A callback for a long job's steps: a spinner on a terminal; elsewhere (a log, CI) one line per step
    with the seconds elapsed, so that a run stopped from outside still says where it was."""
    if terminal.stderr.is_terminal:
        with terminal.stderr.status(what) as status:
            yield status.update
        return
    import time

    t0 = time.perf_counter()
    yield lambda msg: print(f"[{time.perf_counter() - t0:.0f} s] {msg}", file=sys.stderr, flush=True)


def _byte_progress(what: str) -> Any:
    """(a transient progress bar on stderr with bytes done and GB/s, its callback (done, total, name))."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=False),
                   TransferSpeedColumn(), TimeRemainingColumn(), console=terminal.stderr, transient=True)
    task = bar.add_task(what, total=None)

    def step(done: int, total: int, name: str) -> None:
        bar.update(task, completed=done, total=total, description=f"{what} {name[:40]}")

    return bar, step


@app.command()
@guarded("verify")
def verify(
    file: Optional[Path] = typer.Argument(None, help="GGUF file or any shard of a split model (default: the demo model)."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda: where the blocks are decoded."),
    manifest: Optional[Path] = typer.Option(None, "--manifest", help="Also name every tensor and key that differs "
                                            "from this manifest (llmdoctor manifest)."),
    manifest_out: Optional[Path] = typer.Option(None, "--manifest-out", help="Also write the file's manifest "
                                                "(as llmdoctor manifest does) from this pass's reads."),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="Spread the tensors over N ranks (one per GPU with "
                                       "--device cuda, N processes on the CPU), gathered into one report."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    json_path: Optional[Path] = json_path_option(),
    sarif_path: Optional[Path] = sarif_option(),
) -> None:
    """Decode every block of every tensor: finite values, per-tensor statistics, forensics; exit 1 on a fault."""
    from .checks.file import verify as V
    from .checks.base import count, exit_code

    path = model_file(file)
    if manifest is not None:
        from .checks.file.manifest import load

        load(manifest)  # a bad manifest is bad input, found before the pass
    check_writable(manifest_out)
    write = manifest_out is not None
    bar, step = _byte_progress("verify")
    try:
        with bar:
            if gpus is None:
                res = V.run(path, device=device, progress=step, manifest=manifest, write_manifest=write)
            else:  # torch.distributed: NCCL on GPUs, gloo on the CPU; each rank verifies its share
                from .checks.file import verify_ranks

                res = verify_ranks.run(path, gpus, device=device, manifest=manifest, write_manifest=write)
    except KeyboardInterrupt:
        terminal.error_line("interrupted: nothing was written")
        raise typer.Exit(130) from None
    code = exit_code(res.findings)
    verdict = verdict_word("verify", code)
    # file=None: the envelope would hash the whole file once more; per-tensor hashes: --manifest-out (same pass)
    doc = envelope("verify", argv=sys.argv[1:], verdict=verdict, exit_code=code, findings=res.findings,
                   model={"path": str(path), "shards": res.shards}, totals=res.totals(),
                   tensors=[t.__dict__ for t in res.tensors], ranks=gpus or 1)
    if res.manifest is not None:
        write_atomic(manifest_out, dumps(res.manifest))
        terminal.stderr.print(f"{manifest_out}: {len(res.manifest['tensors'])} tensors, "
                              f"{len(res.manifest['metadata'])} metadata keys")
    emit(doc, json_out, json_path, sarif_path)
    if not json_out:
        terminal.findings_table([f for f in res.findings if f.status != "pass"],
                                f"verify {path.name}: {len(res.shards)} file(s), {len(res.tensors)} tensors")
        c, tot = count(res.findings), res.totals()
        terminal.stdout.print(f"{verdict}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped; "
                              f"{tot['values']:,} values, {tot['non_finite']} non-finite; {res.bytes / 1e9:.2f} GB in "
                              f"{res.seconds:.2f} s ({res.gb_per_s:.2f} GB/s, {device}{f', {gpus} ranks' if gpus else ''})")
    raise typer.Exit(code)


@app.command("manifest")
@guarded("manifest")
def manifest_cmd(
    file: Optional[Path] = typer.Argument(None, help="GGUF file or any shard of a split model (default: the demo model)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the manifest to PATH (default: stdout)."),
) -> None:
    """Per-tensor sha256 and metadata digests of a known-good copy, for `verify/diagnose --manifest`."""
    from .checks.file import manifest as MF
    from .gguf import open_gguf

    check_writable(out)
    path = model_file(file)
    bar, step = _byte_progress("sha256")
    try:
        with open_gguf(path) as g, bar:
            doc = MF.build(g, step)
    except KeyboardInterrupt:
        terminal.error_line("interrupted: nothing was written")
        raise typer.Exit(130) from None
    if out is None:
        print(dumps(doc))
    else:
        write_atomic(out, dumps(doc))
        terminal.stderr.print(f"{out}: {len(doc['tensors'])} tensors, {len(doc['metadata'])} metadata keys")


@app.command()
@guarded("diff")
def diff(
    a: Path = typer.Argument(..., help="GGUF file (or any shard of a split model)."),
    b: Path = typer.Argument(..., help="GGUF file (or shard), or an HF checkpoint directory."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    json_path: Optional[Path] = json_path_option(),
) -> None:
    """Are A and B the same model? Metadata and tensors added, removed or changed, with the numbers."""
    from .checks.file import diff as D
    from .checks.base import count, exit_code

    for p in (a, b):
        if not p.exists():
            raise InputError(f"{p}: no such file or directory")
    bar, step = _byte_progress("diff")
    try:
        with bar:
            res = D.run(a, b, progress=step)
    except KeyboardInterrupt:
        terminal.error_line("interrupted: nothing was written")
        raise typer.Exit(130) from None
    code = exit_code(res.findings)
    verdict = verdict_word("diff", code)
    doc = envelope("diff", argv=sys.argv[1:], verdict=verdict, exit_code=code, findings=res.findings,
                   a=res.a, b=res.b, kind=res.kind, summary=res.summary, seconds=res.seconds)
    emit(doc, json_out, json_path)
    if not json_out:
        terminal.findings_table([f for f in res.findings if f.status != "pass"], f"{a} vs {b}")
        c = count(res.findings)
        terminal.stdout.print(f"{verdict}: {c['failed']} difference(s), {c['passed']} passed, {c['skipped']} skipped "
                              f"in {res.seconds:.1f} s")
    raise typer.Exit(code)


@check_app.command("sharding")
@guarded("check.sharding")
def check_sharding(
    file: Optional[Path] = typer.Argument(None, help="GGUF file (default: the demo model)."),
    tp_size: Optional[int] = typer.Option(None, "--tp", help="Tensor-parallel size T (ranks); required."),
    engine_shards: Optional[Path] = typer.Option(None, "--engine-shards", help="Directory of rank{r}.safetensors: "
                                                 "the shards an engine's ranks hold (format: README)."),
    rules: str = typer.Option("vllm", "--rules", help="vllm (MoE experts split by intermediate size) | vllm-ep "
                              "(whole experts per rank)."),
    layers: Optional[int] = typer.Option(None, "--layers", help="Only the first N layers (then the output head)."),
    tokens: int = typer.Option(8, "--tokens", help="Prompt length (seeded random ids over the whole vocabulary)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the prompt's token ids."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 | float64: both runs' precision."),
    device: str = typer.Option("cpu", "--device", help="cpu (gloo, T processes) or cuda (NCCL, one GPU per rank)."),
    fault: Optional[list[str]] = typer.Option(None, "--fault", help="Also run a planted sharding fault (repeatable; "
                                              "'list' lists them)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    json_path: Optional[Path] = typer.Option(None, "--json-out", help="Write the JSON object to PATH (atomically)."),
    sarif_path: Optional[Path] = sarif_option(),
) -> None:
    """Is the model sharded across T tensor-parallel ranks as the engine's rules say? Saved shards, and a
    reference TP forward (each rank only its shards, the engine's collectives) against one device."""
    from .checks.file import sharding
    from .checks.base import exit_code
    from .faults import all_faults
    from .faults.sharding import plant

    if fault and "list" in fault:
        for f in all_faults("sharding"):
            print(f"{f.name}\t{f.description}")
        return
    if tp_size is None:
        raise InputError("--tp T is required (the tensor-parallel size)")
    if tokens < 1 or (layers is not None and layers < 1):
        raise InputError("--tokens and --layers must be >= 1")
    if engine_shards is not None and not engine_shards.is_dir():
        raise InputError(f"--engine-shards {engine_shards}: not a directory")
    path = model_file(file)
    with terminal.stderr.status(f"tensor-parallel forward over {tp_size} ranks"):
        res = sharding.run(path, tp_size, rules=rules, engine_shards=engine_shards, n_layer=layers, n_tokens=tokens,
                           seed=seed, dtype=dtype, device=device, faults=fault, plant=plant)
    code = exit_code(res.findings)
    verdict = verdict_word("check.sharding", code)
    # file=None: the envelope would hash the whole (possibly 400 GB) file; the path is in `model`
    doc = envelope("check.sharding", argv=sys.argv[1:], verdict=verdict, exit_code=code, findings=res.findings,
                   model={"path": str(path)}, seed=seed, tp=tp_size, rules=rules, device=device, dtype=dtype,
                   layers=res.reference.n_layer, points=res.reference.points, roundings=res.reference.roundings,
                   plans=[{"plan": p.plan, "first_divergence": p.first, "seconds": p.seconds} for p in res.plans],
                   seconds=res.seconds)
    emit(doc, False, json_path, sarif_path)
    if json_out:
        print(dumps(doc))
        raise typer.Exit(code)
    terminal.stdout.print(f"{path.name}: T={tp_size} ({rules} rules), {res.reference.n_layer} layers, {tokens} tokens, "
                          f"{dtype} on {device}")
    terminal.sharding_table(res.findings)
    terminal.summary_line(verdict, res.findings, seconds=res.seconds)
    raise typer.Exit(code)


def _shape_dict(shape: Any) -> dict[str, Any]:
    import dataclasses

    return {k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v)
            for k, v in ((f.name, getattr(shape, f.name)) for f in dataclasses.fields(shape))}


def _lone_file_report(command: str, path: Path, findings: list, json_out: bool, json_path: Optional[Path],
                      sarif_path: Optional[Path], **extra: Any) -> None:
    """Report the findings of a check that reads one model file (forensics, metadata, frontend) and exit."""
    from .checks.base import exit_code

    code = exit_code(findings)
    verdict = verdict_word(command, code)
    emit(envelope(command, argv=sys.argv[1:], verdict=verdict, exit_code=code, findings=findings, file=path, **extra),
         json_out, json_path, sarif_path)
    if not json_out:
        terminal.findings_table([f for f in findings if f.status != "pass"], f"{command.split('.')[-1]} {path.name}")
        for f in findings:  # the few passes of these checks say what was found healthy
            if f.status == "pass":
                terminal.stdout.print(f"pass  {f.target}: {f.explanation}", highlight=False)
        terminal.summary_line(verdict, findings)
    raise typer.Exit(code)


@check_app.command("forensics")
@guarded("check.forensics")
def check_forensics(
    file: Optional[Path] = typer.Argument(None, help="GGUF file (default: the demo model)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    json_path: Optional[Path] = json_path_option(),
    sarif_path: Optional[Path] = sarif_option(),
) -> None:
    """What a lone file betrays: non-finite block scales or weights, and tensors whose block scales or
    weight statistics stand out from their role siblings (blk.N.attn_output vs every other attn_output)."""
    from .checks.file import forensics

    path = model_file(file)
    with terminal.stderr.status("decoding every tensor"):
        findings, stats = forensics.analyze(path)
    _lone_file_report("check.forensics", path, findings, json_out, json_path, sarif_path,
                      tensors=[st.as_dict() for st in stats])


@check_app.command("metadata")
@guarded("check.metadata")
def check_metadata(
    file: Optional[Path] = typer.Argument(None, help="GGUF file (default: the demo model)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    json_path: Optional[Path] = json_path_option(),
    sarif_path: Optional[Path] = sarif_option(),
) -> None:
    """Is the metadata consistent with the tensors (hard faults), and near the architecture's published values?"""
    from .checks.file import plausibility
    from .gguf import open_gguf

    path = model_file(file)
    with open_gguf(path) as g:
        findings = plausibility.run(g, path)
    _lone_file_report("check.metadata", path, findings, json_out, json_path, sarif_path)


@check_app.command("frontend")
@guarded("check.frontend")
def check_frontend(
    file: Optional[Path] = typer.Argument(None, help="GGUF file (default: the demo model)."),
    sample: Optional[int] = typer.Option(None, "--sample", help="Compare only N seeded normal tokens (and every "
                                         "special and byte token) with llama.cpp (default: every token)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    json_path: Optional[Path] = json_path_option(),
    sarif_path: Optional[Path] = sarif_option(),
) -> None:
    """The chat template (sandbox escapes, BOS) and the vocab (special ids, types, merges, llama.cpp decode parity)."""
    from .checks.frontend import audit as frontend
    from .gguf import open_gguf
    from .subjects.engines import gguf_pieces

    path = model_file(file)
    with gguf_pieces(path) as pieces, open_gguf(path) as g:
        findings = frontend.run(g, path, pieces, sample=sample)
    _lone_file_report("check.frontend", path, findings, json_out, json_path, sarif_path)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
