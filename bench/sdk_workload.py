"""Issue 14's fixed workload, end to end through the unmodified SDK against `tinkerd up`, phase by phase.

The workload: a rank-8 LoRA training client; SFT steps (forward_backward of 4x64 tokens +
optim_step); save_weights_for_sampler + create_sampling_client(model_path=...); then 8 sequences
x 64 tokens at T=1 sampled from that trained snapshot (stop=[]: no EOS stop, so always 64).
fp32, one thread per service (the stack's default on this 2-core CPU).

Raw references in the same run, in this process, measured in turns with ours:
  SFT step  train_step.raw_step: the same model and LoRA under DeepSpeed ZeRO-2, same batch;
  sampling  vLLM configured for just this adapter (max_lora_rank 8, max_loras 1;
            adapter_sampling's engine), generating the same 8x64 at T=1 through the adapter
            tinkerd itself persisted for the snapshot (read from the stack's state dir).
The in-process vLLM joins the one-process gloo group DeepSpeed set up (init_distributed_once).
Save+sampling-client and start-up have no raw counterpart.
"""

from __future__ import annotations

import glob
import os
import time

import torch

from bench import adapter_sampling, train_step
from bench.common import Context, Row, alternately, seconds, tinkerd_up
from tinkerd.paths import dir_name

RANK = 8
N_SEQS, MAX_TOKENS = 8, 64

NOTES = [
    "sdk_workload: the SFT-step ratio on the tiny model is the API's fixed per-step cost (see train_step's "
    "note); on SmolLM2 it is the figure that counts. Sampling through the snapshot runs on the sampler as "
    "`tinkerd up` starts it (max_lora_rank 64 / max_loras 4 unless set), against raw vLLM configured for "
    "just this one rank-8 adapter: issue 14 measured the engine's LoRA configuration as the main cost.",
]


def _sdk_phases(url: str, model_dir: str, sequences: list[list[int]], prompt: list[int], n: int, max_tokens: int):
    """(create seconds, sft step fn, save+client fn -> seconds, sample fn, the training client's model id)."""
    import tinker
    from tinker import types

    t0 = time.perf_counter()
    tc = tinker.ServiceClient(base_url=url).create_lora_training_client(base_model=model_dir, rank=RANK,
                                                                        seed=0).result()
    create_s = time.perf_counter() - t0
    data = [types.Datum(model_input=types.ModelInput.from_ints(s[:-1]),
                        loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)}) for s in sequences]
    adam = types.AdamParams(learning_rate=1e-4)
    state: dict = {}

    def sft_step():
        fb = tc.forward_backward(data, "cross_entropy")
        op = tc.optim_step(adam)
        fb.result()
        op.result()

    def save_and_client() -> float:
        t = time.perf_counter()
        path = tc.save_weights_for_sampler("bench-snapshot").result().path
        state["client"] = tc.create_sampling_client(model_path=path)
        return time.perf_counter() - t

    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=[])
    model_input = types.ModelInput.from_ints(prompt)

    def sample() -> int:
        out = state["client"].sample(model_input, n, params).result()
        return sum(len(s.tokens) for s in out.sequences)
    return create_s, sft_step, save_and_client, sample, tc.model_id


def _persisted_adapter(state_dir: str, model_id: str) -> str:
    """The PEFT copy of the one snapshot save_weights_for_sampler made of `model_id`
    (<state_dir>/snapshots/<model id>@<n>..., tinkerd/paths.py; the stack may be shared)."""
    found = glob.glob(os.path.join(state_dir, "snapshots", f"{dir_name(model_id)}@*", "adapter_config.json"))
    if len(found) != 1:
        raise RuntimeError(f"expected one persisted snapshot of {model_id} under {state_dir}, found {found}")
    return os.path.dirname(found[0])


def _rows(ctx: Context, name: str, model: str) -> list[Row]:
    from transformers import AutoConfig

    sequences = train_step._batch(AutoConfig.from_pretrained(model).vocab_size)
    prompt = adapter_sampling._prompts(1)[0]
    n, max_tokens = (2, 8) if ctx.quick else (N_SEQS, MAX_TOKENS)
    case = f"{name}, rank {RANK}, fp32, 1 thread/service"
    train_step.use_threads(1)
    with tinkerd_up(ctx, f"sdk-{name}", model, "--dtype", "float32") as stack:
        create_s, sft_step, save_and_client, sample, model_id = _sdk_phases(stack.url, model, sequences, prompt, n,
                                                                            max_tokens)
        raw = train_step.raw_step(model, sequences, "float32", rank=RANK)
        ours_sft, raw_sft = alternately(lambda: seconds(sft_step), lambda: seconds(raw), ctx.iters(3, 1))
        del raw
        save_s = save_and_client()

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        llm = adapter_sampling._engine(model, RANK, 1, ctx.kv_cache_mib(model))
        raw_sample = adapter_sampling._runner(llm, False, [prompt] * n, max_tokens, _persisted_adapter(stack.state_dir, model_id),
                                              {}, "raw", temperature=1.0)
        tokens: list[int] = []

        def ours_sample() -> float:
            t = time.perf_counter()
            tokens.append(sample())
            return time.perf_counter() - t
        # tokens/s -> seconds for the same n x max_tokens (raw ignores EOS like stop=[] does)
        ours_s, raw_s = alternately(ours_sample, lambda: n * max_tokens / raw_sample(), ctx.iters(2, 1))
    assert set(tokens) == {n * max_tokens}, tokens
    return [
        Row("sdk_workload", f"{case}: tinkerd up -> ready, then create_lora_training_client",
            stack.start_seconds + create_s, None, "s", note=f"create_lora_training_client {create_s:.2f} s"),
        Row("sdk_workload", f"{case}: SFT step (forward_backward {train_step.BATCH}x{train_step.LENGTH} + optim_step)",
            ours_sft, raw_sft, "s", ratio=raw_sft / ours_sft, target=">= 0.9", note="raw: DeepSpeed ZeRO-2"),
        Row("sdk_workload", f"{case}: save_weights_for_sampler + create_sampling_client(model_path)",
            save_s, None, "s"),
        Row("sdk_workload", f"{case}: sample {n}x{max_tokens} tokens, T=1, through the trained snapshot",
            ours_s, raw_s, "s", ratio=raw_s / ours_s, target=">= 0.9",
            note=f"raw: vLLM max_lora_rank {RANK} / max_loras 1, same adapter"),
    ]


def run(ctx: Context) -> list[Row]:
    rows: list[Row] = []
    for name, model in ctx.models.items():
        rows += _rows(ctx, name, model)
    return rows
