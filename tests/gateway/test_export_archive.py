"""The checkpoint archive's formats (issue 26, "adapters that serve anywhere"), in process on
fake backends with a real base model and a real PEFT adapter: the PEFT archive carries
TINKERD_EXPORT.md; `?format=merged` is a full model whose logits equal PEFT's adapter on the base
(float32), also where the base ties lm_head to the embeddings; and the user errors."""

import io
import json
import os
import shutil
import tarfile
import urllib.parse

import pytest
import torch

from gateway.storage.db import CheckpointRow
from gateway_fakes import assert_user_error, gateway  # noqa: F401 - the fixture
from tinkerd import merged_export
from tinkerd.errors import UserError

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def _base(directory, *, tied: bool, intermediate: int = 96):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=intermediate, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=tied)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:     # a small file it copies
        json.dump({"model_max_length": 64}, f)
    return model


def _adapter(base, directory, targets=TARGETS):
    """A rank-4 adapter as tinkerd writes one (alpha 32), with random A and B (B is 0 at init)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=32, target_modules=targets, init_lora_weights=False))
    peft.save_pretrained(directory, save_embedding_layers=False)     # as trainer_service/checkpoints.py
    return peft


def _saved(gateway, name="c"):
    """A checkpoint through the routes (the fake trainer writes placeholder files)."""
    api = gateway.api
    model_id = api.model(api.session())
    path = api.result(api.post("save_weights", {"model_id": model_id, "seq_id": 1, "path": name}).json()).json()["path"]
    return model_id, api.client.app.state.gateway.db.get(CheckpointRow, path).directory


def _download(api, model_id, name, **params):
    redirect = api.get(f"training_runs/{model_id}/checkpoints/weights/{name}/archive", params=params,
                       follow_redirects=False)
    assert redirect.status_code == 302, redirect.text
    url = urllib.parse.urlsplit(redirect.headers["location"])
    got = api.client.get(f"{url.path}?{url.query}")
    assert got.status_code == 200, got.text
    assert int(got.headers["content-length"]) == len(got.content)
    return tarfile.open(fileobj=io.BytesIO(got.content)), url


def _logits(model, ids):
    """Log-probabilities of the whole vocabulary at every position."""
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)


@pytest.mark.parametrize("tied", [False, True])
def test_merged_archive_is_a_full_model_equal_to_the_adapter(gateway, tmp_path, tied):
    from transformers import AutoModelForCausalLM

    base_dir = gateway.settings.base_model
    peft = _adapter(_base(base_dir, tied=tied), tmp_path / "adapter")
    model_id, directory = _saved(gateway)
    for f in ("adapter_model.safetensors", "adapter_config.json"):
        shutil.copy(tmp_path / "adapter" / f, os.path.join(directory, f))

    peft_tar, _ = _download(gateway.api, model_id, "c")
    assert {"adapter_config.json", "adapter_model.safetensors", "TINKERD_EXPORT.md"} <= set(peft_tar.getnames())
    notes = peft_tar.extractfile("TINKERD_EXPORT.md").read().decode()
    assert "lm_head" in notes and "?format=merged" in notes

    merged_tar, url = _download(gateway.api, model_id, "c", format="merged")
    assert url.path.endswith("/merged.tar")
    merged_tar.extractall(tmp_path / "merged", filter="data")
    out = tmp_path / "merged"
    assert {"config.json", "model.safetensors", "tokenizer_config.json", "TINKERD_EXPORT.md",
            "checkpoint_complete"} <= set(os.listdir(out))
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False          # tied: lm_head got a weight of its own
    assert ("an `lm_head.weight` of its own" in (out / "TINKERD_EXPORT.md").read_text()) == tied

    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 33, 70, 2, 95, 40]])
    expected, got = _logits(peft, ids), _logits(merged, ids)
    with peft.disable_adapter():
        assert (expected - _logits(peft, ids)).abs().max() > 1e-2       # the adapter matters
    assert (expected - got).abs().max() < 1e-4           # float32: W + delta summed in another order
    # The embeddings stay the base's: a delta on the output layer does not leak into the input.
    assert torch.equal(merged.model.embed_tokens.weight, peft.get_base_model().model.embed_tokens.weight)


def test_merged_weights_are_made_in_bounded_row_blocks(tmp_path, monkeypatch):
    """Rows merged a few at a time give the same file as one block per weight."""
    _adapter(_base(tmp_path / "base", tied=True), tmp_path / "adapter")
    plan = merged_export.plan(str(tmp_path / "base"), str(tmp_path / "adapter"))
    whole = b"".join(merged_export.weights_chunks(plan))
    monkeypatch.setattr(merged_export, "ROWS_BYTES", 1000)
    chunks = list(merged_export.weights_chunks(plan))
    assert b"".join(chunks) == whole and len(whole) == plan.weights_size
    assert max(len(c) for c in chunks[1:]) <= 96 * 4 * 3          # a few rows of the widest weight


def test_archive_format_user_errors(gateway, tmp_path):
    api = gateway.api
    model_id, directory = _saved(gateway)
    archive = f"training_runs/{model_id}/checkpoints/weights/c/archive"
    assert_user_error(api.get(archive, params={"format": "gguf"}, follow_redirects=False), 400, "format", "merged")
    # No base model to merge into, then one with PyTorch .bin weights only.
    assert_user_error(api.get(archive, params={"format": "merged"}, follow_redirects=False), 400,
                      "cannot merge", "missing")
    os.makedirs(gateway.settings.base_model)
    with open(os.path.join(gateway.settings.base_model, "config.json"), "w") as f:
        json.dump({"model_type": "llama"}, f)
    (tmp_path / "w.bin").write_bytes(b"")
    shutil.copy(tmp_path / "w.bin", os.path.join(gateway.settings.base_model, "pytorch_model.bin"))
    # (the fake trainer's placeholder adapter is no safetensors file at all)
    assert_user_error(api.get(archive, params={"format": "merged"}, follow_redirects=False), 400, "adapter_config.json")
    # An adapter trained on another base model: a weight of another shape.
    _adapter(_base(tmp_path / "other", tied=False), tmp_path / "adapter")
    for f in ("adapter_model.safetensors", "adapter_config.json"):
        shutil.copy(tmp_path / "adapter" / f, os.path.join(directory, f))
    assert_user_error(api.get(archive, params={"format": "merged"}, follow_redirects=False), 400, ".safetensors")
    _base(gateway.settings.base_model, tied=False, intermediate=48)
    assert_user_error(api.get(archive, params={"format": "merged"}, follow_redirects=False), 400,
                      "does not fit the base weight")
    # A forged or swapped link: the merged path's signature is not the PEFT archive's.
    redirect = api.get(archive, follow_redirects=False)
    url = urllib.parse.urlsplit(redirect.headers["location"])
    assert api.client.get(f"{url.path.replace('archive.tar', 'merged.tar')}?{url.query}").status_code == 404


def test_plan_refuses_what_it_cannot_merge(tmp_path):
    base = _base(tmp_path / "base", tied=False)
    _adapter(base, tmp_path / "adapter", targets=["q_proj"])
    config_path = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    for change, words in (({"use_dora": True}, "DoRA"), ({"rank_pattern": {"q_proj": 2}}, "per-module"),
                          ({"peft_type": "IA3"}, "LoRA")):
        config_path.write_text(json.dumps({**config, **change}))
        with pytest.raises(UserError, match=words):
            merged_export.plan(str(tmp_path / "base"), str(tmp_path / "adapter"))
    config_path.write_text(json.dumps(config))
    from safetensors.torch import save_file
    save_file({"scale": torch.zeros(2, dtype=torch.float8_e4m3fn)}, str(tmp_path / "base" / "extra.safetensors"))
    with pytest.raises(UserError, match="dtype F8_E4M3, which this export does not handle"):
        merged_export.plan(str(tmp_path / "base"), str(tmp_path / "adapter"))
    (tmp_path / "adapter" / "adapter_model.safetensors").write_bytes(b"\xff" * 8 + b"{")
    with pytest.raises(UserError, match="cannot read the safetensors file"):
        merged_export.plan(str(tmp_path / "base"), str(tmp_path / "adapter"))


def _mergeable(gateway, tmp_path):
    """A checkpoint with a real adapter of the base model, and its merged download's signed URL."""
    _adapter(_base(gateway.settings.base_model, tied=False), tmp_path / "adapter")
    model_id, directory = _saved(gateway)
    for f in ("adapter_model.safetensors", "adapter_config.json"):
        shutil.copy(tmp_path / "adapter" / f, os.path.join(directory, f))
    row = gateway.api.client.app.state.gateway.db.get(CheckpointRow, f"tinker://{model_id}/weights/c")
    redirect = gateway.api.get(f"training_runs/{model_id}/checkpoints/weights/c/archive",
                               params={"format": "merged"}, follow_redirects=False)
    return row, urllib.parse.urlsplit(redirect.headers["location"])


def test_merged_exports_at_once_are_capped_with_a_429(gateway, tmp_path, monkeypatch):
    """Merging takes the gateway's CPU: beyond MAX_MERGED_EXPORTS in progress a download is a 429
    with Retry-After; a finished one, or one dropped unread, frees its place."""
    from gateway import export

    monkeypatch.setattr(export, "MAX_MERGED_EXPORTS", 1)
    row, url = _mergeable(gateway, tmp_path)
    limits = gateway.api.client.app.state.gateway.limits
    held = export.take_place(limits, "x").stream(export.merged_archive(gateway.settings.base_model, row).chunks())
    next(held)
    busy = gateway.api.client.get(f"{url.path}?{url.query}")
    assert busy.status_code == 429 and busy.headers["retry-after"] == "30"
    assert "the limit is 1" in busy.json()["error"]
    for _ in held:            # it finishes
        pass
    assert gateway.api.client.get(f"{url.path}?{url.query}").status_code == 200
    dropped = export.take_place(limits, "x").stream(export.merged_archive(gateway.settings.base_model, row).chunks())
    del dropped               # never read
    _places_become(limits, 0)
    assert gateway.api.client.get(f"{url.path}?{url.query}").status_code == 200


def test_one_owner_takes_one_merged_export_place(gateway, tmp_path, monkeypatch):
    """Two slow downloads of one user's checkpoints would block everyone's merged exports: one
    owner's checkpoints take at most MAX_MERGED_EXPORTS_PER_OWNER places; others' still get theirs."""
    from gateway import export

    monkeypatch.setattr(export, "MAX_MERGED_EXPORTS", 3)
    row, url = _mergeable(gateway, tmp_path)
    limits = gateway.api.client.app.state.gateway.limits
    others = export.take_place(limits, "another-user").stream(
        export.merged_archive(gateway.settings.base_model, row).chunks())
    next(others)
    assert gateway.api.client.get(f"{url.path}?{url.query}").status_code == 200      # a place of its own
    mine = export.take_place(limits, row.owner).stream(export.merged_archive(gateway.settings.base_model, row).chunks())
    next(mine)
    busy = gateway.api.client.get(f"{url.path}?{url.query}")
    assert busy.status_code == 429 and "this user's checkpoints" in busy.json()["error"]
    del others, mine


def _places_become(limits, n: int, timeout_s: float = 10.0) -> None:
    """The database holds `n` merged-export places (a dropped place's row goes in a thread)."""
    import time

    from sqlalchemy import select

    from gateway.storage.db import ExportPlaceRow

    deadline = time.monotonic() + timeout_s
    while limits.db.count(select(ExportPlaceRow)) != n:
        assert time.monotonic() < deadline, limits.db.count(select(ExportPlaceRow))
        time.sleep(0.05)


def test_a_burst_of_merged_exports_over_two_gateways_takes_the_owners_places_exactly(db_url, tmp_path, monkeypatch):
    """An owner's places are counted in the database, in the transaction that takes one: 12
    downloads of one owner's checkpoints at once, over two gateways on one database, get exactly
    the per-owner limit; the rest are 429s. A place freed on one gateway is free on the other, and
    one whose gateway went away (its lease not renewed) is free once its lease lapses."""
    import concurrent.futures
    import datetime
    import threading

    from gateway import export
    from gateway.identity.limits import Limits, OverLimit
    from gateway.settings import GatewaySettings
    from gateway.storage.db import Database, ExportPlaceRow

    monkeypatch.setattr(export, "MAX_MERGED_EXPORTS", 100)          # this process plays both gateways
    monkeypatch.setattr(export, "MAX_MERGED_EXPORTS_PER_OWNER", 2)
    settings = GatewaySettings(base_model="m", trainer="t", state_dir=str(tmp_path))
    limits = [Limits(settings, Database(db_url)), Limits(settings, Database(db_url))]
    start = threading.Barrier(12)

    def take(i: int):
        start.wait()
        try:
            return export.take_place(limits[i % 2], "owner-a")
        except OverLimit as e:
            return e

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        outcomes = list(pool.map(take, range(12)))
    places = [o for o in outcomes if isinstance(o, export.Place)]
    refusals = [o for o in outcomes if not isinstance(o, export.Place)]
    assert len(places) == 2 and len(refusals) == 10, outcomes
    assert all(isinstance(e, OverLimit) and "the limit is 2 at a time, on every gateway" in str(e) for e in refusals)
    _places_become(limits[0], 2)                  # a refusal left no row behind
    other = export.take_place(limits[1], "owner-b")            # another owner's count is their own
    places[0].release()                                         # freed on one gateway ...
    again = export.take_place(limits[1 if places[0].db is limits[0].db else 0], "owner-a")   # ... taken on the other
    with pytest.raises(OverLimit):
        export.take_place(limits[0], "owner-a")
    # A gateway gone mid-download: its row stays, unrenewed, until its lease lapses.
    gone = places[1]
    gone.held.detach()
    limits[0].db.touch(ExportPlaceRow, gone.place_id,
                       lease_until=datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=1))
    taken = export.take_place(limits[1], "owner-a")
    for place in (other, again, taken):
        place.release()
    _places_become(limits[0], 0)
