"""Runtime code says why, not what a lab measured: no model names, core counts, machine
descriptions, issue numbers, dates or measured figures in the runtime packages (their settings
modules, generated stubs and migrations aside). A choice that rests on a measurement says why in
a line and links to docs/benchmarks.md, "Measurements behind the code", where the figure, the
machine and the date live; and that page stays a reference: every benchmark's current figure,
in at most 25 KB."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest
from test_readme import _anchors

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUNTIME = ["gateway", "trainer_service", "sampler_service", "tinkerd", "launcher"]
# Settings modules hold defaults and their help, which may say what a default was measured on.
SETTINGS = ["gateway/settings.py", "trainer_service/settings.py", "sampler_service/settings.py", "tinkerd/settings.py"]
BENCHMARKS_PAGE = ROOT / "docs" / "benchmarks.md"

# What a lab note looks like. Architecture names in code (`LlamaDecoderLayer`, "llama" as a
# model_type, "Qwen2, Gemma 2/3" in what an export supports) are not notes: a model name is a
# named checkpoint (a family with its size, or SmolLM/TinyLlama/Llama-N).
LAB_NOTES = {
    "model name": re.compile(r"\bSmolLM[\w.-]*|\bTinyLlama\b|\bLlama[- ]?\d"
                             r"|\b(?:Qwen|Mistral|Mixtral|Gemma|Phi|Granite|DeepSeek)[\w.-]*?-\d+(?:\.\d+)?[BM]\b"),
    "core count": re.compile(r"\b(?:\d+|one|two|four|eight|sixteen)[- ](?:shared |busy )?cores?\b|\b\d+ v?CPUs\b", re.I),
    "machine": re.compile(r"\b(?:H100|H200|A100|A10G|Xeon|EPYC|Zen ?\d)\b|\bVMs?\b"),
    # The project's own issues have up to 3 digits; an upstream bug (vLLM #51594) is a fair reference.
    "issue number": re.compile(r"\bissues? #?\d{1,3}\b|\(#\d{1,3}\)", re.I),
    "date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
    "measurement": re.compile(
        r"\bmeasured\b[^.;\n]{0,80}?\d[\d,.]*\s?(?:ms|s|µs|us|MiB|GiB|MB|GB|x|×)(?!\w)"
        r"|\d[\d,.]*\s?(?:ms|s|µs|us|MiB|GiB|MB|GB|x|×)?\s?(?:->|→)\s?\d[\d,.]*\s?(?:ms|s|µs|us|MiB|GiB|MB|GB|x|×)(?!\w)",
        re.I),
}
# Mentions that are not notes, with the reason.
ALLOWED = {
    ("launcher/cli.py", "SmolLM2-135M-Instruct"): "what `tinkerd fetch-smollm2` downloads: the command's subject",
}
_DOC_LINK = re.compile(r"docs/benchmarks\.md#([\w-]+)")


def _runtime_files() -> list[pathlib.Path]:
    files = []
    for package in RUNTIME:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in SETTINGS or "_pb2" in path.name or "/migrations/" in rel:
                continue
            files.append(path)
    return files


def lab_notes(text: str, rel: str = "") -> list[str]:
    """`line: kind 'text'` for every lab note in `text`."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for kind, pattern in LAB_NOTES.items():
            for match in pattern.finditer(line):
                if (rel, match.group(0)) not in ALLOWED:
                    found.append(f"{number}: {kind} {match.group(0)!r}")
    return found


def test_the_settings_modules_left_out_exist():
    assert all((ROOT / rel).is_file() for rel in SETTINGS), SETTINGS


def test_runtime_code_holds_no_lab_notes():
    notes = {}
    for path in _runtime_files():
        rel = path.relative_to(ROOT).as_posix()
        if found := lab_notes(path.read_text(), rel):
            notes[rel] = found
    assert not notes, ("say why in a line and link docs/benchmarks.md#measurements-behind-the-code "
                       f"for the figure: {notes}")


@pytest.mark.parametrize("line", [
    "# a rank-32 merge of SmolLM2, 2 cores: 0.85 -> 0.43 s",
    "Llama 3 1B at 8x512 (2.1 GB of logits)",
    "measured on a Qwen2.5-0.5B",
    "on a 2-core host a forward_backward reached the trainer sooner",
    "(4 CPUs, no GPU)",
    "on an AMX VM",
    "one (H100)",
    "seen on the tiny model, bf16, issue 23",
    "(#57)",
    "(2026-11-29, bench/trainer_only)",
    "touching fresh memory (measured 17-44 ms vs 12 ms for 45 MB)",
    "model itself (measured 4x on the tiny model)",
])
def test_a_lab_note_is_found(line):
    assert lab_notes(line), line


@pytest.mark.parametrize("line", [
    'PRE_NORM_LAYERS = {"LlamaDecoderLayer", "Qwen2DecoderLayer", "MistralDecoderLayer"}',
    'PLAIN_HEADS = frozenset({"llama", "mistral", "qwen2", "qwen3"})',
    "lm_head LoRA only for architectures declaring it (Llama, Qwen3, Granite); others (Qwen2, Gemma 2/3, Phi-3)",
    "tinkerd fetch-smollm2 DIR",
    "on a GPU the lm_head delta is dropped, vLLM issue #51594",
    "concurrent requests of one service get lanes #2, #3, ...",
    'idempotency_key=f"{loss_id}#0"',
    "each computing thread takes cores // busy threads; the host's cores, one thread per core",
    "a 1B model's fp32 logits alone are 2.1 GB",
])
def test_what_is_not_a_lab_note(line):
    assert not lab_notes(line), line


def test_runtime_links_to_the_benchmarks_page_resolve():
    anchors = _anchors(BENCHMARKS_PAGE)
    broken = {}
    for path in _runtime_files():
        if missing := [a for a in _DOC_LINK.findall(path.read_text()) if a not in anchors]:
            broken[path.relative_to(ROOT).as_posix()] = missing
    assert not broken, broken


def _bench_names() -> list[str]:
    """`python -m bench`'s benchmarks (bench/__main__.py BENCHMARKS), read without importing it."""
    tree = ast.parse((ROOT / "bench" / "__main__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "BENCHMARKS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("bench/__main__.py has no BENCHMARKS list")


def test_the_benchmarks_page_is_a_reference():
    text = BENCHMARKS_PAGE.read_text()
    assert len(text.encode()) <= 25 * 1024, f"docs/benchmarks.md is {len(text.encode())} bytes (limit 25 KB)"
    sections = dict(re.findall(r"^### (\w+)\n(.*?)(?=^##|\Z)", text, re.M | re.S))
    for name in [*_bench_names(), "trainer_only", "rl_loop", "allocator"]:
        assert name in sections, f"docs/benchmarks.md has no section '### {name}'"
        body = sections[name]
        assert "python -m bench" in body, f"{name}: no command that reproduces it"
        assert re.search(r"^\| .*machine, date \|$", body, re.M), f"{name}: no table with the machine and date"
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", body), f"{name}: no dated figure"
