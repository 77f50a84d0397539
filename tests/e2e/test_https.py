"""`tinkerd up --https-cert/--https-key` on a self-signed certificate made here: the official SDK
reaches the gateway over https (it trusts the certificate through SSL_CERT_FILE, as rustls and httpx
read it) on either transport it may be told to use (httpx before CPython 3.14, its default pyqwest
from 3.14: tests/e2e/test_sdk_transport.py), trains and saves checkpoints, and the download URLs it
gets (external weights' signed URLs; the archive URL older SDKs ask for) are https URLs that
download with that CA. `up` became ready at all only because its replica registered over https
(verified with --register-ca) and its own health checks trusted the certificate. Plain http to
either listener gets no answer."""

from __future__ import annotations

import http.client
import io
import os
import ssl
import subprocess
import tarfile
import urllib.error
import urllib.parse
import urllib.request

import certifi
import httpx
import pytest

from conftest import run_tinkerd, self_signed, sft_data
from harness.stack import sampler_pool
from sdk_venvs import sdk_python
from sdk_transport_run import sdk_run

pytestmark = pytest.mark.e2e


# What an SDK 0.35 user runs: RestClient.get_checkpoint_archive_url_from_tinker_path(path).url
ARCHIVE_URL_035 = ("import sys, tinker; rest = tinker.ServiceClient(base_url=sys.argv[1]).create_rest_client(); "
                   "print(rest.get_checkpoint_archive_url_from_tinker_path(sys.argv[2]).result().url)")


def test_the_sdk_trains_and_downloads_a_checkpoint_over_https(start_stack, tiny_model_dir, tmp_path, monkeypatch):
    import tinker

    cert, key = self_signed(tmp_path)
    with start_stack(tiny_model_dir, tmp_path / "state", "--https-cert", cert, "--https-key", key) as stack:
        assert stack.url.startswith("https://") and stack.internal_url.startswith("https://"), stack
        monkeypatch.setenv("SSL_CERT_FILE", cert)        # the SDK's transport trusts this certificate
        for python, pyqwest in (("3.14.0", True), ("3.11.7", False)):     # rustls accepts a leaf certificate
            config = httpx.post(f"{stack.url}/api/v1/client/config", json={"sdk_version": "0.38.0"},
                                headers={"X-API-Key": stack.api_key, "X-Stainless-Runtime": "CPython",
                                         "X-Stainless-Runtime-Version": python},
                                verify=ssl.create_default_context(cafile=cert)).json()
            assert config["use_pyqwest_transport"] is pyqwest, (python, config)
        assert sdk_run(stack.url, tiny_model_dir, "3.14", env={**os.environ, "SSL_CERT_FILE": cert}) is True
        tc = tinker.ServiceClient(base_url=stack.url).create_lora_training_client(
            base_model=tiny_model_dir, rank=8, seed=0)
        tc.forward_backward(sft_data(tc.get_tokenizer(), ["the cat sat"]), "cross_entropy").result()
        path = tc.save_state("over-https").result().path
        external = tc.save_weights_external("over-https-ext").result().path
        rest = tinker.ServiceClient(base_url=stack.url).create_rest_client()
        # SDK 0.38's signed URLs (one per file of an external_weights checkpoint) ...
        urls = list(rest.get_external_weights_urls(external).result().urls.values())
        # ... and the archive URL SDKs up to 0.35 ask for (get_checkpoint_archive_url_from_tinker_path:
        # a 302 they read without following), asked for the way they ask.
        run_id, checkpoint_id = path.removeprefix("tinker://").split("/", 1)
        redirect = httpx.get(f"{stack.url}/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id}/archive",
                             headers={"X-API-Key": stack.api_key}, verify=ssl.create_default_context(cafile=cert))
        assert redirect.status_code == 302, redirect.text
        archive = redirect.headers["location"]
        # ... and SDK 0.35 itself, pointed at https:// with the CA in SSL_CERT_FILE (0.38 has no such method).
        out = subprocess.run([sdk_python("0.35.0", torch=False), "-c", ARCHIVE_URL_035, stack.url, path],
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, "SSL_CERT_FILE": cert, "TINKER_API_KEY": stack.api_key})
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        sdk_archive = out.stdout.strip().splitlines()[-1]
        for url in (archive, sdk_archive, *urls):
            parts = urllib.parse.urlsplit(url)
            assert parts.scheme == "https" and parts.netloc == urllib.parse.urlsplit(stack.url).netloc, url

        context = ssl.create_default_context(cafile=cert)
        for url in (archive, sdk_archive):
            with urllib.request.urlopen(url, timeout=30, context=context) as r:
                with tarfile.open(fileobj=io.BytesIO(r.read())) as tar:
                    assert "adapter_model.safetensors" in tar.getnames()
        with urllib.request.urlopen(urls[0], timeout=30, context=context) as r:
            assert r.read()
        # Without the CA (public CAs only: OpenSSL's defaults would read SSL_CERT_FILE) the download is
        # refused: the certificate is really checked.
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(archive, timeout=30, context=ssl.create_default_context(cafile=certifi.where()))

        # The replica joined over https; plain http reaches neither listener.
        assert [m["alive"] for m in sampler_pool(stack, context).values()] == [True]
        for url in (stack.url, stack.internal_url):
            plain = url.replace("https://", "http://")
            with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
                urllib.request.urlopen(f"{plain}/api/v1/healthz", timeout=10)


def test_a_certificate_that_cannot_serve_is_refused_before_anything_starts(tmp_path, tiny_model_dir):
    """A file that is no PEM certificate, or the key of another certificate, killed the gateway
    after the trainer and the sampler had started (an ssl traceback in its log)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cert, _ = self_signed(tmp_path / "a")
    _, other_key = self_signed(tmp_path / "b")
    (tmp_path / "garbage.pem").write_text("not a certificate\n")
    for pair, says in (((str(tmp_path / "garbage.pem"), other_key), "PEM"), ((cert, other_key), "KEY_VALUES_MISMATCH")):
        state = tmp_path / "state"
        r = run_tinkerd("up", "--base-model", tiny_model_dir, "--port", "0", "--state-dir", str(state),
                        "--https-cert", pair[0], "--https-key", pair[1])
        assert r.returncode == 1, (r.stdout, r.stderr)
        assert f"--https-cert {pair[0]} with --https-key {pair[1]} cannot serve HTTPS" in r.stderr, r.stderr
        assert says in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert not state.exists()
