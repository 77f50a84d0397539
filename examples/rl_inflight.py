"""An RL loop through the unmodified Tinker SDK against `tinkerd up`, on-policy and off-policy by one
step with an inflight sampling client.

The task is tinker-cookbook's arithmetic environment (recipes/math_rl/arithmetic_env.py): "What is
x + y?" for x, y in 0..100 after one worked example, in the cookbook's `role_colon` format; a rollout
earns 1 when the last integer of its answer is the sum, less 0.1 when it did not end with the stop
sequence. Each step samples GROUPS problems x GROUP_SIZE rollouts, centres the rewards within each
group (the advantage of every sampled token) and trains one step of the `importance_sampling` loss
(the cookbook's default: -exp(logp - logq) * advantage, q the sampler's logprob of the token).

  on-policy  each step saves the current weights as a snapshot, samples the batch from it, then
             trains on it: sampling and training take turns.
  inflight   one client from `save_weights_and_get_sampling_client(kind="inflight")`, made once;
             each step submits the next batch's samples before it trains on this one, then saves
             inflight again, which the same client follows (no new client). Batch t+1 is sampled
             while step t trains, from the weights before it: off-policy by one step, which the
             importance ratio corrects for.

    tinkerd up --base-model DIR                     # prints the URL; TINKER_API_KEY=<a key>
    python examples/rl_inflight.py --base-url http://127.0.0.1:8000 --base-model DIR --mode inflight

Each step prints a line; the last line printed is a JSON summary (bench/rl_inflight.py runs run()).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import statistics
import time
from concurrent.futures import Future

STOP = "\n\nUser:"
FEWSHOT = "User: What is 4 + 5?\n\nAssistant: 9\n\n"
INTEGER = re.compile(r"-?\d+")
MODES = ("on-policy", "inflight")


@dataclasses.dataclass
class Config:
    steps: int = 8
    groups: int = 8                 # problems per step
    group_size: int = 8             # rollouts per problem
    max_tokens: int = 12
    rank: int = 32
    learning_rate: float = 1e-4
    seed: int = 0


@dataclasses.dataclass
class Step:
    seconds: float                  # wall time of the step, sampling wait and training
    sample_wait: float              # of which waiting for this step's samples
    reward: float                   # mean reward of the batch trained on
    kl_sample_train: float          # mean (sampler's logprob - trainer's) over sampled tokens


def reward(text: str, x: int, y: int, stopped: bool) -> float:
    """The cookbook's: 1 for the right last integer, format_coef 0.1 off without the stop sequence."""
    found = INTEGER.findall(text.split(STOP)[0].replace(",", ""))
    return float(bool(found) and int(found[-1]) == x + y) - (0.0 if stopped else 0.1)


class Batch:
    """One step's problems and their sampling requests (futures, in flight until collect())."""

    def __init__(self, client, tokenizer, cfg: Config, rng: random.Random):
        from tinker import types

        self.tokenizer = tokenizer
        self.problems = [(rng.randint(0, 100), rng.randint(0, 100)) for _ in range(cfg.groups)]
        self.prompts = [tokenizer.encode(f"{FEWSHOT}User: What is {x} + {y}?\n\nAssistant:", add_special_tokens=False)
                        for x, y in self.problems]
        params = types.SamplingParams(max_tokens=cfg.max_tokens, temperature=1.0, stop=[STOP])
        self.futures: list[Future] = [client.sample(types.ModelInput.from_ints(p), cfg.group_size, params)
                                      for p in self.prompts]

    def collect(self) -> tuple[list, list[list[float]], float]:
        """The training data (one datum per rollout, advantages centred per group), each datum's
        sampled tokens' logprobs, and the batch's mean reward."""
        from tinker import types

        data, sampled, rewards = [], [], []
        for (x, y), prompt, future in zip(self.problems, self.prompts, self.futures):
            sequences = future.result().sequences
            got = [reward(self.tokenizer.decode(s.tokens), x, y, s.stop_reason == "stop") for s in sequences]
            mean = statistics.fmean(got)
            rewards += got
            for s, r in zip(sequences, got):
                tokens = prompt + list(s.tokens)
                n_prompt = len(prompt) - 1          # targets are shifted by one: the prompt's after its first
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": tokens[1:],
                                    "logprobs": [0.0] * n_prompt + list(s.logprobs),
                                    "advantages": [0.0] * n_prompt + [r - mean] * len(s.tokens)}))
                sampled.append(list(s.logprobs))
        return data, sampled, statistics.fmean(rewards)


def kl_sample_train(sampled: list[list[float]], outputs) -> float:
    """Mean of the sampler's logprob minus the trainer's over the sampled tokens (the cookbook's
    kl_sample_train_v1: ~0 on-policy in fp32, the policy's drift when the samples are a step old)."""
    diffs = []
    for q, out in zip(sampled, outputs):
        lp = out["logprobs"].to_numpy()
        diffs += [a - b for a, b in zip(q, lp[len(lp) - len(q):])] if q else []
    return float(statistics.fmean(diffs)) if diffs else 0.0


def train(tc, data, cfg: Config):
    """One importance-sampling step; the trainer's outputs, per datum."""
    from tinker import types

    fb = tc.forward_backward(data, "importance_sampling")
    op = tc.optim_step(types.AdamParams(learning_rate=cfg.learning_rate))
    outputs = fb.result().loss_fn_outputs
    op.result()
    return outputs


def on_policy(tc, tokenizer, cfg: Config, rng: random.Random, report) -> list[Step]:
    steps = []
    for _ in range(cfg.steps):
        t0 = time.perf_counter()
        client = tc.save_weights_and_get_sampling_client().result()         # this step's weights
        data, sampled, mean_reward = Batch(client, tokenizer, cfg, rng).collect()
        waited = time.perf_counter() - t0
        outputs = train(tc, data, cfg)
        steps.append(report(Step(time.perf_counter() - t0, waited, mean_reward, kl_sample_train(sampled, outputs))))
    return steps


def inflight(tc, tokenizer, cfg: Config, rng: random.Random, report) -> list[Step]:
    client = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    pending = Batch(client, tokenizer, cfg, rng)
    steps = []
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        data, sampled, mean_reward = pending.collect()
        waited = time.perf_counter() - t0
        if step + 1 < cfg.steps:
            pending = Batch(client, tokenizer, cfg, rng)        # sampled while this step trains
        outputs = train(tc, data, cfg)
        # Publishes the new weights to every inflight client, `client` included; the one it returns is unused.
        tc.save_weights_and_get_sampling_client(kind="inflight").result()
        steps.append(report(Step(time.perf_counter() - t0, waited, mean_reward, kl_sample_train(sampled, outputs))))
    return steps


def run(base_url: str, base_model: str, mode: str, cfg: Config, verbose: bool = True) -> list[Step]:
    """A fresh LoRA training client (cfg.seed), cfg.steps steps of `mode`; each step's figures."""
    import tinker

    tc = tinker.ServiceClient(base_url=base_url).create_lora_training_client(
        base_model=base_model, rank=cfg.rank, seed=cfg.seed).result()

    def report(s: Step) -> Step:
        if verbose:
            print(f"{mode} step: {s.seconds:.2f} s (waiting for samples {s.sample_wait:.2f} s), "
                  f"reward {s.reward:.3f}, kl_sample_train {s.kl_sample_train:.2e}", flush=True)
        return s
    loop = {"on-policy": on_policy, "inflight": inflight}[mode]
    return loop(tc, tc.get_tokenizer(), cfg, random.Random(cfg.seed), report)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True)
    p.add_argument("--base-model", required=True, help="the model as `tinkerd up` serves it (its directory)")
    p.add_argument("--mode", choices=MODES, default="inflight")
    for field in dataclasses.fields(Config):
        p.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default)
    args = p.parse_args(argv)
    cfg = Config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Config)})
    steps = run(args.base_url, args.base_model, args.mode, cfg)
    print(json.dumps({"mode": args.mode, "config": dataclasses.asdict(cfg),
                      "steps": [dataclasses.asdict(s) for s in steps]}))


if __name__ == "__main__":
    main()
