"""HEAD and ranged GETs of every kind of signed download URL (routes/files.py), as object stores
answer them, in process on fake backends with a real base model and a real PEFT adapter: the
PEFT archive, the merged export, an external_weights file and a session trace. A HEAD is the
GET's headers with no body (and downloads nothing: no audit entry, no merge); a range is exactly
those bytes of the whole file, wherever it starts and ends (inside a tar header, across members,
inside a block of merged rows); what cannot be served is a 400 or 416 that says why."""

from __future__ import annotations

import os
import shutil
import urllib.parse

from gateway_fakes import gateway  # noqa: F401 - the fixture
from test_export_archive import _adapter, _base, _saved

from sqlalchemy import select

from gateway import export
from gateway.storage.db import AuditRow, CheckpointRow
from tinkerd import merged_export


def _archive_url(api, model_id: str, **params) -> str:
    redirect = api.get(f"training_runs/{model_id}/checkpoints/weights/c/archive", params=params,
                       follow_redirects=False)
    assert redirect.status_code == 302, redirect.text
    url = urllib.parse.urlsplit(redirect.headers["location"])
    return f"{url.path}?{url.query}"


def _downloads(gw) -> int:
    return gw.db.count(select(AuditRow.event_id).where(AuditRow.event == "checkpoint_downloaded"))


def _check_head_and_ranges(client, url: str, offsets=()) -> bytes:
    """The URL's HEAD and ranged GETs against its whole GET; `offsets`: where ranges should start
    and end besides the file's own ends (the tar's member boundaries, say)."""
    whole = client.get(url)
    assert whole.status_code == 200, whole.text
    n = len(whole.content)
    assert int(whole.headers["content-length"]) == n and whole.headers["accept-ranges"] == "bytes"

    head = client.head(url)
    assert head.status_code == 200 and head.content == b""
    assert {k: v for k, v in head.headers.items() if k != "date"} == \
        {k: v for k, v in whole.headers.items() if k != "date"}

    spans = {"bytes=0-0": (0, 1), "bytes=0-": (0, n), "bytes=-1": (n - 1, n), f"bytes=-{n + 9}": (0, n),
             f"bytes={n - 1}-{n + 100}": (n - 1, n), "bytes=3-": (3, n), "Bytes = 5 - 9": (5, 10)}
    for o in offsets:
        for start, end in ((o - 1, o + 1), (o, o + 700), (o - 513, o), (o + 1, o + 4096)):
            start, end = max(start, 0), min(end, n)
            if start < end:
                spans[f"bytes={start}-{end - 1}"] = (start, end)
    for spec, (start, end) in spans.items():
        got = client.get(url, headers={"Range": spec})
        assert got.status_code == 206, (spec, got.text)
        assert got.content == whole.content[start:end], spec
        assert got.headers["content-range"] == f"bytes {start}-{end - 1}/{n}", spec
        assert int(got.headers["content-length"]) == end - start
        head = client.head(url, headers={"Range": spec})
        assert head.status_code == 206 and head.content == b"" and int(head.headers["content-length"]) == end - start

    for spec in (f"bytes={n}-", f"bytes={n + 5}-{n + 9}", "bytes=-0"):
        refused = client.get(url, headers={"Range": spec})
        assert refused.status_code == 416 and refused.headers["content-range"] == f"bytes */{n}", spec
        assert "bytes" in refused.json()["error"]
    for spec, words in (("bytes=0-1,4-5", "one range"), ("bytes=9-3", "ends before it starts"),
                        ("bytes=a-b", "one range")):
        refused = client.get(url, headers={"Range": spec})
        assert refused.status_code == 400 and words in refused.json()["error"], spec
    # Another unit, or a Range under an If-Range these files cannot match: the whole file.
    for headers in ({"Range": "items=0-1"}, {"Range": "bytes=0-1", "If-Range": '"an-etag"'}):
        got = client.get(url, headers=headers)
        assert got.status_code == 200 and got.content == whole.content
    return whole.content


def _merged_checkpoint(gateway, tmp_path):
    _adapter(_base(gateway.settings.base_model, tied=True), tmp_path / "adapter")
    model_id, directory = _saved(gateway)
    for f in ("adapter_model.safetensors", "adapter_config.json"):
        shutil.copy(tmp_path / "adapter" / f, os.path.join(directory, f))
    return model_id


def test_archives_answer_head_and_byte_ranges(gateway, tmp_path, monkeypatch):
    monkeypatch.setattr(merged_export, "ROWS_BYTES", 1000)     # many row blocks: ranges start inside them
    api, gw = gateway.api, gateway.api.client.app.state.gateway
    model_id = _merged_checkpoint(gateway, tmp_path)
    row = gw.db.get(CheckpointRow, f"tinker://{model_id}/weights/c")
    client = api.client
    for params, tar in (({}, export.peft_archive(row)),
                        ({"format": "merged"}, export.merged_archive(gateway.settings.base_model, row))):
        url = _archive_url(api, model_id, **params)
        offsets = [o for o, _ in tar.parts]
        if params:                      # and every tensor of model.safetensors, rows into it
            weights = next(o for o, part in tar.parts if getattr(part, "name", "") == merged_export.WEIGHTS)
            plan = merged_export.plan(gateway.settings.base_model, row.directory)
            at = weights + len(plan.header())
            for t in plan.tensors:
                offsets += [at, at + t.num_bytes // 3 + 5]
                at += t.num_bytes
        whole = _check_head_and_ranges(client, url, offsets)
        assert len(whole) == tar.size

        before = _downloads(gw)
        assert client.head(url).status_code == 200 and _downloads(gw) == before       # a HEAD downloads nothing
        assert client.get(url, headers={"Range": "bytes=0-9"}).status_code == 206 and _downloads(gw) == before + 1
        forged = url.replace("signature=", "signature=0")
        assert client.head(forged).status_code == 404 and client.get(forged).status_code == 404


def test_merged_weights_start_at_any_byte(tmp_path, monkeypatch):
    """weights_chunks from an offset is the whole file's bytes from there, wherever it falls."""
    _adapter(_base(tmp_path / "base", tied=False), tmp_path / "adapter")
    plan = merged_export.plan(str(tmp_path / "base"), str(tmp_path / "adapter"))
    monkeypatch.setattr(merged_export, "ROWS_BYTES", 1000)
    whole = b"".join(merged_export.weights_chunks(plan))
    assert len(whole) == plan.weights_size
    at, offsets = len(plan.header()), {0, 1, len(plan.header()) - 1, plan.weights_size - 1}
    for t in plan.tensors:
        row = t.num_bytes // t.shape[0]
        offsets |= {at - 1, at, at + 1, at + row, at + row - 1, at + 1000, at + t.num_bytes - 1}
        at += t.num_bytes
    for offset in sorted(o for o in offsets if 0 <= o < plan.weights_size):
        assert b"".join(merged_export.weights_chunks(plan, offset)) == whole[offset:], offset


def test_a_head_of_a_merged_archive_merges_nothing(gateway, tmp_path, monkeypatch):
    """A HEAD takes no place among the merged exports being made: it answers while they are full."""
    monkeypatch.setattr(export, "MAX_MERGED_EXPORTS", 1)
    api, gw = gateway.api, gateway.api.client.app.state.gateway
    model_id = _merged_checkpoint(gateway, tmp_path)
    row = gw.db.get(CheckpointRow, f"tinker://{model_id}/weights/c")
    held = export.take_place(gw.limits, "another-user").stream(
        export.merged_archive(gateway.settings.base_model, row).chunks())
    next(held)
    url = _archive_url(api, model_id, format="merged")
    head = api.client.head(url)
    assert head.status_code == 200 and int(head.headers["content-length"]) > 0
    assert api.client.get(url, headers={"Range": "bytes=0-9"}).status_code == 429
    del held


def test_external_files_and_traces_answer_head_and_byte_ranges(gateway):
    api = gateway.api
    model = api.model(session := api.session())
    path = api.result(api.post("save_weights_external", {"model_id": model, "path": "e", "seq_id": 1}).json()
                      ).json()["path"]
    with open(os.path.join(gateway.api.client.app.state.gateway.db.get(CheckpointRow, path).directory,
                           "adapter_model.safetensors"), "wb") as f:
        f.write(bytes(range(256)) * 40)         # a file worth ranging over
    urls = api.get(f"training_runs/{model}/checkpoints/external_weights/e/external_weights_urls").json()["urls"]
    url = urllib.parse.urlsplit(urls["adapter_model.safetensors"])
    client = api.client
    whole = client.get(f"{url.path}?{url.query}", headers={"X-API-Key": ""})
    assert whole.content == bytes(range(256)) * 40
    head = client.head(f"{url.path}?{url.query}", headers={"X-API-Key": ""})
    assert head.status_code == 200 and head.content == b"" and head.headers["content-length"] == str(10240)
    got = client.get(f"{url.path}?{url.query}", headers={"X-API-Key": "", "Range": "bytes=1000-5095"})
    assert got.status_code == 206 and got.content == whole.content[1000:5096]
    assert got.headers["content-range"] == "bytes 1000-5095/10240"
    assert client.get(f"{url.path}?{url.query}", headers={"X-API-Key": "", "Range": "bytes=10240-"}).status_code == 416

    trace = urllib.parse.urlsplit(api.get(f"sessions/{session}/trace_export").json()["url"])
    _check_head_and_ranges(client, f"{trace.path}?{trace.query}")

