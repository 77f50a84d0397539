"""Every kind of signed download URL answers as an object store's does, on the shared `tinkerd up`
over real HTTP: the checkpoint archive (of a training and of a sampler checkpoint), the merged
export, an external_weights file and a session trace. `httpx.head(url)` is a 200 with the GET's
Content-Length and no body, and a ranged GET (`Range: bytes=a-b`) is a 206 with exactly those
bytes of the GET; a range past the end is a 416. Fetched without credentials, as a download
tool would (tests/gateway/test_download_ranges.py goes through the edge cases in process)."""

from __future__ import annotations

import httpx
import pytest
import tinker
from tinker import types

from conftest import sft_data

pytestmark = pytest.mark.e2e


def _archive_url(stack, tinker_path: str, **params) -> str:
    run_id, checkpoint_id = tinker_path.removeprefix("tinker://").split("/", 1)
    redirect = httpx.get(f"{stack.url}/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id}/archive",
                         params=params, headers={"X-API-Key": stack.api_key}, follow_redirects=False)
    assert redirect.status_code == 302, redirect.text
    return redirect.headers["location"]


def _check(url: str) -> int:
    whole = httpx.get(url, timeout=600)
    assert whole.status_code == 200, whole.text
    n = len(whole.content)
    assert n > 0 and int(whole.headers["content-length"]) == n

    head = httpx.head(url, timeout=60)
    assert head.status_code == 200, head.text
    assert head.content == b"" and int(head.headers["content-length"]) == n
    assert head.headers.get("accept-ranges") == "bytes"

    for start, end in ((0, 0), (1, n // 3), (n // 2, n - 1), (n - 1, n - 1)):
        part = httpx.get(url, headers={"Range": f"bytes={start}-{end}"}, timeout=600)
        assert part.status_code == 206, (start, end, part.text)
        assert part.content == whole.content[start:end + 1]
        assert part.headers["content-range"] == f"bytes {start}-{end}/{n}"
    tail = httpx.get(url, headers={"Range": "bytes=-100"}, timeout=600)
    assert tail.status_code == 206 and tail.content == whole.content[-100:]
    past = httpx.get(url, headers={"Range": f"bytes={n}-"}, timeout=60)
    assert past.status_code == 416 and past.headers["content-range"] == f"bytes */{n}"
    return n


def test_every_signed_url_answers_head_and_byte_ranges(stack, tiny_model_dir):
    service = tinker.ServiceClient(base_url=stack.url)
    tc = service.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=7)
    tc.forward_backward(sft_data(tc.get_tokenizer(), ["ranges of bytes, as object stores serve them"]),
                        "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    state = tc.save_state("head-state").result().path
    sampler = tc.save_weights_for_sampler("head-sampler").result().path
    external = tc.save_weights_external("head-external").result().path
    rest = service.create_rest_client()

    urls = {"archive": _archive_url(stack, state), "sampler archive": _archive_url(stack, sampler),
            "merged export": _archive_url(stack, state, format="merged"),
            "trace": rest.export_session_trace(tc.model_id.rpartition(":train:")[0]).result()}
    urls.update({f"external {name}": url for name, url in rest.get_external_weights_urls(external).result().urls.items()})
    assert {"external adapter_model.safetensors", "external adapter_config.json"} <= set(urls)
    sizes = {kind: _check(url) for kind, url in urls.items()}
    assert sizes["merged export"] > sizes["archive"] > sizes["external adapter_model.safetensors"]
