"""A checkpoint's LoRA merged into the base model: a full model directory any server loads as a
plain model (the archive's `?format=merged`, gateway/routes/checkpoints.py).

Why it exists (docs/compatibility.md, "Taking adapters elsewhere"): our adapters target the
output layer (`lm_head`, Tinker's train_unembed, on by default) besides attention and MLP, and
not every server takes a LoRA there: vLLM 0.32 serves one only for architectures declaring it
(Llama, Qwen3, ...), and refuses the adapter for others (Qwen2, Gemma 2/3, Phi-3: "expected
target modules in ... but received [lm_head]"). Merged weights need no LoRA support at all.

What it holds: the base directory's small files (config, tokenizer, generation config), one
`model.safetensors` with every base weight, W + (alpha / r) * B @ A where the adapter has a
delta (computed in float64, rounded once to the weight's stored dtype), and TINKERD_EXPORT.md.
A base model that ties lm_head to the input embeddings gets an lm_head of its own when the
adapter changes it (embeddings + delta; config.json then says tie_word_embeddings: false): a
delta on the output layer must not change the input embeddings.

`plan` reads headers only (no tensor data, no torch) and refuses, as a UserError, an adapter it
cannot merge, so the route can answer before it redirects. The file is made as it is sent,
`ROWS_BYTES` of output rows at a time: memory stays bounded whatever the model's size.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from typing import Iterator

from tinkerd.errors import UserError

WEIGHTS = "model.safetensors"
NOTES = "TINKERD_EXPORT.md"
ROWS_BYTES = 16 << 20               # output rows merged and sent at a time
_PEFT_PREFIX = "base_model.model."
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")
_SMALL_FILE_BYTES = 256 << 20       # base files copied as they are (tokenizers are tens of MB)
ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str                       # in the merged file
    source: str                     # the base weight it starts from
    file: str                       # the base .safetensors file holding `source`
    dtype: str                      # safetensors code, the base weight's
    shape: tuple[int, ...]
    module: str | None              # the adapter module whose delta is added, if any

    @property
    def num_bytes(self) -> int:
        n = ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclasses.dataclass(frozen=True)
class Plan:
    base_model_dir: str
    adapter_dir: str
    tensors: list[Tensor]
    config: dict                    # the base config.json, untied where needed
    scale: float
    untied: bool                    # lm_head made separate from the tied input embeddings
    small_files: list[str]          # base files copied as they are

    def header(self) -> bytes:
        """The merged file's safetensors header: its length (8 bytes) and JSON, padded to 8."""
        entries, offset = {"__metadata__": {"format": "pt"}}, 0
        for t in self.tensors:
            entries[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.num_bytes]}
            offset += t.num_bytes
        text = json.dumps(entries, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        return struct.pack("<Q", len(text)) + text

    @property
    def weights_size(self) -> int:
        return len(self.header()) + sum(t.num_bytes for t in self.tensors)


def read_header(path: str) -> dict:
    """A .safetensors file's header (names -> dtype, shape, offsets), without its data."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 << 20:
                raise ValueError(f"header of {n} bytes")
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise UserError(f"cannot read the safetensors file {os.path.basename(path)}: {e}") from None
    header.pop("__metadata__", None)
    return header


def lora_scale(config: dict) -> float:
    rank = config["r"]
    alpha = config.get("lora_alpha", rank)
    return alpha / rank ** 0.5 if config.get("use_rslora") else alpha / rank


def _adapter_modules(adapter_dir: str, config: dict) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Module name (as in the base checkpoint, without `.weight`) -> (A's shape, B's shape)."""
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora"):
        raise UserError("only plain LoRA adapters can be merged (this one is DoRA or not LoRA)")
    if config.get("rank_pattern") or config.get("alpha_pattern") or config.get("modules_to_save"):
        raise UserError("adapters with per-module ranks, alphas or saved modules cannot be merged here")
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, info in read_header(os.path.join(adapter_dir, "adapter_model.safetensors")).items():
        module, _, kind = name.removeprefix(_PEFT_PREFIX).rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise UserError(f"adapter tensor {name!r} is not a LoRA A or B matrix: cannot merge it")
        pairs.setdefault(module, {})[kind[0]] = tuple(info["shape"])
    if incomplete := [m for m, ab in pairs.items() if set(ab) != {"A", "B"}]:
        raise UserError(f"adapter module {incomplete[0]!r} lacks its lora_A or lora_B")
    return {m: (ab["A"], ab["B"]) for m, ab in pairs.items()}


def tied(config: dict) -> bool:
    """Whether the model ties its output layer to its input embeddings (a config.json without the
    key ties them: transformers' default)."""
    text = config.get("text_config") or {}
    return bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", True)))


def _untie(config: dict) -> dict:
    config = {**config, "tie_word_embeddings": False}
    if isinstance(config.get("text_config"), dict) and "tie_word_embeddings" in config["text_config"]:
        config["text_config"] = {**config["text_config"], "tie_word_embeddings": False}
    return config


def _base_weights(base_model_dir: str) -> dict[str, tuple[str, dict]]:
    files = sorted(f for f in os.listdir(base_model_dir) if f.endswith(".safetensors"))
    if not files:       # e.g. PyTorch .bin weights only
        raise UserError("the base model has no .safetensors weights to merge into")
    weights = {name: (os.path.join(base_model_dir, f), info)
               for f in files for name, info in read_header(os.path.join(base_model_dir, f)).items()}
    if odd := sorted(n for n, (_, info) in weights.items() if info.get("dtype") not in ITEMSIZE):
        raise UserError(f"the base weight {odd[0]} has dtype {weights[odd[0]][1].get('dtype')}, which this "
                        f"export does not handle (it handles {', '.join(ITEMSIZE)})")
    return weights


def plan(base_model_dir: str, adapter_dir: str) -> Plan:
    """What the merged export of the adapter at `adapter_dir` holds; a UserError saying why where
    it cannot be merged into this base model."""
    try:
        with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
            adapter_config = json.load(f)
        with open(os.path.join(base_model_dir, "config.json")) as f:
            config = json.load(f)
    except OSError as e:
        raise UserError(f"cannot merge this checkpoint: {os.path.basename(e.filename or '?')} is missing "
                        f"or unreadable") from None
    except ValueError as e:
        raise UserError(f"cannot merge this checkpoint: a config is not JSON ({e})") from None
    modules = _adapter_modules(adapter_dir, adapter_config)
    base = _base_weights(base_model_dir)
    tensors = [Tensor(name, name, file, info["dtype"], tuple(info["shape"]), None) for name, (file, info) in base.items()]
    # A tied output layer gets a weight of its own when the adapter changes it (module doc).
    untied = "lm_head" in modules and tied(config)
    if untied:
        config = _untie(config)
    if untied and "lm_head.weight" not in base:
        if "model.embed_tokens.weight" not in base:
            raise UserError("the base model ties lm_head to embeddings this export cannot find "
                            "(no model.embed_tokens.weight): cannot merge an lm_head LoRA into it")
        file, info = base["model.embed_tokens.weight"]
        tensors.append(Tensor("lm_head.weight", "model.embed_tokens.weight", file, info["dtype"],
                              tuple(info["shape"]), None))
    by_name = {t.name: i for i, t in enumerate(tensors)}
    for module, (a, b) in modules.items():
        i = by_name.get(f"{module}.weight")
        if i is None:
            raise UserError(f"the adapter's module {module!r} has no weight {module}.weight in the base model")
        t = tensors[i]
        if t.dtype not in ("F32", "BF16", "F16") or t.shape != (b[0], a[1]) or a[0] != b[1]:
            raise UserError(f"the adapter's module {module!r} ({b[0]}x{a[1]}) does not fit the base weight "
                            f"{t.name} ({'x'.join(map(str, t.shape))} {t.dtype})")
        tensors[i] = dataclasses.replace(t, module=module)
    small = sorted(f for f in os.listdir(base_model_dir)
                   if os.path.isfile(os.path.join(base_model_dir, f)) and not f.endswith(_WEIGHT_SUFFIXES)
                   and f not in ("config.json", NOTES) and not f.endswith(".index.json")
                   and os.path.getsize(os.path.join(base_model_dir, f)) <= _SMALL_FILE_BYTES)
    return Plan(base_model_dir, adapter_dir, tensors, config, lora_scale(adapter_config), untied, small)


def weights_chunks(p: Plan, offset: int = 0) -> Iterator[bytes]:
    """The merged model.safetensors from byte `offset` on, as it is made (see the module doc). A
    ranged download starts at the block of rows holding its first byte: the blocks are the full
    file's, so its bytes are the same, and nothing before that block is made."""
    from safetensors import safe_open

    header = p.header()
    if offset < len(header):
        yield header[offset:]
    at = len(header)                # where the next tensor starts in the file
    adapter = os.path.join(p.adapter_dir, "adapter_model.safetensors")
    with safe_open(adapter, framework="pt") as lora:
        for t in p.tensors:
            skip, at = offset - at, at + t.num_bytes        # skip: its bytes before `offset`
            if t.num_bytes == 0 or at <= offset:
                continue
            skip = max(skip, 0)
            with safe_open(t.file, framework="pt") as f:
                if t.module is None and len(t.shape) < 2:
                    yield _raw(f.get_tensor(t.source))[skip:]
                    continue
                source = f.get_slice(t.source)
                a = b = None
                if t.module is not None:
                    a = lora.get_tensor(f"{_PEFT_PREFIX}{t.module}.lora_A.weight").double()
                    b = lora.get_tensor(f"{_PEFT_PREFIX}{t.module}.lora_B.weight").double()
                row_bytes = t.num_bytes // t.shape[0]
                rows = max(1, ROWS_BYTES // max(1, row_bytes))
                first = skip // row_bytes // rows * rows
                skip -= first * row_bytes
                for start in range(first, t.shape[0], rows):
                    block = source[start:start + rows]
                    if a is not None:
                        dtype = block.dtype
                        # In float64: the rounding to the stored dtype is the only one, and the
                        # bytes do not depend on how many rows a block holds.
                        block = block.double().addmm_(b[start:start + rows], a, alpha=p.scale).to(dtype)
                    data = _raw(block)
                    yield data[skip:] if skip else data
                    skip = 0


def _raw(tensor) -> bytes:
    import torch

    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def notes(p: Plan, tinker_path: str) -> str:
    """TINKERD_EXPORT.md of the merged archive: what it is, and why it exists."""
    merged = sorted({t.module for t in p.tensors if t.module})
    tie_note = ("\nThe base model ties its output layer to the input embeddings; the adapter changes the output "
            "layer, so this export has an `lm_head.weight` of its own (the embeddings plus the delta) and "
            "config.json says `tie_word_embeddings: false`.\n" if p.untied else "")
    return (f"# {tinker_path}, merged\n\n"
            f"The base model ({os.path.basename(os.path.normpath(p.base_model_dir))}) with the LoRA adapter of "
            f"`{tinker_path}` merged into its weights: W + {p.scale:g} * B @ A (alpha / r), computed in float64 "
            f"and rounded once to each weight's stored dtype. {len(merged)} modules carry a delta.\n"
            f"{tie_note}\n"
            "## Why a merged export\n\n"
            "The adapter as trained (the default archive, PEFT format) loads in PEFT "
            "(`PeftModel.from_pretrained`) and in vLLM's LoRA path (`LoRARequest`) for architectures "
            "whose LoRA support covers every target module. tinkerd's adapters also train the output layer "
            "(`lm_head`, train_unembed) unless created with train_unembed=False, and vLLM serves an "
            "lm_head LoRA only for architectures declaring it (Llama, Qwen3, Granite among them); others "
            "(Qwen2, Gemma 2/3, Phi-3) refuse the adapter. This directory is a plain model: any server "
            "loads it without LoRA support, e.g. `vllm serve <dir>` or `AutoModelForCausalLM.from_pretrained`.\n\n"
            "Logprobs match tinkerd's sampler within the stored dtype's rounding of W + delta "
            "(float32: within 1e-4; a bfloat16 base rounds each merged weight to bfloat16).\n")
