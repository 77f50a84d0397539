"""The pure parts behind the OpenAI endpoints and the checkpoint archive: text pieces per token,
the cut at a stop string, and the streamed tar (readable, and exactly the size announced)."""

import io
import os
import tarfile

from gateway import checkpoints
from gateway.openai_format import _cut_at_stop, _pieces
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
    size, chunks = checkpoints.archive(str(tmp_path))
    blob = b"".join(chunks)
    assert len(blob) == size
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    assert got == {**files, checkpoints.COMPLETE_MARKER: b""}
