"""The front end a GGUF carries: its chat template and its tokenizer, audited from the file alone.

Chat template (`tokenizer.chat_template`, a Jinja2 program written by whoever made the file):
- sandbox escapes: the constructs server-side template injection uses to leave Jinja's sandbox or
  reach Python internals, each flagged with its line: any dunder name or string (`__class__`,
  `__globals__`, `__subclasses__`, `__mro__`, `__init__`, `__builtins__`, `__import__`, also spelled
  through `|attr('...')` or a subscript), `.mro`, the globals whose functions carry `__globals__`
  (`cycler`, `joiner`, `lipsum`), `self` (the template reference), `namespace` used as anything but a
  call (its class is the way in), and `import` / `include` / `extends` (a chat template has no loader);
- BOS: rendered in the sandbox (checks/endpoint/probes.py's renderer, as transformers' apply_chat_template
  does) on a two-turn conversation. BOS more than once is a fault (the model sees a document start
  mid-prompt); never BOS while `add_bos_token` is true is a fault for every engine that tokenizes the
  rendered prompt without special tokens (transformers' apply_chat_template, vLLM's chat path). A
  template that starts with BOS while add_bos is true is the usual HF layout: llama.cpp's chat code
  (common/chat.cpp) strips the rendered BOS before tokenizing with add_special, so it is not flagged.

Tokenizer (`tokenizer.ggml.*`):
- special ids: BOS / EOS / EOT / PAD / UNK / SEP ids in range and of a special type (control,
  user-defined, unknown); at least one end-of-generation id;
- token types: one per token, each a gguf TokenType; byte tokens spelled `<0xXX>`;
- merges: a BPE (gpt2) vocab has `tokenizer.ggml.merges`, each "left right" of two vocab tokens;
- parity: every token's piece as our tokenizer and llama.cpp render it (tests/reference/test_tokenizer.py
  compares the encoders; this check surfaces the decoding half for any file). The caller hands in
  llama.cpp's piece reader (subjects/engines `gguf_pieces`): the check starts no engine.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

from gguf import Keys, TokenType

from ..base import Finding

_K = Keys.Tokenizer
_DUNDER = re.compile(r"__\w+__")
_ESCAPE_NAMES = {"cycler": "a jinja global whose methods carry __globals__",
                 "joiner": "a jinja global whose methods carry __globals__",
                 "lipsum": "a jinja global function with __globals__",
                 "self": "the template reference object",
                 "mro": "the class hierarchy (.mro)"}
_SPECIAL_TYPES = (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)
_ID_KEYS = {"bos": _K.BOS_ID, "eos": _K.EOS_ID, "eot": _K.EOT_ID, "pad": _K.PAD_ID, "unk": _K.UNK_ID,
            "sep": _K.SEP_ID}


def template_escapes(template: str) -> list[dict[str, Any]]:
    """Sandbox-escape constructs in a Jinja2 template: [{"line", "construct", "why"}]; a template that
    does not parse is one entry (line of the syntax error)."""
    from jinja2 import TemplateSyntaxError, nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    try:
        tree = env.parse(template)
    except TemplateSyntaxError as e:
        return [{"line": e.lineno, "construct": "syntax error", "why": e.message or "does not parse"}]
    out = []
    called = {id(n.node) for n in tree.find_all(nodes.Call) if isinstance(n.node, nodes.Name)}

    def flag(node: Any, construct: str, why: str) -> None:
        out.append({"line": node.lineno, "construct": construct, "why": why})

    for n in tree.find_all(nodes.Node):
        if isinstance(n, nodes.Getattr):
            if _DUNDER.fullmatch(n.attr) or n.attr == "mro":
                flag(n, f".{n.attr}", "reaches Python object internals")
        elif isinstance(n, nodes.Const) and isinstance(n.value, str) and _DUNDER.search(n.value):
            flag(n, repr(n.value), "a dunder name as a string (|attr or a subscript reaches internals)")
        elif isinstance(n, nodes.Name):
            if _DUNDER.fullmatch(n.name):
                flag(n, n.name, "a dunder name")
            elif n.name in _ESCAPE_NAMES:
                flag(n, n.name, _ESCAPE_NAMES[n.name])
            elif n.name == "namespace" and id(n) not in called:
                flag(n, "namespace", "namespace used as an object, not called (its class reaches internals)")
        elif isinstance(n, (nodes.Import, nodes.FromImport, nodes.Include, nodes.Extends)):
            flag(n, type(n).__name__.lower(), "loads another template: a chat template has no loader")
    return sorted(out, key=lambda e: e["line"])


def bos_usage(template: str, bos: str, eos: str) -> dict[str, Any]:
    """How often the rendered two-turn conversation contains the BOS text, and where."""
    from ...reference.chat_template import render_chat_template

    msgs = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "Count to three."}]
    text = render_chat_template(template, msgs, bos=bos, eos=eos)
    return {"count": text.count(bos) if bos else 0, "starts_with": bool(bos) and text.startswith(bos),
            "rendered": text[:400]}


def audit_template(g: Any, tok: Any, file: str | Path = "") -> list[Finding]:
    template = g.get(_K.CHAT_TEMPLATE)
    if not isinstance(template, str) or not template:
        return [Finding("chat-template", "gguf", _K.CHAT_TEMPLATE, "skip", reason="the file carries no chat template")]
    where = {"key": _K.CHAT_TEMPLATE, "file": str(file)}
    out = []
    esc = template_escapes(template)
    if esc:
        out.append(Finding("chat-template", "gguf", _K.CHAT_TEMPLATE, "fail", confidence="high",
                           hypothesis="the chat template stays inside Jinja's sandbox",
                           metrics={"constructs": len(esc)}, evidence=[{**where, **e} for e in esc[:12]],
                           explanation="; ".join(f"line {e['line']}: {e['construct']} ({e['why']})" for e in esc[:3])))
    else:
        out.append(Finding("chat-template", "gguf", _K.CHAT_TEMPLATE, "pass",
                           hypothesis="the chat template stays inside Jinja's sandbox",
                           explanation="no construct that reaches Python internals or loads templates"))
    if esc or tok is None or tok.bos_id is None:
        why = "the template is suspect" if esc else "the tokenizer has no BOS token"
        out.append(Finding("chat-template-bos", "gguf", _K.CHAT_TEMPLATE, "skip", reason=f"not rendered: {why}"))
        return out
    bos = tok.token_text(tok.bos_id)
    eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else ""
    try:
        use = bos_usage(template, bos, eos)
    except Exception as e:  # a template is data: its errors are findings, not ours
        out.append(Finding("chat-template-bos", "gguf", _K.CHAT_TEMPLATE, "fail",
                           hypothesis="the chat template renders a conversation",
                           evidence=[where], explanation=f"the template fails to render a 2-turn conversation: "
                                                         f"{type(e).__name__}: {e}"))
        return out
    metrics = {"bos": bos, "bos_count": use["count"], "starts_with_bos": use["starts_with"], "add_bos": tok.add_bos}
    problem = None
    if use["count"] > 1:
        problem = f"the template emits BOS {bos!r} {use['count']} times in a 2-turn conversation"
    elif use["count"] == 0 and tok.add_bos:
        problem = (f"the template never emits BOS {bos!r} while add_bos_token is true: engines that tokenize the "
                   "rendered prompt without special tokens (transformers' apply_chat_template, vLLM) send no BOS")
    out.append(Finding("chat-template-bos", "gguf", _K.CHAT_TEMPLATE, "fail" if problem else "pass",
                       hypothesis="the chat template and add_bos_token together give one BOS",
                       metrics=metrics, evidence=[{**where, "rendered": use["rendered"]}],
                       explanation=problem or (f"one BOS {bos!r}" + (" (rendered; llama.cpp strips it before adding "
                                                                    "its own)" if use["starts_with"] else ""))))
    return out


def audit_tokenizer(g: Any, tok: Any, file: str | Path = "") -> list[Finding]:
    """Special ids, token types and merges of the file's vocab (`tok`: its reference Tokenizer)."""
    tokens = g.fields.get(_K.LIST)
    if tokens is None:
        return [Finding("tokenizer", "gguf", _K.LIST, "skip", reason="the file carries no tokenizer")]
    n = tokens.count
    out = []

    def fail(target: str, rule: str, text: str) -> None:
        out.append(Finding("tokenizer", "gguf", target, "fail", hypothesis="the vocab is well-formed",
                           metrics={"rule": rule}, evidence=[{"key": target, "file": str(file)}], explanation=text))

    types_field = g.fields.get(_K.TOKEN_TYPE)
    types = None
    if types_field is not None:
        types = [int(x) for x in types_field.value]
        valid = {int(t) for t in TokenType}
        if len(types) != n:
            fail(_K.TOKEN_TYPE, "types", f"{len(types)} token types for {n} tokens")
            types = None
        elif bad := [i for i, t in enumerate(types) if t not in valid]:
            fail(_K.TOKEN_TYPE, "types", f"{len(bad)} token type(s) outside gguf's TokenType, first id {bad[0]} "
                                         f"= {types[bad[0]]}")
        elif tok is not None:
            bytes_bad = [i for i, t in enumerate(types) if t == TokenType.BYTE
                         and not re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", tok.tokens[i])]
            if bytes_bad:
                fail(_K.TOKEN_TYPE, "types", f"{len(bytes_bad)} byte token(s) not spelled <0xXX>, first id "
                                             f"{bytes_bad[0]} = {tok.tokens[bytes_bad[0]]!r}")
    for name, key in _ID_KEYS.items():
        v = g.get(key)
        if v is None:
            continue
        if not 0 <= int(v) < n:
            fail(key, "special-ids", f"{key} = {int(v)} is outside the vocab (0..{n - 1})")
        elif types is not None and name != "unk" and types[int(v)] not in _SPECIAL_TYPES and \
                (tok is None or tok.token_type(int(v)) not in _SPECIAL_TYPES):  # tok: retyped by name as llama.cpp
            fail(key, "special-ids", f"{key} = {int(v)} ({tokens.value[int(v)]!r}) is a normal token: "
                                     "engines print it as text and may not stop on it")
    if tok is not None and not tok.eog_ids:
        fail(_K.EOS_ID, "special-ids", "no end-of-generation token (EOS / EOT): generation never stops")
    if g.get(_K.MODEL) == "gpt2":
        merges = g.fields.get(_K.MERGES)
        if merges is None or merges.count == 0:
            fail(_K.MERGES, "merges", "a BPE (gpt2) vocab without tokenizer.ggml.merges: nothing merges")
        elif tok is not None:
            bad = [m for m in merges.value.decode_all() if len(p := m.split(" ")) != 2 or
                   p[0] not in tok.vocab or p[1] not in tok.vocab]
            if bad:
                fail(_K.MERGES, "merges", f"{len(bad)} merge(s) not 'left right' of two vocab tokens, first {bad[0]!r}")
    if not out:
        out.append(Finding("tokenizer", "gguf", _K.LIST, "pass", hypothesis="the vocab is well-formed",
                           metrics={"tokens": n},
                           explanation=f"special ids in range and special, types consistent ({n} tokens)"
                                       + (", merges present" if g.get(_K.MODEL) == "gpt2" else "")))
    return out


PARITY_SAMPLE = 4096  # seeded normal tokens compared besides every special and byte token (diagnose)


def parity(tok: Any, engine_piece: Callable[[int, bool], bytes], *, engine: str = "llama.cpp",
           sample: int | None = None, seed: int = 0) -> Finding:
    """Token pieces (plain and with specials rendered) from our tokenizer against the engine's: every
    token, or (`sample`) every non-normal token and `sample` seeded normal ones."""
    import numpy as np

    ids = np.arange(tok.n_vocab)
    if sample is not None and sample < tok.n_vocab:
        types = np.asarray(tok.types)
        normal = ids[types == int(TokenType.NORMAL)]
        picked = np.random.default_rng(seed).choice(normal, size=min(sample, normal.size), replace=False)
        ids = np.union1d(ids[types != int(TokenType.NORMAL)], picked)
    bad = []
    for special in (False, True):
        for i in ids.tolist():
            ours, theirs = tok.piece(i, special), engine_piece(i, special)
            if ours != theirs:
                bad.append({"id": i, "special": special, "ours": ours.hex(), engine: theirs.hex()})
    what = f"all {tok.n_vocab}" if len(ids) == tok.n_vocab else f"{len(ids)} of {tok.n_vocab} (every special " \
        f"and byte token, {sample} seeded normal ones; `llmdoctor check frontend` compares all)"
    return Finding("tokenizer-parity", engine, _K.LIST, "fail" if bad else "pass",
                   hypothesis=f"our tokenizer renders every token as {engine} does",
                   metrics={"tokens": tok.n_vocab, "compared": len(ids), "differing": len(bad)}, evidence=bad[:10],
                   explanation=(f"our tokenizer renders token pieces unlike {engine}: {len(bad)} differ, first id {bad[0]['id']}"
                                if bad
                                else f"{what} token pieces render as {engine} renders them"))


def run(g: Any, file: str | Path = "", engine_piece: Callable[[int, bool], bytes] | None = None,
        sample: int | None = None) -> list[Finding]:
    """Template, tokenizer and (with `engine_piece`) decode parity findings for an open GGUFFile."""
    from ...errors import GGUFError, LLMDoctorError
    from ...reference.tokenizer import Tokenizer

    tok, out = None, []
    if g.fields.get(_K.LIST) is not None:
        try:
            tok = Tokenizer.from_gguf(g)
        except GGUFError as e:  # the vocab contradicts itself
            out.append(Finding("tokenizer", "gguf", _K.MODEL, "fail", hypothesis="the vocab is well-formed",
                               explanation=f"the tokenizer cannot be built: {e}"))
        except LLMDoctorError as e:  # a tokenizer model we do not implement: not the file's fault
            out.append(Finding("tokenizer", "gguf", _K.MODEL, "skip", reason=str(e)))
    out = audit_tokenizer(g, tok, file) + out
    out += audit_template(g, tok, file)
    if tok is None:
        out.append(Finding("tokenizer-parity", "llama.cpp", _K.LIST, "skip", reason="no tokenizer to compare"))
    elif engine_piece is None:
        out.append(Finding("tokenizer-parity", "llama.cpp", _K.LIST, "skip",
                           reason="llama.cpp (llama-cpp-python) is not available"))
    else:
        out.append(parity(tok, engine_piece, sample=sample))
    return out
