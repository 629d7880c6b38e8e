"""The GGUF-vocab tokenizer against llama.cpp (llama-cpp-python, vocab_only), both directions.

SPM: the demo Gemma 3 270M vocab (262,144 tokens, byte fallback, no space prefix, digits split).
BPE: a small byte-level BPE vocab trained here with HF `tokenizers` (offline, no download), written
to a vocab-only GGUF with gguf-py's GGUFWriter once per `tokenizer.ggml.pre` name we support, and
loaded by llama.cpp itself. Decoding is compared with llama.cpp's `llama_detokenize` (the C function:
llama-cpp-python's `Llama.detokenize` joins `token_to_piece` outputs through a 32-byte buffer and
drops a leading space after BOS, which llama.cpp's own detokenize does not).
"""

from __future__ import annotations

import ctypes
import json

import numpy as np
import pytest
from gguf import GGUFWriter, TokenType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmdoctor.errors import GGUFError, InputError
from llmdoctor.gguf import StringArray, open_gguf
from llmdoctor.reference.tokenizer import PRE_TOKENIZERS, Tokenizer

llama_cpp = pytest.importorskip("llama_cpp")

# English prose, code, numbers, punctuation that BPE's clean-up pass touches, unicode, emoji with
# skin tone and ZWJ, CJK, whitespace runs (Gemma has user-defined tokens for runs of spaces, tabs and
# newlines), tabs, CRLF, text that looks like tokens, and special tokens.
TEXT = (
    "The quick brown fox jumps over the lazy dog. It's a dog's life; we're here, they've gone.\n"
    "Hello , world ! Is it ' quoted ' ? It 's fine , they 're sure ; I 'm ok ; I 've done .\n"
    "def fib(n):\n\tif n < 2:\n\t\treturn n\n    return fib(n - 1) + fib(n - 2)  # recursion\n\n"
    "1 2 3 4 5 6 7 8 9 10, 11, 123456789, 3.14159, 1e-9, $42.00, 50% ~approx~ a+b=c <=> x|y ^2\n"
    "café naïve résumé Straße Ελληνικά русский текст עברית العربية हिन्दी ไทย\r\n"
    "日本語のテキストです。中文字符，한국어 텍스트。 全角　スペース\n"
    "Emoji 🙂👍🏽 👨‍👩‍👧 🏳️‍🌈 ∑∫√∞ ≤≥ ← → ©®™ § ¶ • … – — “quotes” ‘single’\n"
    "   three spaces, five     spaces,\t\ttabs,\n\n\n\nfour newlines,  \n trailing   \n"
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n"
    "<|im_start|>system\nBe brief.<|im_end|><|endoftext|> <bos><eos></s><unk> <0x0A> <table><td>x</td>"
    "[multimodal]<start_of_image> ▁lower▁block \u00a0nbsp \u2028ls \u3000 \u200bzwsp \ufeffbom"
)


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines(keepends=True) if line.strip()]


def _detokenize(llm, ids: list[int], *, remove_special: bool = False, special: bool = False) -> bytes:
    """llama.cpp's own llama_detokenize on `ids`."""
    vocab = llm._model.vocab
    arr = (llama_cpp.llama_token * max(len(ids), 1))(*ids)
    size = 64 * len(ids) + 64
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, remove_special, special)
    assert n >= 0
    return buf.raw[:n]


def _piece(llm, token_id: int, special: bool) -> bytes:
    buf = ctypes.create_string_buffer(128)
    n = llama_cpp.llama_token_to_piece(llm._model.vocab, token_id, buf, 128, 0, special)
    assert n >= 0
    return buf.raw[:n]


def _assert_parity(ours: Tokenizer, llm, text: str) -> None:
    """Encode with and without special-token parsing and BOS/EOS; decode every way; all as llama.cpp."""
    for parse_special in (False, True):
        for add_special in (True, False):
            want = llm.tokenize(text.encode(), add_bos=add_special, special=parse_special)
            got = ours.encode(text, None if add_special else False,
                              add_eos=None if add_special else False, parse_special=parse_special)
            assert got == want, (text, parse_special, add_special)
            for remove_special in (False, True):
                for special in (False, True):
                    assert ours.decode_bytes(got, special=special, remove_special=remove_special) == \
                        _detokenize(llm, got, remove_special=remove_special, special=special), \
                        (text, got, remove_special, special)


# ----------------------------------------------------------------------------- SPM: the demo vocab
@pytest.fixture(scope="module")
def gemma(demo_path):
    return Tokenizer.from_gguf(demo_path)


@pytest.fixture(scope="module")
def gemma_llm(demo_path):
    return llama_cpp.Llama(str(demo_path), vocab_only=True, verbose=False)


def test_demo_metadata(gemma, demo_path):
    with open_gguf(demo_path) as f:
        assert gemma.n_vocab == 262144 == len(f.get("tokenizer.ggml.tokens"))
    assert (gemma.model, gemma.bos_id, gemma.eos_id, gemma.unk_id) == ("llama", 2, 1, 3)
    assert (gemma.add_bos, gemma.add_eos, gemma.add_space_prefix) == (True, False, False)
    assert gemma.token_text(248) == "<0x0A>" and gemma.piece(248) == b"\n"
    assert gemma.token_text(105) == "<start_of_turn>"


def test_demo_parity_varied_text(gemma, gemma_llm):
    _assert_parity(gemma, gemma_llm, TEXT)
    for line in _lines(TEXT):
        _assert_parity(gemma, gemma_llm, line)
    for text in ["", " ", "\n", "a", " leading space", "x" * 300, "\U000e0041\U0010fffd odd planes"]:
        _assert_parity(gemma, gemma_llm, text)


def test_demo_special_tokens(gemma):
    ids = gemma.encode("<start_of_turn>user\nHi<end_of_turn>", parse_special=True)
    assert ids[:2] == [2, 105] and ids[-1] == 106
    plain = gemma.encode("<start_of_turn>user", parse_special=False)
    assert 105 not in plain  # control tokens are text unless parse_special
    assert gemma.decode(ids) == "user\nHi" and gemma.decode(ids, special=True) == \
        "<bos><start_of_turn>user\nHi<end_of_turn>"
    assert gemma.eog_ids == {1, 106, 212}  # <eos>, <end_of_turn>, </s> (made control by name)


def test_demo_digits_split(gemma):
    """Gemma's vocab has single digits only: " 11" is " ", "1", "1" (the issue's greedy check)."""
    assert [gemma.token_text(i) for i in gemma.encode(" 11", add_bos=False)] == ["▁", "1", "1"]
    ids = gemma.encode("1 2 3 4 5 6 7 8 9 10", add_bos=False)
    assert "".join(gemma.token_text(i) for i in ids) == "1▁2▁3▁4▁5▁6▁7▁8▁9▁10" and len(ids) == 20


@pytest.mark.slow
def test_demo_every_piece(gemma, gemma_llm):
    """All 262,144 token pieces, plain and special, byte for byte as llama.cpp renders them."""
    for special in (False, True):
        bad = [i for i in range(gemma.n_vocab) if gemma.piece(i, special) != _piece(gemma_llm, i, special)]
        assert bad == [], bad[:10]


def test_demo_roundtrip_and_llama_cpp_python_detokenize(gemma, gemma_llm):
    for line in _lines(TEXT):
        ids = gemma.encode(line)
        if "<" not in line:  # SPM without a space prefix is lossless
            assert gemma.decode(ids) == line
        if not line.startswith(" "):  # Llama.detokenize drops a leading space after BOS
            assert gemma_llm.detokenize(ids) == gemma.decode_bytes(ids)


def test_demo_long_text(gemma, gemma_llm):
    """The benchmark's text (bench/bench_tokenizer.py times it against llama.cpp): 600+ tokens, llama.cpp's ids."""
    text = TEXT.replace("<", "") * 2
    ids = gemma.encode(text)
    assert len(ids) >= 600 and ids == gemma_llm.tokenize(text.encode(), add_bos=True, special=False)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(st.characters(max_codepoint=0x2FFFF, exclude_categories=("Cs", "Cn", "Co")), max_size=40)
       | st.lists(st.sampled_from(_lines(TEXT) + [" ", "  ", "\n", "\t", "~", "11", "'s"]), max_size=6)
       .map("".join))
def test_demo_parity_fuzz(gemma, gemma_llm, text):
    assert gemma.encode(text, parse_special=True) == gemma_llm.tokenize(text.encode(), add_bos=True,
                                                                      special=True)
    ids = gemma.encode(text)
    assert ids == gemma_llm.tokenize(text.encode(), add_bos=True, special=False)
    assert gemma.decode_bytes(ids) == _detokenize(gemma_llm, ids)


# ----------------------------------------------------------------------------- SPM: made here
_PHI3_TEXT = ("<|user|>\n  Hello  <|end|>\n<|assistant|>  Hi </s>  there <s> x <unk> y<|end|> "
              "<|endoftext|>  z")


@pytest.fixture(scope="module", params=["Plain SPM", "Phi-3 mini"])
def spm_pair(request, tmp_path_factory):
    """A Llama-2-style SPM vocab (space prefix on, byte fallback) built from TEXT's frequent
    substrings; named "Phi-3 ..." it also gets llama.cpp's whitespace-swallowing special tokens."""
    escaped = [" " + line.replace(" ", "\u2581") for line in _lines(TEXT + _PHI3_TEXT)]
    counts: dict[str, int] = {}
    for line in escaped:
        for i in range(len(line)):
            for j in range(i + 1, min(i + 6, len(line) + 1)):
                counts[line[i:j]] = counts.get(line[i:j], 0) + 1
    control = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]  # + <|endoftext|>: llama.cpp
    # needs it in a Phi-3 vocab
    head = ["<unk>", *control[:2], *(f"<0x{b:02X}>" for b in range(256)), *control[2:], "<|endoftext|>",
            "<|note|>"]
    pieces = [p for p in sorted(counts, key=lambda p: (-counts[p], p)) if p not in head][:1500]
    tokens = head + pieces
    types = ([TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
             + [TokenType.CONTROL] * 4 + [TokenType.USER_DEFINED] + [TokenType.NORMAL] * len(pieces))
    scores = [0.0] * len(head) + [-float(i) for i in range(len(pieces))]
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    w = GGUFWriter(str(path), "llama")
    for add in ("context_length", "embedding_length", "block_count", "feed_forward_length", "head_count"):
        getattr(w, f"add_{add}")(8)
    w.add_name(request.param)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return request.param, Tokenizer.from_gguf(path), llama_cpp.Llama(str(path), vocab_only=True,
                                                                      verbose=False)


def test_spm_space_prefix_and_strip_parity(spm_pair):
    name, ours, llm = spm_pair
    assert ours.add_space_prefix and ours.add_bos
    swallowed = ours.encode("<|user|> \n Hi", parse_special=True) == ours.encode("<|user|>Hi",
                                                                              parse_special=True)
    assert swallowed == name.startswith("Phi-3")
    for text in [TEXT, _PHI3_TEXT, *_lines(TEXT), " two", "x<|note|>y", "<|user|>"]:
        _assert_parity(ours, llm, text)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(["<|user|>", "<|end|>", "</s>", "<s>", "<|note|>", " ", "  ", "\n",
                                 "\t", "Hi", "ok.", "日本", "🙂", "\u2581"]), max_size=10).map("".join))
def test_spm_parity_fuzz(spm_pair, text):
    _, ours, llm = spm_pair
    for parse_special in (False, True):
        ids = ours.encode(text, parse_special=parse_special)
        assert ids == llm.tokenize(text.encode(), add_bos=True, special=parse_special)
        assert ours.decode_bytes(ids) == _detokenize(llm, ids)


# ----------------------------------------------------------------------------- BPE: trained here
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_USER_DEFINED = "<tool_call>"


@pytest.fixture(scope="module")
def bpe_vocab():
    """(tokens, merges, types) of a 700-token byte-level BPE trained on TEXT's lines, offline."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=_SPECIALS + [_USER_DEFINED], show_progress=False)
    hf.train_from_iterator(_lines(TEXT) * 20, trainer)
    model = json.loads(hf.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [TokenType.CONTROL if t in _SPECIALS else TokenType.USER_DEFINED if t == _USER_DEFINED
             else TokenType.NORMAL for t in tokens]
    return tokens, merges, types


def _write_bpe(path, vocab, pre: str, **extra) -> str:
    tokens, merges, types = vocab
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(64)  # the few hyperparameters llama.cpp reads even with vocab_only
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(8)
    w.add_head_count(1)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|endoftext|>"))
    for key, value in extra.items():
        getattr(w, f"add_{key}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="module")
def bpe_pair(tmp_path_factory, bpe_vocab):
    """pre name -> (our tokenizer, llama.cpp vocab-only model), built once per name."""
    made = {}

    def get(pre: str):
        if pre not in made:
            path = _write_bpe(tmp_path_factory.mktemp("bpe") / f"{pre}.gguf", bpe_vocab, pre)
            try:
                llm = llama_cpp.Llama(path, vocab_only=True, verbose=False)
            except ValueError:
                pytest.skip(f"skipped: this llama.cpp build does not know pre-tokenizer {pre!r}")
            made[pre] = (Tokenizer.from_gguf(path), llm)
        return made[pre]

    return get


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_bpe_parity_each_pre_tokenizer(bpe_pair, pre):
    ours, llm = bpe_pair(pre)
    assert ours.model == "gpt2" and ours.pre == pre
    _assert_parity(ours, llm, TEXT)
    for line in _lines(TEXT):
        _assert_parity(ours, llm, line)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(max_codepoint=0x2FFFF, exclude_categories=("Cs", "Cn", "Co")),
                    max_size=40),
       pre=st.sampled_from(["default", "gpt-2", "llama-bpe", "qwen2", "deepseek-v3", "deepseek-coder",
                            "starcoder", "falcon", "bloom"]))
def test_bpe_parity_fuzz(bpe_pair, text, pre):
    ours, llm = bpe_pair(pre)
    ids = ours.encode(text, parse_special=True)
    assert ids == llm.tokenize(text.encode(), add_bos=True, special=True)
    assert ours.decode_bytes(ids) == _detokenize(llm, ids)


def test_bpe_metadata_flags(tmp_path, bpe_vocab):
    tokens = bpe_vocab[0]
    tok = Tokenizer.from_gguf(_write_bpe(tmp_path / "a.gguf", bpe_vocab, "llama-bpe"))
    assert tok.add_bos and not tok.add_eos and tok.ignore_merges and tok.clean_spaces
    assert tok.encode("hi")[0] == tokens.index("<|im_start|>")
    assert tokens.index("<|endoftext|>") in tok.eog_ids and tokens.index("<|im_end|>") in tok.eog_ids
    tok = Tokenizer.from_gguf(_write_bpe(tmp_path / "b.gguf", bpe_vocab, "qwen2", add_bos_token=False,
                                         add_eos_token=True))
    ids = tok.encode("hi")
    assert ids[-1] == tokens.index("<|endoftext|>") and ids[0] != tokens.index("<|im_start|>")
    assert tok.encode("hi", add_bos=True, add_eos=False)[0] == tokens.index("<|im_start|>")
    assert not tok.clean_spaces
    # user-defined tokens are cut out even without parse_special; control tokens only with it
    assert tokens.index(_USER_DEFINED) in tok.encode(f"a{_USER_DEFINED}b")
    assert tokens.index("<|im_end|>") not in tok.encode("a<|im_end|>b")
    assert tokens.index("<|im_end|>") in tok.encode("a<|im_end|>b", parse_special=True)


# ----------------------------------------------------------------------------- refusals
def test_refusals(tmp_path, bpe_vocab, gemma):
    with pytest.raises(InputError, match="pre-tokenizer 'no-such-pre'"):
        Tokenizer.from_gguf(_write_bpe(tmp_path / "p.gguf", bpe_vocab, "no-such-pre"))
    w = GGUFWriter(str(tmp_path / "t5.gguf"), "t5")
    w.add_tokenizer_model("t5")
    w.add_token_list(["<pad>", "</s>"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(InputError, match="tokenizer model 't5' is not supported"):
        Tokenizer.from_gguf(tmp_path / "t5.gguf")
    tokens, merges, types = bpe_vocab
    with pytest.raises(GGUFError, match="appears twice"):
        Tokenizer.from_gguf(_write_bpe(tmp_path / "d.gguf", (tokens + [tokens[5]], merges,
                                                             types + [TokenType.NORMAL]), "gpt-2"))
    with pytest.raises(InputError, match="outside the vocab"):
        gemma.decode([gemma.n_vocab])


def test_string_array_decode_all(tmp_path):
    """The reader's bulk decode equals one-by-one decoding, also when a string is not UTF-8."""
    w = GGUFWriter(str(tmp_path / "s.gguf"), "llama")
    strings = ["a", "", "ünï", "\n", "x" * 300, "🙂"]
    w.add_array("ok", strings)
    w.add_array("bad", [b"ok", b"\xff\xfe", "é".encode()])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open_gguf(tmp_path / "s.gguf") as f:
        assert f.get("ok").decode_all() == strings
        assert f.get("bad").decode_all(errors="surrogateescape") == ["ok", "\udcff\udcfe", "é"]
        assert f.get("bad").decode_all() == f.get("bad").tolist()
    empty = np.empty(0, np.int64)
    assert StringArray(memoryview(b""), empty, empty).decode_all() == []
