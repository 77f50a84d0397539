"""The pure parts behind the OpenAI endpoints and the checkpoint archive: text pieces per token,
the cut at a stop string, and the streamed tar (readable, and exactly the size announced)."""

import io
import os
import tarfile

from gateway import checkpoints
from gateway.openai.format import _cut_at_stop, _pieces
from harness.models import build_tokenizer


def test_pieces_join_to_the_decoded_text_even_across_split_characters():
    tok = build_tokenizer()
    for text in ["the cat sat on a mat", "naïve café — 東京", "def f(x):\n    return x"]:
        tokens = tok.encode(text)
        pieces = _pieces(tok, tokens)
        assert len(pieces) == len(tokens) and "".join(pieces) == tok.decode(tokens, skip_special_tokens=True)
        assert all("\ufffd" not in p for p in pieces)


def test_the_text_ends_before_the_first_stop_string():
    assert _cut_at_stop(["ab", "c", "de", "f"], ["d", "c"]) == (["ab", "", "", ""], True)
    assert _cut_at_stop(["ab", "cd"], ["bc"]) == (["ab"[:1], ""], True)
    assert _cut_at_stop(["ab", "cd"], ["x"]) == (["ab", "cd"], False)


def test_archive_is_a_tar_of_the_files_plus_the_completion_marker(tmp_path):
    (tmp_path / "sub").mkdir()
    files = {"adapter_config.json": b"{}", "adapter_model.safetensors": os.urandom(70_000), "sub/x.bin": b"x" * 512}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    archive = checkpoints.archive(str(tmp_path))
    blob = b"".join(archive.chunks())
    assert len(blob) == archive.size
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    assert got == {**files, checkpoints.COMPLETE_MARKER: b""}


def _reference_pieces(tok, tokens):
    """The quadratic decoder _pieces replaced (its prefix never moves past tokens that decode to
    nothing or to an unfinished character): the output _pieces must keep."""
    pieces, prefix, read = [], 0, 0
    for i in range(len(tokens)):
        before = tok.decode(tokens[prefix:read], skip_special_tokens=True)
        after = tok.decode(tokens[prefix:i + 1], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            pieces.append(after[len(before):])
            prefix, read = read, i + 1
        else:
            pieces.append("")
    if read < len(tokens) and pieces:
        before = tok.decode(tokens[prefix:read], skip_special_tokens=True)
        pieces[-1] = tok.decode(tokens[prefix:], skip_special_tokens=True)[len(before):]
    return pieces


def _byte_tokens(tok, data: bytes) -> list[int]:
    """`data` as one token per byte (the byte-level alphabet): a non-ASCII character spans 2 to 4
    tokens, and bytes that are not UTF-8 never make a character."""
    return [tok.convert_tokens_to_ids(_BYTE_SYMBOL[b]) for b in data]


def _byte_symbols() -> dict[int, str]:
    """GPT-2's byte -> printable-character table, as the ByteLevel pre-tokenizer uses it."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_SYMBOL = _byte_symbols()


def _sequences(tok) -> dict[str, list[int]]:
    text = "the cat sat on a mat. naïve café — 東京 😀 def f(x):\n    return x "
    eos, start = tok.eos_token_id, tok.convert_tokens_to_ids("<|im_start|>")
    words = tok.encode(text * 4)
    return {
        "normal": words,
        "special between words": [start, *words[:9], eos, eos, *words[9:30], start, eos],
        "byte tokens": _byte_tokens(tok, text.encode()),
        "byte tokens between specials": [eos, *_byte_tokens(tok, "東京".encode()), eos, *words[:5],
                                         *_byte_tokens(tok, "😀".encode()), eos],
        "unfinished character at the end": [*words[:7], *_byte_tokens(tok, "東".encode()[:2])],
        "unfinished character, then a special": [*words[:7], *_byte_tokens(tok, "😀".encode()[:3]), eos],
        "only specials": [eos, start, eos],
    }


def test_linear_pieces_equal_the_reference_decoder_on_normal_special_and_byte_tokens():
    tok = build_tokenizer()
    for name, tokens in _sequences(tok).items():
        assert _pieces(tok, tokens) == _reference_pieces(tok, tokens), name


def test_decoding_special_and_invalid_byte_tokens_takes_about_as_long_as_normal_text():
    """8 x 1024 tokens (one choice each, as decode_choices does): tokens that decode to nothing
    (special) or never finish a character (stray UTF-8 continuation bytes, which an adapter can
    be trained to emit) used to keep the decode window growing, quadratic in the length."""
    import time

    tok = build_tokenizer()
    normal = tok.encode("the cat sat on a mat, naïve café — 東京 " * 200)[:1024]
    kinds = {"normal": normal, "special": [tok.eos_token_id] * 1024,
             "invalid bytes": _byte_tokens(tok, b"\x80" * 1024)}

    def seconds(tokens) -> float:
        best = float("inf")
        for _ in range(3):                  # the best of 3: a shared machine's noise only adds
            t0 = time.perf_counter()
            for _ in range(8):
                pieces = _pieces(tok, tokens)
            best = min(best, time.perf_counter() - t0)
        assert "".join(pieces) == tok.decode(tokens, skip_special_tokens=True)
        return best

    took = {kind: seconds(tokens) for kind, tokens in kinds.items()}
    # Quadratic, the special and byte cases took more than 10x the normal case here (0.55 s vs 0.04 s).
    assert took["special"] <= 2 * took["normal"] + 0.01, took
    assert took["invalid bytes"] <= 2 * took["normal"] + 0.01, took
