"""Planted front-end faults: a deployment's tokenizer folder broken the ways real ones are (issue 25).

Each builder takes a healthy HF tokenizer folder of the model (tokenizer.json + tokenizer_config.json, as
transformers saves it; the tests convert the demo GGUF's with transformers) and writes a broken copy under
`tmp`, returning its path: the deployment then loads it (`diagnose --tokenizer DIR`). The diagnosis must
rank the `front-end` finding first and name the first differing token (`expect`: a substring of it).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from . import register

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
