"""Planted front-end faults: a deployment's tokenizer folder broken the ways real ones are (issue 25).

Each builder takes a healthy HF tokenizer folder of the model (tokenizer.json + tokenizer_config.json, as
transformers saves it; the tests convert the demo GGUF's with transformers) and writes a broken copy under
`tmp`, returning its path: the deployment then loads it (`diagnose --tokenizer DIR`). The diagnosis must
rank the `front-end` finding first and name the first differing token (`expect`: a substring of it).
Two endpoint faults (a proxy before a healthy server) plant the same in `probe`'s view.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from . import register
from .endpoint import _endpoint_fault, _Fault

# A Gemma-style chat template (the turn markers of Gemma's published template) writing BOS `{bos}` times.
CHAT_TEMPLATE = ("{bos}{{% for message in messages %}}<start_of_turn>{{{{ 'model' if message['role'] == 'assistant' "
                 "else message['role'] }}}}\n{{{{ message['content'] | trim }}}}<end_of_turn>\n{{% endfor %}}"
                 "{{% if add_generation_prompt %}}<start_of_turn>model\n{{% endif %}}")


def chat_template(bos_times: int = 1) -> str:
    return CHAT_TEMPLATE.format(bos="{{ bos_token }}" * bos_times)


def with_chat_template(folder: Path, template: str) -> None:
    """Give `folder` this chat template (transformers 5 reads chat_template.jinja beside tokenizer_config.json)."""
    (folder / "chat_template.jinja").write_text(template)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg, indent=2))


def _copy(folder: Path, tmp: Path, name: str) -> Path:
    out = Path(tmp) / name
    shutil.copytree(folder, out, dirs_exist_ok=True)
    return out


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    edit(data)
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


@register("tokenizer-no-bos", "frontend", "a tokenizer folder that adds no BOS where the model's metadata says it must "
          "(its post-processor and add_bos_token dropped, as some conversion tools write it)", "BOS missing")
def no_bos(folder: Path, tmp: Path) -> Path:
    out = _copy(folder, tmp, "tokenizer-no-bos")

    def edit(tj: dict) -> None:
        tj["post_processor"] = None

    _edit_json(out / "tokenizer.json", edit)
    _edit_json(out / "tokenizer_config.json", lambda c: c.update(add_bos_token=False))
    return out


@register("tokenizer-lost-merges", "frontend", "a tokenizer.json whose BPE model lost its merges (words split into "
          "characters)", "first difference at token")
def lost_merges(folder: Path, tmp: Path) -> Path:
    out = _copy(folder, tmp, "tokenizer-lost-merges")

    def edit(tj: dict) -> None:
        if "merges" in tj["model"]:
            tj["model"]["merges"] = []
        else:  # a Unigram model: its scores carry the segmentation
            tj["model"]["vocab"] = [[piece, 0.0] for piece, _ in tj["model"]["vocab"]]

    _edit_json(out / "tokenizer.json", edit)
    return out


@register("tokenizer-other-model", "frontend", "another model's tokenizer with the same vocabulary size (the same "
          "pieces numbered in another order; the special tokens kept where they are)", "first difference at token")
def other_model(folder: Path, tmp: Path) -> Path:
    out = _copy(folder, tmp, "tokenizer-other-model")

    def edit(tj: dict) -> None:
        vocab = tj["model"]["vocab"]  # BPE: {piece: id}
        added = {t["id"] for t in tj.get("added_tokens", [])}
        movable = sorted(i for i in vocab.values() if i not in added)
        renumber = dict(zip(movable, reversed(movable)))
        tj["model"]["vocab"] = {piece: renumber.get(i, i) for piece, i in vocab.items()}

    _edit_json(out / "tokenizer.json", edit)
    return out


@register("chat-template-double-bos", "frontend", "a chat template that writes BOS twice", "BOS doubled")
def double_bos_template(folder: Path, tmp: Path) -> Path:
    out = _copy(folder, tmp, "chat-template-double-bos")
    with_chat_template(out, chat_template(bos_times=2))
    return out


# ---- the same faults behind an endpoint (a proxy in front of a healthy server: faults/endpoint.py) -------

class _TokenizeNoBos(_Fault):
    """The tokenize routes answer without the leading BOS, as a server whose tokenizer adds none."""

    def __init__(self, bos_id: int = 2) -> None:
        self.bos_id = bos_id

    def response(self, path: str, body: Any, status: int, data: bytes) -> tuple[int, bytes]:
        if status != 200 or not path.rstrip("/").endswith("tokenize"):
            return status, data
        out = json.loads(data)
        toks = out.get("tokens")
        if isinstance(toks, list) and toks and (toks[0] == self.bos_id or isinstance(toks[0], dict)
                                                and toks[0].get("id") == self.bos_id):
            out["tokens"] = toks[1:]
        return status, json.dumps(out).encode()


class _ChatNoTemplate(_Fault):
    """The chat route refuses as vLLM does for a model without a chat template (HTTP 400, its message)."""

    def request(self, path: str, body: Any) -> tuple[int, bytes, str] | None:
        if not path.startswith("/v1/chat/completions"):
            return None
        message = ("As of transformers v4.44, default chat template is no longer allowed, so you must provide a "
                   "chat template if the tokenizer does not define one.")
        return 400, json.dumps({"error": {"message": message, "type": "BadRequestError", "code": 400}}).encode(), \
            "application/json"


_endpoint_fault("endpoint-tokenize-no-bos", "the server's tokenize route gives every text without its BOS",
                "tokenizer-mismatch", _TokenizeNoBos)
_endpoint_fault("endpoint-chat-no-template", "the chat route refuses with HTTP 400: the model has no chat template",
                "no chat template: chat refused", _ChatNoTemplate)
