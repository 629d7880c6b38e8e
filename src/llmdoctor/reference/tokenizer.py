"""A tokenizer built from a GGUF file's own vocab metadata, matching llama.cpp token for token.

Conventions follow llama.cpp's src/llama-vocab.cpp and src/unicode.cpp (read, re-implemented):

- Vocab types: `tokenizer.ggml.model` "llama" is SentencePiece-style (SPM): spaces become U+2581,
  the highest-scoring adjacent pair that is itself a token is merged first (ties: leftmost), and a
  leftover piece that is no token is written as byte tokens `<0xXX>`. "gpt2" is byte-level BPE: the
  text is split by the pre-tokenizer regexes of `tokenizer.ggml.pre`, each word's UTF-8 bytes are
  mapped to GPT-2's printable byte alphabet, then the lowest-ranked merge is applied first (ties:
  leftmost). Other models (bert, t5, rwkv, ...) are refused.
- Special tokens are cut out of the text first, longest first, every occurrence of one before the
  next (llama.cpp's `tokenizer_st_partition`; equal lengths keep vocab order). User-defined tokens
  are always cut out; control and unknown tokens only with `parse_special=True`. Token types are
  first corrected by name as llama.cpp does (see `_retype_by_name`), and llama.cpp's per-model
  whitespace stripping around special tokens is applied (see `_strip_attributes`).
- Pre-tokenizer regexes are applied one after the other, each splitting every fragment into its
  matches and the gaps between them. Unicode classes are evaluated the way llama.cpp does it: on a
  "collapsed" text where every non-ASCII code point stands for its one general-category class
  (non-ASCII whitespace for \\v), with ASCII-only regex semantics. Categories come from Python's
  unicodedata (Unicode 14.0 in Python 3.11; llama.cpp's tables are Unicode 15.1), so a code point
  assigned in 15.0/15.1 (e.g. the emoji U+1FAE8) can split differently in a BPE vocab.
- BOS/EOS: llama.cpp's defaults per vocab type and pre-tokenizer, overridden by `add_bos_token` /
  `add_eos_token` / the id keys; `add_space_prefix` as in the file (SPM default true).
- Decoding is llama.cpp's `llama_detokenize`: per-token pieces (control/unknown pieces only with
  `special=True`, byte tokens as their byte, U+2581 back to space for SPM, GPT-2 bytes back to bytes
  for BPE), the SPM leading space dropped, and BPE's `clean_spaces` pass where the vocab enables it.
"""

from __future__ import annotations

import heapq
import os
import re
import unicodedata
from dataclasses import dataclass

import numpy as np
from gguf import Keys, TokenType

from ..errors import GGUFError, InputError
from ..gguf import GGUFFile, open_gguf

_K = Keys.Tokenizer
SPM_SPACE = "\u2581"
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_HIDDEN = (TokenType.CONTROL, TokenType.UNKNOWN)  # rendered only with special=True
_SPECIAL = (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)
_WORD_CACHE_MAX = 1 << 16


def _gpt2_byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes map to themselves, the other
    68 bytes, in byte order, to U+0100, U+0101, ... (as in OpenAI's encoder.py and llama.cpp)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(0x100 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


_BYTE_TO_CHAR = _gpt2_byte_alphabet()
_LATIN1_TO_GPT2 = str.maketrans({b: c for b, c in enumerate(_BYTE_TO_CHAR)})
_CHAR_TO_BYTE = {c: b for b, c in enumerate(_BYTE_TO_CHAR)}

# ------------------------------------------------------------------ pre-tokenizer regexes
# Patterns as the models' tokenizer.json files write them; \p{..} is rewritten for the collapsed
# text below. The pattern lists per `tokenizer.ggml.pre` follow llama.cpp's llm_tokenizer_bpe.
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_CJK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_DEEPSEEK3 = (r"\p{N}{1,3}", _CJK_KANA,
              r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
                   r"\p{N}")
_BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"


@dataclass(frozen=True)
class _Pre:
    """One pre-tokenizer family: its regexes and the vocab flags llama.cpp sets with it."""

    regexes: tuple[str, ...]
    clean_spaces: bool = True
    ignore_merges: bool = False
    add_bos: bool = False
    no_bos: bool = False  # the family has no BOS token by default


_DEFAULT = _Pre((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_PRE_FAMILIES: dict[tuple[str, ...], _Pre] = {
    ("default",): _DEFAULT,
    ("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "jina-es", "jina-de", "jina-v2-es",
     "jina-v2-de", "gigachat", "mellum", "modern-bert"): _Pre((_GPT2,)),
    ("trillion", "granite-docling"): _Pre((_GPT2,), clean_spaces=False),
    ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"):
        _Pre((_LLAMA3,), ignore_merges=True, add_bos=True),
    ("dbrx", "smaug-bpe"): _Pre((_LLAMA3,)),
    ("glm4", "chatglm-bpe"): _Pre((_LLAMA3,), no_bos=True),
    ("qwen2", "deepseek-r1-qwen", "hunyuan", "solar-open"): _Pre((_QWEN2,), clean_spaces=False),
    ("stablelm2", "megrez"): _Pre((_QWEN2,)),
    ("qwen35",): _Pre((_QWEN35,), clean_spaces=False),
    ("deepseek-v3", "hunyuan-dense", "joyai-llm"): _Pre(_DEEPSEEK3, clean_spaces=False),
    ("deepseek-coder",): _Pre(_DEEPSEEK_CODER, clean_spaces=False),
    ("starcoder", "refact", "codeshell", "exaone", "minerva-7b"): _Pre((r"\p{N}", _GPT2)),
    ("command-r", "smollm"): _Pre((r"\p{N}", _GPT2), clean_spaces=False),
    ("falcon",): _Pre((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    ("bloom", "gpt3-finnish"): _Pre((_BLOOM,)),
    ("poro-chat",): _Pre((_BLOOM,), clean_spaces=False),
    ("viking",): _Pre((_BLOOM, r"\p{N}"), clean_spaces=False),
}
PRE_TOKENIZERS: dict[str, _Pre] = {name: pre for names, pre in _PRE_FAMILIES.items() for name in names}

# What llama.cpp's unicode_regex_split does with \p{..}: every non-ASCII code point is replaced by
# one stand-in per general-category class, and each \p{..} by its stand-in plus the ASCII members.
_CLASS_STANDIN = {"N": "\xd1", "L": "\xd2", "P": "\xd3", "M": "\xd4", "S": "\xd5"}
_OTHER_STANDIN = "\xd0"  # separators, controls, unassigned, private use
_WHITESPACE_STANDIN = "\x0b"
_CLASS_ASCII = {
    "N": "0-9",
    "L": "A-Za-z",
    "P": r"!-#%-*,-/:;?@\[-\]_{}",
    "M": "",
    "S": r"$+<->\^`|~",
}
# Unicode White_Space (PropList.txt), the set llama.cpp's unicode-data.cpp lists.
_WHITE_SPACE = frozenset([*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
                          0x2028, 0x2029, 0x202F, 0x205F, 0x3000])
_PROPERTY = re.compile(r"\\p\{(L[ultmo]?|N|P|M|S)\}")


class _Collapse(dict):
    """str.translate table: ASCII kept, other code points to their class stand-in (lazily)."""

    def __init__(self, categories: bool):
        super().__init__()
        self.categories = categories

    def __missing__(self, cp: int) -> int:
        if cp < 128:
            out = cp
        elif cp in _WHITE_SPACE:
            out = ord(_WHITESPACE_STANDIN)
        elif not self.categories:
            out = cp
        else:
            out = ord(_CLASS_STANDIN.get(unicodedata.category(chr(cp))[0], _OTHER_STANDIN))
        self[cp] = out
        return out


_COLLAPSED = _Collapse(categories=True)  # for patterns with \p{..}
_WIDE = _Collapse(categories=False)  # for the others: only non-ASCII whitespace becomes \v


def _compile(pattern: str) -> tuple[re.Pattern, _Collapse]:
    """Compile a pre-tokenizer pattern for the text view llama.cpp runs it on."""
    if not _PROPERTY.search(pattern):
        return re.compile(pattern, re.ASCII), _WIDE
    out, pos, in_class = [], 0, False
    for m in re.finditer(r"\\.|\[|\]", pattern):
        tok = m.group()
        if tok == "[" and not in_class:
            in_class = True
        elif tok == "]" and in_class:
            in_class = False
        elif tok == "\\p":
            prop = _PROPERTY.match(pattern, m.start())
            if prop:
                cls = prop.group(1)[0]
                members = re.escape(_CLASS_STANDIN[cls]) + _CLASS_ASCII[cls]
                out.append(pattern[pos : m.start()])
                out.append(members if in_class else f"[{members}]")
                pos = prop.end()
    out.append(pattern[pos:])
    return re.compile("".join(out), re.ASCII), _COLLAPSED


# ------------------------------------------------------------------ token types guessed from text
# llama.cpp (llama_vocab::impl::load) does not trust the file's token types for these names: an
# end-of-generation token is made a control token (so it is cut out of text only with
# parse_special and rendered only with special=True), and so is the first fill-in-the-middle token
# of each kind whose id the metadata does not give.
_EOG_NAMES = frozenset([
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
])
_FIM_NAMES = {
    _K.FIM_PRE_ID: ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>",
                    "<PRE>", "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>"),
    _K.FIM_SUF_ID: ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>",
                    "<SUF>", "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>"),
    _K.FIM_MID_ID: ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>",
                    "<MID>", "\u2581<MID>", "<|code_middle|>", "<|middle|>"),
    _K.FIM_PAD_ID: ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    _K.FIM_REP_ID: ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    _K.FIM_SEP_ID: ("<|file_sep|>",),
}
_FIM_DEPRECATED = {_K.FIM_PRE_ID: _K.PREFIX_ID, _K.FIM_SUF_ID: _K.SUFFIX_ID, _K.FIM_MID_ID: _K.MIDDLE_ID}
_ALWAYS_USER_DEFINED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss
_C_SPACE = " \t\n\v\f\r"  # C isspace(), what llama.cpp strips next to a special token


def _retype_by_name(f: GGUFFile, vocab: dict[str, int], types: list[int]) -> set[int]:
    """Apply llama.cpp's token-type corrections in place; return the end-of-generation ids."""
    n = len(types)

    def make_control(tid: int) -> None:  # llama.cpp adds the control attribute; control wins
        types[tid] = int(TokenType.CONTROL)

    def given(key: str) -> int | None:
        v = f.get(key)
        return int(v) if v is not None and 0 <= int(v) < n else None

    eog: set[int] = set()
    for key, names in _FIM_NAMES.items():
        tid = given(key)
        if tid is None and key in _FIM_DEPRECATED:
            tid = given(_FIM_DEPRECATED[key])
        if tid is None:  # llama.cpp takes whichever its hash map meets first; we take the lowest id
            found = [vocab[t] for t in names if t in vocab]
            if found:
                tid = min(found)
                make_control(tid)
        if tid is not None and key in (_K.FIM_PAD_ID, _K.FIM_REP_ID, _K.FIM_SEP_ID):
            eog.add(tid)
    for name in _EOG_NAMES:
        tid = vocab.get(name)
        if tid is not None:
            eog.add(tid)
            make_control(tid)
    for name in _ALWAYS_USER_DEFINED:
        if name in vocab:
            types[vocab[name]] = int(TokenType.USER_DEFINED)
    for key in (_K.EOT_ID, _K.EOM_ID):
        if given(key) is not None:
            eog.add(given(key))
    texts = {name: vocab[name] for name in ("<|return|>", "<|call|>", "<|calls|>", "<|flush|>",
                                            "<|end|>", "<|tool_response>", "</s>") if vocab.get(name) in eog}
    has_call = "<|call|>" in texts or "<|calls|>" in texts
    if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
        eog.discard(texts["<|end|>"])  # o200k_harmony / solar-open: <|end|> ends a message only
        types[texts["<|end|>"]] = int(TokenType.USER_DEFINED)
    if "<|tool_response>" in texts and "</s>" in texts:  # gemma4: </s> is ordinary text
        eog.discard(texts["</s>"])
        types[texts["</s>"]] = int(TokenType.NORMAL)
    return eog


def _strip_attributes(f: GGUFFile, vocab: dict[str, int], special: list[int]) -> tuple[set, set]:
    """Ids of special tokens that swallow whitespace on their left (lstrip) / right (rstrip). GGUF has
    no key for this: llama.cpp sets it by model name, pre-tokenizer and architecture."""
    name = str(f.get("general.name", "")).lower()
    pre = str(f.get(_K.PRE, ""))
    arch = str(f.get("general.architecture", ""))
    lstrip: set[int] = set()
    rstrip: set[int] = set()
    if any(p in pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or \
            any(a in arch for a in ("nomic-bert-moe", "jina-bert-v3")):
        lstrip.update(vocab[t] for t in ("<mask>",) if t in vocab)
    elif "phi-3" in name or "phi3" in name:
        rstrip.update(special)
        rstrip.update(vocab[t] for t in ("</s>",) if t in vocab)
        rstrip.difference_update(vocab[t] for t in ("<unk>", "<s>", "<|endoftext|>") if t in vocab)
    elif "modern-bert" in name:
        lstrip.update(vocab[t] for t in ("[MASK]",) if t in vocab)
    return lstrip, rstrip


# ------------------------------------------------------------------ the tokenizer
class Tokenizer:
    """Token ids <-> text from a GGUF vocab. Build with `Tokenizer.from_gguf(path_or_file)`."""

    def __init__(self, *, model: str, tokens: list[str], vocab: dict[str, int], types: list[int],
                 scores: list[float], merges: list[str], pre: str | None, bos_id: int | None,
                 eos_id: int | None, unk_id: int | None, eog_ids: set[int], add_bos: bool,
                 add_eos: bool, add_space_prefix: bool, clean_spaces: bool, ignore_merges: bool,
                 pre_regexes: tuple[str, ...], special: list[int], lstrip: set[int], rstrip: set[int]):
        self.model = model
        self.pre = pre
        self.tokens = tokens
        self.vocab = vocab  # text -> id
        self.types = types
        self.scores = scores
        self.bos_id, self.eos_id, self.unk_id = bos_id, eos_id, unk_id
        self.eog_ids = frozenset(eog_ids)  # ids that end generation (llama.cpp's special_eog_ids)
        self.add_bos, self.add_eos = add_bos, add_eos
        self.add_space_prefix = add_space_prefix
        self.clean_spaces = clean_spaces
        self.ignore_merges = ignore_merges
        self.ranks: dict[str, int] = {}
        for i, m in enumerate(merges):  # "left right"; the first of duplicate merges wins
            self.ranks.setdefault(m, i)
        self._pre = [_compile(p) for p in pre_regexes]
        special = sorted(special, key=lambda i: -len(tokens[i].encode("utf-8", "surrogateescape")))
        self._special = [(tokens[i], i, types[i] in _HIDDEN, i in lstrip, i in rstrip) for i in special]
        self._pieces: dict[tuple[int, bool], bytes] = {}
        self._words: dict[str, list[int]] = {}

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_gguf(cls, gguf_file: GGUFFile | str | os.PathLike) -> "Tokenizer":
        """Build from an open `GGUFFile` or a path (opened and closed here)."""
        if not isinstance(gguf_file, GGUFFile):
            with open_gguf(gguf_file) as f:
                return cls.from_gguf(f)
        f = gguf_file
        model = f.get(_K.MODEL)
        if model is None or _K.LIST not in f.fields:
            raise InputError(f"{f.path}: no tokenizer in this file ({_K.MODEL} / {_K.LIST} missing)")
        if model not in ("llama", "gpt2"):
            raise InputError(f"{f.path}: tokenizer model {model!r} is not supported (llama, gpt2)")
        tokens = f.fields[_K.LIST].value.decode_all(errors="surrogateescape")
        n = len(tokens)
        if "" in tokens:
            tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # as llama.cpp names them
        vocab = dict(zip(tokens, range(n)))
        if len(vocab) != n:
            dup = next(t for i, t in enumerate(tokens) if vocab[t] != i)
            raise GGUFError(f"{f.path}: token {dup!r} appears twice in {_K.LIST} "
                            f"(ids {tokens.index(dup)} and {vocab[dup]})")
        types = _array(f, _K.TOKEN_TYPE, n, default=int(TokenType.NORMAL)).tolist()
        eog = _retype_by_name(f, vocab, types)
        scores = _array(f, _K.SCORES, n, default=0.0).tolist()

        spm = model == "llama"
        pre_name = f.get(_K.PRE)
        if spm:
            pre, defaults = None, {"bos": 1, "eos": 2, "unk": 0}
            merges: list[str] = []
        else:
            pre = PRE_TOKENIZERS.get(pre_name or "default")
            if pre is None:
                raise InputError(f"{f.path}: pre-tokenizer {pre_name!r} ({_K.PRE}) is not supported; "
                                 f"known: {', '.join(sorted(PRE_TOKENIZERS))}")
            if _K.MERGES not in f.fields:
                raise GGUFError(f"{f.path}: BPE vocab without {_K.MERGES}")
            merges = f.fields[_K.MERGES].value.decode_all(errors="surrogateescape")
            defaults = {"bos": None if pre.no_bos else 11, "eos": 11, "unk": None}
        ids = {}
        for name, key in (("bos", _K.BOS_ID), ("eos", _K.EOS_ID), ("unk", _K.UNK_ID)):
            v = defaults[name] if defaults[name] is not None and defaults[name] < n else None
            given = f.get(key)
            ids[name] = int(given) if given is not None and 0 <= int(given) < n else v
        add_bos = bool(f.get(_K.ADD_BOS, spm or (pre is not None and pre.add_bos)))
        add_eos = bool(f.get(_K.ADD_EOS, False))
        for flag, name, key in ((add_bos, "bos", _K.ADD_BOS), (add_eos, "eos", _K.ADD_EOS)):
            if flag and ids[name] is None:
                raise GGUFError(f"{f.path}: {key} is true but there is no {name} token id")
        if ids["eos"] is not None:
            eog.add(ids["eos"])
        special = np.flatnonzero(np.isin(types, [int(t) for t in _SPECIAL])).tolist()
        lstrip, rstrip = _strip_attributes(f, vocab, special)
        return cls(model=model, tokens=tokens, vocab=vocab, types=types, scores=scores,
                   merges=merges, pre=pre_name, bos_id=ids["bos"], eos_id=ids["eos"],
                   unk_id=ids["unk"], eog_ids=eog, add_bos=add_bos, add_eos=add_eos,
                   add_space_prefix=bool(f.get(_K.ADD_PREFIX, spm)),
                   clean_spaces=not spm and pre.clean_spaces,
                   ignore_merges=not spm and pre.ignore_merges,
                   pre_regexes=() if spm else pre.regexes, special=special, lstrip=lstrip,
                   rstrip=rstrip)

    # ---------------------------------------------------------------- properties
    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def token_text(self, token_id: int) -> str:
        """The token's text as the vocab stores it (U+2581 for spaces in SPM vocabs)."""
        return self.tokens[self._check(token_id)]

    def token_type(self, token_id: int) -> int:
        return self.types[self._check(token_id)]

    def _check(self, token_id: int) -> int:
        if not 0 <= token_id < len(self.tokens):
            raise InputError(f"token id {token_id} is outside the vocab (0..{len(self.tokens) - 1})")
        return token_id

    # ---------------------------------------------------------------- encode
    def encode(self, text: str, add_bos: bool | None = None, *, add_eos: bool | None = None,
               parse_special: bool = False) -> list[int]:
        """Token ids of `text`. `add_bos`/`add_eos`: None follows the file's metadata (what llama.cpp
        does with add_special=True). `parse_special`: cut control tokens such as "<start_of_turn>"
        out of the text (user-defined tokens are always cut out)."""
        add_bos = self.add_bos if add_bos is None else add_bos
        add_eos = self.add_eos if add_eos is None else add_eos
        out: list[int] = []
        if add_bos:
            if self.bos_id is None:
                raise InputError("this vocab has no BOS token")
            out.append(self.bos_id)
        prev_special = True
        for frag in self._partition(text, parse_special):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
            elif self.model == "llama":
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                out.extend(self._spm(frag.replace(" ", SPM_SPACE)))
                prev_special = False
            else:
                for word in self._split(frag):
                    out.extend(self._bpe_word(word))
        if add_eos:
            if self.eos_id is None:
                raise InputError("this vocab has no EOS token")
            out.append(self.eos_id)
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Cut special tokens out of `text`: longest first, all occurrences of one before the next."""
        frags: list[str | int] = [text] if text else []
        for tok, tid, hidden, lstrip, rstrip in self._special:
            if (hidden and not parse_special) or tok not in text:
                continue
            cut: list[str | int] = []
            for frag in frags:
                if isinstance(frag, int):
                    cut.append(frag)
                    continue
                pos = 0
                while (at := frag.find(tok, pos)) >= 0:
                    left = frag[pos:at].rstrip(_C_SPACE) if lstrip else frag[pos:at]
                    if left:
                        cut.append(left)
                    cut.append(tid)
                    pos = at + len(tok)
                    while rstrip and pos < len(frag) and frag[pos] in _C_SPACE:
                        pos += 1
                if pos < len(frag):
                    cut.append(frag[pos:])
            frags = cut
        return frags

    def _spm(self, text: str) -> list[int]:
        """SentencePiece-style merging over the whole fragment (llama.cpp's llm_tokenizer_spm): the
        pair whose concatenation is the highest-scoring token merges first."""
        vocab, scores = self.vocab, self.scores

        def priority(left: int, width: int, _: int) -> float | None:
            tid = vocab.get(text[left : left + width])
            return None if tid is None else -scores[tid]

        out: list[int] = []
        for piece in _merge_pairs(text, priority):
            tid = vocab.get(piece)
            if tid is not None:
                out.append(tid)
                continue
            for b in piece.encode("utf-8", "surrogateescape"):  # byte fallback: <0xXX>, else the
                tid = vocab.get(f"<0x{b:02X}>")                  # byte's one-character token
                if tid is None:
                    tid = vocab.get(bytes([b]).decode("utf-8", "surrogateescape"))
                if tid is None:
                    raise InputError(f"no token for byte 0x{b:02X} (no <0x{b:02X}> in the vocab)")
                out.append(tid)
        return out

    def _split(self, text: str) -> list[str]:
        """Pre-tokenize: each regex splits every fragment into matches and the gaps between them.
        Returns the words, already in GPT-2's byte alphabet."""
        spans = [(0, len(text))]
        views: dict[int, str] = {}
        for rx, table in self._pre:
            view = views.get(id(table))
            if view is None:
                view = views[id(table)] = text.translate(table)
            cut = []
            for start, end in spans:
                pos = start
                for m in rx.finditer(view, start, end):
                    a, b = m.span()
                    if a > pos:
                        cut.append((pos, a))
                    if b > a:
                        cut.append((a, b))
                    pos = b
                if pos < end:
                    cut.append((pos, end))
            spans = cut
        return [text[a:b].encode("utf-8", "surrogateescape").decode("latin-1").translate(_LATIN1_TO_GPT2)
                for a, b in spans]

    def _bpe_word(self, word: str) -> list[int]:
        """Byte-level BPE of one pre-tokenized word (llama.cpp's llm_tokenizer_bpe_session): the pair
        with the lowest merge rank merges first."""
        cached = self._words.get(word)
        if cached is not None:
            return cached
        vocab, ranks = self.vocab, self.ranks

        def priority(left: int, width: int, right: int) -> int | None:
            return ranks.get(f"{word[left:right]} {word[right : left + width]}")

        pieces = [word] if self.ignore_merges and word in vocab else _merge_pairs(word, priority)
        out: list[int] = []
        for piece in pieces:
            tid = vocab.get(piece)
            if tid is not None:
                out.append(tid)
                continue
            for b in piece.encode("utf-8"):  # llama.cpp looks up each byte alone; misses are dropped
                tid = vocab.get(bytes([b]).decode("utf-8", "surrogateescape"))
                if tid is not None:
                    out.append(tid)
        if len(self._words) < _WORD_CACHE_MAX:
            self._words[word] = out
        return out

    # ---------------------------------------------------------------- decode
    def piece(self, token_id: int, special: bool = False) -> bytes:
        """The bytes one token stands for (llama.cpp's token_to_piece without lstrip)."""
        key = (token_id, special)
        got = self._pieces.get(key)
        if got is None:
            got = self._pieces[key] = self._render(self._check(token_id), special)
        return got

    def _render(self, tid: int, special: bool) -> bytes:
        ttype, text = self.types[tid], self.tokens[tid]
        if ttype in _HIDDEN and not special:
            return b""
        if ttype in _SPECIAL:
            return text.encode("utf-8", "surrogateescape")
        if ttype == TokenType.BYTE:
            m = _BYTE_TOKEN.fullmatch(text)
            if m is None:
                raise GGUFError(f"byte token {tid} is {text!r}, not <0xXX>")
            return bytes([int(m.group(1), 16)])
        if ttype != TokenType.NORMAL:
            return b""  # unused and undefined tokens render as nothing
        if self.model == "llama":
            return text.replace(SPM_SPACE, " ").encode("utf-8", "surrogateescape")
        out = bytearray()
        for ch in text:
            b = _CHAR_TO_BYTE.get(ch)
            if b is not None:
                out.append(b)
            else:  # llama.cpp's llama_decode_text marks a character outside the byte alphabet so
                raw = ch.encode("utf-8", "surrogateescape")
                out += b"[UNK_BYTE_0x" + raw.hex().encode() + text.encode("utf-8", "surrogateescape") + b"]"
        return bytes(out)

    def decode_bytes(self, ids: list[int], *, special: bool = False,
                     remove_special: bool = False) -> bytes:
        """llama.cpp's llama_detokenize: `special` renders control tokens; `remove_special` drops a
        leading BOS / trailing EOS that the metadata would have added."""
        ids = list(ids)
        strip_space = self.add_space_prefix
        if remove_special and self.add_bos and ids and ids[0] == self.bos_id:
            ids, strip_space = ids[1:], False
        if remove_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        parts = [self.piece(t, special) for t in ids]
        if strip_space and parts and parts[0][:1] == b" ":
            parts[0] = parts[0][1:]
        out = b"".join(parts)
        if self.clean_spaces:
            out = _clean_spaces(out)
        return out

    def decode(self, ids: list[int], *, special: bool = False, remove_special: bool = False) -> str:
        """`decode_bytes` as text (invalid UTF-8, e.g. a cut multi-byte character, becomes U+FFFD)."""
        return self.decode_bytes(ids, special=special, remove_special=remove_special).decode(
            "utf-8", errors="replace")

    def __repr__(self) -> str:
        return (f"Tokenizer(model={self.model!r}, pre={self.pre!r}, n_vocab={self.n_vocab}, "
                f"bos={self.bos_id}, eos={self.eos_id}, add_bos={self.add_bos})")


def _merge_pairs(text: str, priority) -> list[str]:
    """Greedy pair merging shared by SPM and BPE (llama.cpp's symbol list and priority queue).

    Starts from one symbol per character; `priority(left, width, right)` ranks merging the adjacent
    symbols starting at `left` and `right` into text[left : left + width] (None: not allowed). The
    smallest priority merges first, ties go to the leftmost pair; after each merge the new symbol's
    pairs with its neighbours are queued. Returns the final pieces in order.
    """
    n = len(text)
    size = [1] * n  # symbol i covers text[i : i + size[i]]; 0 once merged into its left neighbour
    nxt = [*range(1, n), -1]
    prv = list(range(-1, n - 1))
    heap: list[tuple] = []

    def push(left: int, right: int) -> None:
        if left >= 0 and right >= 0:
            width = size[left] + size[right]
            key = priority(left, width, right)
            if key is not None:
                heapq.heappush(heap, (key, left, right, width))

    for i in range(n - 1):
        push(i, i + 1)
    while heap:
        _, left, right, width = heapq.heappop(heap)
        if not size[left] or not size[right] or size[left] + size[right] != width:
            continue  # stale: a side was merged since it was queued
        size[left], size[right] = width, 0
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        push(prv[left], left)
        push(left, nxt[left])
    pieces: list[str] = []
    i = 0 if n else -1
    while i >= 0:
        pieces.append(text[i : i + size[i]])
        i = nxt[i]
    return pieces


def _clean_spaces(text: bytes) -> bytes:
    """llama.cpp's clean_up_tokenization_spaces passes, in order: no space before ?!., ;
    " ' " -> "'"; no space before 's 'm 're 've."""
    text = re.sub(rb" ([?!.,])", rb"\1", text)
    text = text.replace(b" ' ", b"'")
    return re.sub(rb" '(?=[sm]|re|ve)", b"'", text)


def _array(f: GGUFFile, key: str, n: int, default: float) -> np.ndarray:
    """A per-token numeric array (all `default` when the key is absent)."""
    field = f.fields.get(key)
    if field is None:
        return np.full(n, default)
    value = field.value
    if not isinstance(value, np.ndarray) or len(value) < n:
        raise GGUFError(f"{key} must be a numeric array of at least {n} entries", field.offset, f.path)
    return value[:n]
