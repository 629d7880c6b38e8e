"""The deployment's front end as its users meet it: the engine's own tokenization of a fixed set of prompts
(and of a chat through its chat template) against the reference's, from the model file.

The caller hands in the engine (the check starts none): any engine behind the engine interface serves
(`tokenize_all`: llama.cpp as its server tokenizes, transformers and vLLM with the tokenizer folder they load, an
endpoint through its tokenize route); `checks/frontend/audit.py` is the file-level audit of the vocab and
template themselves.

The reference: the GGUF's tokenizer (reference/tokenizer.py, at llama.cpp parity) as llama.cpp's server
tokenizes a prompt (BOS/EOS as the metadata's add_bos/add_eos say, text that spells a special token is that
token), and the GGUF's chat template rendered in a sandbox (reference/chat_template.py), its text
tokenized without a second BOS where the template writes one (llama.cpp's chat route). Where the file has no
chat template, the engine's rendered chat text is tokenized by the reference instead, and its leading BOS
held to the metadata. An HF checkpoint read without a GGUF is its own reference (reference/hf_tokenizer.py).

A difference names the prompt, the first differing position with the pieces on both sides, BOS missing or
doubled against the reference, and the token count ratio. No tolerance: a tokenization is exact.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ...errors import EngineError, NotOffered
from ..base import Finding

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


def prompts(diagnosis_prompt: str, special_texts: list[str]) -> list[tuple[str, str]]:
    """(label, text) of every prompt compared: the diagnosis prompt first (the compute runs use it), then
    digits, runs of spaces and newlines, unicode (accents, CJK, emoji), code points beyond most vocabs
    (byte fallback: U+F0001 and U+10FFFD are private-use), and text that spells special tokens."""
    out = [("diagnosis prompt", diagnosis_prompt),
           ("plain", "The capital of France is Paris, and the capital of Germany is Berlin."),
           ("digits", "1 2 3 4 5 6 7 8 9 10 11"),
           ("whitespace", "a  b   c\n\nd\t\te    \n  f   "),
           ("unicode", "naïve café — 東京 🙂 Ωmega"),
           ("byte fallback", "private use: \U000F0001 \U0010FFFD")]
    if special_texts:
        out.append(("special text", "Hello" + "".join(f"{t}world" for t in special_texts) + " done"))
    return out


def leading(ids: list[int], token: int | None) -> int:
    """How many times `token` starts `ids`."""
    n = 0
    while token is not None and n < len(ids) and ids[n] == token:
        n += 1
    return n


class ReferenceFrontEnd:
    """The reference's tokenization: a GGUF's tokenizer (llama.cpp's server rules) or an HF checkpoint's."""

    def __init__(self, path: str | os.PathLike, tokenizer: Any = None):
        """`tokenizer`: the GGUF's Tokenizer when the caller has built it already (4-5 s for a 262k vocab)."""
        self.path = Path(path)
        self.template: str | None = None
        if self.path.is_dir():
            from ...reference.hf_tokenizer import HFTokenizer

            self.hf = HFTokenizer(self.path).tok
            self.gguf = None
            self.bos_id, self.add_bos = self.hf.bos_token_id, None
            self.template = getattr(self.hf, "chat_template", None) or None
            self.name = f"the checkpoint's ({self.path})"
        else:
            from ...gguf import open_gguf
            from ...reference.tokenizer import Tokenizer

            with open_gguf(self.path) as g:
                self.gguf = tokenizer or Tokenizer.from_gguf(g)
                t = g.get("tokenizer.chat_template")
                self.template = t if isinstance(t, str) and t else None
            self.hf = None
            self.bos_id, self.add_bos = self.gguf.bos_id, self.gguf.add_bos
            self.name = f"the GGUF's ({self.path.name}: add_bos {self.add_bos}, llama.cpp's tokenize rules)"

    def specials(self) -> list[str]:
        """Texts of special tokens other than BOS (EOS first), as a prompt might spell them."""
        if self.gguf is not None:
            tok = self.gguf
            ids = [i for i in ([tok.eos_id] if tok.eos_id is not None else []) if i != tok.bos_id]
            return [tok.token_text(i) for i in ids]
        return [t for t in (self.hf.eos_token,) if t and t != self.hf.bos_token]

    def encode(self, text: str) -> list[int]:
        if self.gguf is not None:
            return self.gguf.encode(text, parse_special=True)
        return list(self.hf.encode(text, add_special_tokens=True))

    def encode_chat_text(self, text: str) -> list[int]:
        """A rendered chat's ids: no BOS added where the text starts with it (llama.cpp's chat route)."""
        if self.gguf is not None:
            bos = self.piece(self.bos_id) if self.bos_id is not None else None
            return self.gguf.encode(text, add_bos=self.add_bos and not (bos and text.startswith(bos)),
                                    parse_special=True)
        return list(self.hf.encode(text, add_special_tokens=False))

    def encode_rendered(self, text: str) -> list[int]:
        """Another template's rendered chat as this model should run it: its leading BOS text removed, then
        tokenized as a prompt (BOS as the metadata says, special text parsed): a chat prompt starts with BOS
        exactly as a plain one does."""
        bos = self.piece(self.bos_id) if self.bos_id is not None else None
        while bos and text.startswith(bos):
            text = text[len(bos):]
        return self.encode(text)

    def chat(self, messages: list[dict[str, str]]) -> tuple[str, list[int]] | None:
        """The model's own chat template rendered and tokenized, or None when the model carries none."""
        if self.template is None:
            return None
        if self.gguf is not None:
            from ...reference.chat_template import render_chat_template

            tok = self.gguf
            text = render_chat_template(self.template, messages,
                                        bos=tok.token_text(tok.bos_id) if tok.bos_id is not None else "",
                                        eos=tok.token_text(tok.eos_id) if tok.eos_id is not None else "")
        else:
            text = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return text, self.encode_chat_text(text)

    def piece(self, token_id: int) -> str:
        n = self.gguf.n_vocab if self.gguf is not None else len(self.hf)
        if not 0 <= token_id < n:
            return f"<id {token_id} outside the vocab of {n}>"
        if self.gguf is not None:
            return self.gguf.piece(token_id, special=True).decode("utf-8", "replace")
        return str(self.hf.convert_ids_to_tokens(token_id))


@dataclass
class Row:
    """One prompt's tokenizations and how they differ (or why it was not compared)."""

    label: str
    prompt: str
    engine: list[int] = field(default_factory=list)
    reference: list[int] = field(default_factory=list)
    skipped: str | None = None
    note: str | None = None

    def differs(self) -> bool:
        return self.skipped is None and self.engine != self.reference

    def first_difference(self) -> int | None:
        if not self.differs():
            return None
        return next((p for p, (a, b) in enumerate(zip(self.engine, self.reference)) if a != b),
                    min(len(self.engine), len(self.reference)))

    def as_dict(self, ref: ReferenceFrontEnd) -> dict[str, Any]:
        out: dict[str, Any] = {"prompt_label": self.label, "prompt": self.prompt}
        if self.skipped is not None:
            return {**out, "status": "skip", "reason": self.skipped}
        p = self.first_difference()
        out.update(status="fail" if p is not None else "pass", engine_tokens=len(self.engine),
                   reference_tokens=len(self.reference),
                   token_count_ratio=round(len(self.engine) / max(len(self.reference), 1), 4))
        if self.note:
            out["note"] = self.note
        if p is not None:
            at = lambda ids: {"id": ids[p], "piece": ref.piece(ids[p])} if p < len(ids) else None  # noqa: E731
            out.update(first_difference=p, engine=at(self.engine), reference=at(self.reference),
                       engine_ids=self.engine[:p + 4], reference_ids=self.reference[:p + 4])
        bos = bos_problem(self, ref)
        if bos:
            out["bos"] = bos
        return out


def bos_problem(row: Row, ref: ReferenceFrontEnd) -> str | None:
    """"BOS missing" / "BOS doubled" (the engine's leading BOS count against the reference's), or None."""
    if ref.bos_id is None or row.skipped is not None:
        return None
    got, want = leading(row.engine, ref.bos_id), leading(row.reference, ref.bos_id)
    if got == want:
        return None
    return f"BOS {'missing' if got < want else 'doubled' if got == want + 1 else f'x{got}'} " \
           f"({got} leading, the reference {want})"


def compare(engine: Any, ref: ReferenceFrontEnd, diagnosis_prompt: str,
            progress: Callable[[str], None] = lambda s: None) -> list[Row]:
    """Every prompt through the engine's front end (`engine.tokenize_all`) and the reference's."""
    texts = prompts(diagnosis_prompt, ref.specials())
    progress(f"{engine.name}'s tokenizer on {len(texts)} prompts and a chat")
    try:
        got, chats = engine.tokenize_all([t for _, t in texts], [CHAT])
    except NotOffered as e:
        return [Row(label, text, skipped=str(e)) for label, text in texts]
    rows = [Row(label, text, list(ids), ref.encode(text)) for (label, text), ids in zip(texts, got)]
    chat = chats[0]
    label, shown = "chat", CHAT[0]["content"]
    if isinstance(chat, Exception):
        rows.append(Row(label, shown, skipped=str(chat)))
        return rows
    text, ids = chat
    ours = ref.chat(CHAT)
    if ours is not None:
        rows.append(Row(label, text or shown, list(ids), ours[1], note="both rendered through their own chat template"))
    elif text is not None:
        rows.append(Row(label, text, list(ids), ref.encode_rendered(text),
                        note="the model file carries no chat template: the engine's rendering, tokenized by the "
                             "reference with BOS as the metadata says"))
    else:
        rows.append(Row(label, shown, skipped="the model file carries no chat template and the engine shows no "
                                              "rendered text to hold its tokens to"))
    return rows


def finding(engine: Any, ref: ReferenceFrontEnd, rows: list[Row]) -> Finding:
    """One finding for the engine's front end: fail with the first differing prompt, else pass."""
    evidence = [r.as_dict(ref) for r in rows]
    compared = [r for r in rows if r.skipped is None]
    bad = [r for r in compared if r.differs()]
    metrics: dict[str, Any] = {"prompts": len(rows), "compared": len(compared), "differ": len(bad),
                               "engine_front_end": _front_end(engine), "reference_tokenizer": ref.name}
    common = dict(check="front-end", subject=engine.name, confidence="high",
                  hypothesis="the deployment tokenizes (and renders a chat) as the model file says",
                  evidence=evidence, metrics=metrics)
    if not compared:
        return Finding(target="tokenizer", status="skip", reason="; ".join(sorted({r.skipped for r in rows}))[:400],
                       **common)
    if not bad:
        skipped = [r.label for r in rows if r.skipped is not None]
        return Finding(target=f"{len(compared)} prompts", status="pass", **common,
                       explanation=f"the same token ids as the reference on {len(compared)} prompts"
                                   + (f" ({', '.join(skipped)} skipped)" if skipped else ""))
    first = bad[0]
    d = first.as_dict(ref)
    metrics.update(first={k: d[k] for k in ("prompt_label", "first_difference", "engine", "reference",
                                            "engine_tokens", "reference_tokens", "token_count_ratio", "bos")
                          if k in d})
    engine_tok = metrics["engine_front_end"].get("tokenizer") or metrics["engine_front_end"].get("loaded_by", "?")
    return Finding(target=f"prompt: {first.label}", status="fail", **common,
                   explanation=f"{describe(first, ref)}; tokenizers: the engine's {engine_tok}, the reference's "
                               f"{ref.name}")


def describe(row: Row, ref: ReferenceFrontEnd) -> str:
    d = row.as_dict(ref)
    p = d["first_difference"]
    side = lambda s: f"{s['piece']!r} ({s['id']})" if s else "nothing"  # noqa: E731
    what = [d["bos"]] if "bos" in d else []
    what.append(f"first difference at token {p}: engine {side(d['engine'])}, reference {side(d['reference'])}")
    what.append(f"{d['engine_tokens']} vs {d['reference_tokens']} tokens (x{d['token_count_ratio']:.2f})")
    prompt = row.prompt if len(row.prompt) <= 60 else row.prompt[:57] + "..."
    return f"the deployment's front end tokenizes the {row.label} {prompt!r} differently: " + "; ".join(what)


def _front_end(engine: Any) -> dict[str, Any]:
    try:
        return engine.front_end()
    except EngineError as e:
        return {"error": str(e)}
