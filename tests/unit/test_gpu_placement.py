"""`tinkerd up` on a GPU host (launcher/gpus.py): each service on GPUs of its own where there are
enough, else a shared card split so both sides fit (vLLM takes --gpu-memory-utilization of the
card's *total* memory and profiles its start-up assuming nobody else allocates meanwhile), the
trainer's allocator capped at what the samplers leave, and services on one card started one
after another. The split is a pure function of the GPUs and the model; the children's command
lines and environments are checked as `up` builds them. On a GPU host
tests/e2e/test_gpu_up.py runs the real stack."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from launcher import cli, gpus, up
from tinkerd import hardware, settings
from tinkerd.errors import UserError

GIB = gpus.GIB
H100 = int(79.1 * GIB)            # what CUDA reports for an H100 80GB
ONE_B = int(2.47 * GIB)           # Llama-3.2-1B in bf16
EIGHT_B = int(14.96 * GIB)        # Llama-3.1-8B in bf16


def _plan(cards, weights, replicas=1, ranks=1, tp=1, utilization=0.0):
    names = up.sampler_names(cli.build_parser().parse_args(["up", "--base-model", "m",
                                                            "--sampler-replicas", str(replicas)]))
    return gpus.plan([gpus.Gpu(str(i), total) for i, total in enumerate(cards)], trainer_ranks=ranks,
                     replicas=names, tensor_parallel_size=tp, weights_bytes=weights, utilization=utilization)


def _memory_on(p: gpus.Placement, card: str, total: int, weights: int) -> float:
    """Bytes the services on `card` may take at most: each replica its utilization, the trainer
    its cap plus its CUDA context."""
    samplers = sum(p.utilization[n] * total for n, d in p.devices.items() if n != "trainer" and card in d)
    trainer = (p.trainer_fraction * total + gpus.CONTEXT_BYTES) if card in p.devices["trainer"] else 0
    return samplers + trainer


def test_no_gpu_no_placement():
    assert _plan([], ONE_B) is None


def test_a_one_gpu_host_splits_the_card_so_both_sides_fit():
    p = _plan([H100], ONE_B)
    assert p.shared and p.devices == {"trainer": ["0"], "sampler": ["0"]}
    util, cap = p.utilization["sampler"], p.trainer_fraction
    # The sampler: its weights and context, and SAMPLER_SHARE of what is left beyond both sides' weights.
    spare = H100 - 2 * ONE_B - 2 * gpus.CONTEXT_BYTES
    assert util == pytest.approx((ONE_B + gpus.CONTEXT_BYTES + gpus.SAMPLER_SHARE * spare) / H100, abs=0.011)
    assert util <= 0.5 < cap                                   # the trainer keeps the larger part
    assert _memory_on(p, "0", H100, ONE_B) <= H100             # never more than the card
    assert cap * H100 > ONE_B + 30 * GIB                       # its weights and tens of GiB to train in
    assert p.overrides("trainer") == {"gpu_memory_fraction": cap}
    assert p.overrides("sampler") == {"gpu_memory_utilization": util}
    assert p.env("sampler") == p.env("trainer") == {"CUDA_VISIBLE_DEVICES": "0"}
    assert p.start_order(["trainer", "sampler"]) == [["trainer"], ["sampler"]]
    assert "GPU 0 (79.1 GiB)" in p.summary and f"capped at {cap:g}" in p.summary and f"at {util:g}" in p.summary


def test_an_8b_model_shares_an_h100_and_is_refused_on_a_24_gib_card_with_what_would_fit():
    p = _plan([H100], EIGHT_B)
    assert p.utilization["sampler"] * H100 > EIGHT_B + gpus.CONTEXT_BYTES + 10 * GIB     # weights and a KV cache
    assert p.trainer_fraction * H100 > EIGHT_B + 10 * GIB
    assert _memory_on(p, "0", H100, EIGHT_B) <= H100
    with pytest.raises(UserError, match=r"GPU 0 \(24.0 GiB\) cannot hold the trainer and 1 sampler.*15.0 GiB.*"
                                        r"GPUs of its own"):
        _plan([24 * GIB], EIGHT_B)


def test_enough_gpus_give_each_service_its_own_and_vllms_usual_share():
    p = _plan([H100, H100, H100], ONE_B, replicas=2)
    assert not p.shared and p.trainer_fraction == 0
    assert p.devices == {"trainer": ["0"], "sampler": ["1"], "sampler-2": ["2"]}
    assert p.utilization == {"sampler": 0.9, "sampler-2": 0.9}
    assert p.overrides("trainer") == {}                        # uncapped: the card is its own
    assert p.start_order(["trainer", "sampler", "sampler-2"]) == [["trainer", "sampler", "sampler-2"]]
    ranks_and_tp = _plan([H100] * 4, ONE_B, ranks=2, tp=2)
    assert ranks_and_tp.devices == {"trainer": ["0", "1"], "sampler": ["2", "3"]} and not ranks_and_tp.shared


def test_replicas_beyond_the_gpus_go_round_robin_and_split_what_they_share():
    p = _plan([H100, H100], ONE_B, replicas=3)
    assert p.devices == {"trainer": ["0"], "sampler": ["1"], "sampler-2": ["0"], "sampler-3": ["1"]}
    assert p.utilization["sampler"] == p.utilization["sampler-3"] == 0.45   # two alone on GPU 1: 0.9 split
    assert p.utilization["sampler-2"] < 0.5 < p.trainer_fraction            # beside the trainer on GPU 0
    for card in ("0", "1"):
        assert _memory_on(p, card, H100, ONE_B) <= H100
    two_on_one = _plan([H100], ONE_B, replicas=2)
    assert two_on_one.utilization["sampler"] == two_on_one.utilization["sampler-2"]
    assert _memory_on(two_on_one, "0", H100, ONE_B) <= H100


def test_an_explicit_utilization_is_kept_where_it_fits_and_refused_with_the_most_that_would():
    p = _plan([H100], ONE_B, utilization=0.3)
    assert p.utilization == {"sampler": 0.3} and p.trainer_fraction == pytest.approx(0.68, abs=0.011)
    with pytest.raises(UserError, match=r"--gpu-memory-utilization 0.98 for 1 sampler replica\(s\) on the trainer's "
                                        r"GPU 0 \(79.1 GiB\) leaves the trainer 0.0 GiB .* give at most 0.93"):
        _plan([H100], ONE_B, utilization=0.98)
    tight = _plan([H100], ONE_B, utilization=0.9)              # the user's call: the trainer keeps ~4 GiB to train in
    assert tight.utilization == {"sampler": 0.9} and tight.trainer_fraction == 0.08
    assert _plan([H100, H100], ONE_B, utilization=0.8).utilization == {"sampler": 0.8}     # a card of its own
    with pytest.raises(UserError, match="adds up to 1.20"):
        _plan([H100, H100], ONE_B, replicas=3, utilization=0.6)


def test_more_ranks_or_a_wider_replica_than_gpus_is_refused():
    with pytest.raises(UserError, match="--trainer-ranks 2 needs a GPU per rank; this host shows 1"):
        _plan([H100], ONE_B, ranks=2)
    with pytest.raises(UserError, match="--tensor-parallel-size 2 needs that many GPUs; this host shows 1"):
        _plan([H100], ONE_B, tp=2)


def test_the_placement_reaches_each_childs_command_line_and_environment(tmp_path, monkeypatch):
    """As `up` starts them: the trainer capped, the replica at its share, both on the card named
    the way `up`'s own CUDA_VISIBLE_DEVICES names it; a user's smaller cap is kept."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-7f3a")
    monkeypatch.setattr(gpus, "visible_gpus", lambda: [gpus.Gpu("GPU-7f3a", H100)])
    monkeypatch.setattr(gpus, "weights_bytes", lambda model_dir, dtype: ONE_B)
    args = cli.build_parser().parse_args(["up", "--base-model", str(tmp_path), "--gpu-memory-fraction", "0.5"])
    args.placement = gpus.place(args, up.sampler_names(args))
    trainer = settings.from_args(up.CHILDREN["trainer"], cli.build_parser().parse_args(
        up.child_argv(args, "trainer", **up._wiring(args, "trainer", {}))))
    sampler = settings.from_args(up.CHILDREN["sampler"], cli.build_parser().parse_args(
        up.child_argv(args, "sampler", **up._wiring(args, "sampler", {}))))
    assert trainer.gpu_memory_fraction == 0.5                  # the user's, below the split's 0.58
    assert sampler.gpu_memory_utilization == args.placement.utilization["sampler"] == 0.4
    assert up._child_env(args, "sampler") == up._child_env(args, "trainer") == {"CUDA_VISIBLE_DEVICES": "GPU-7f3a"}
    assert up._child_env(args, "gateway") == {}


def test_the_weights_size_is_read_from_the_checkpoint_headers_at_the_serving_dtype(tiny_model_dir):
    from safetensors import safe_open

    with safe_open(os.path.join(tiny_model_dir, "model.safetensors"), framework="pt") as f:
        elements = sum(f.get_tensor(n).numel() for n in f.keys())
    assert gpus.weights_bytes(tiny_model_dir, "bfloat16") == 2 * elements
    assert gpus.weights_bytes(tiny_model_dir, "float32") == 4 * elements


def test_a_host_without_an_nvidia_driver_is_not_probed(monkeypatch):
    """`up` on a CPU host: no child process, no torch (seconds of start-up)."""
    monkeypatch.setattr(hardware, "nvidia_driver_present", lambda: False)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("probed"))
    assert gpus.visible_gpus() == []


def test_the_probe_names_gpus_as_cuda_visible_devices_does(monkeypatch):
    monkeypatch.setattr(hardware, "nvidia_driver_present", lambda: True)
    monkeypatch.setattr(gpus, "_PROBE", f"print('[{H100}, {H100}]')")
    assert gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-a, GPU-b"}) == [gpus.Gpu("GPU-a", H100),
                                                                         gpus.Gpu("GPU-b", H100)]
    assert [g.name for g in gpus.visible_gpus({})] == ["0", "1"]
    monkeypatch.setattr(gpus, "_PROBE", "raise SystemExit('no driver loaded')")
    assert gpus.visible_gpus({}) == []                          # the services then choose for themselves


def test_out_of_range_shares_are_refused_naming_the_flag():
    from sampler_service import engine

    with pytest.raises(UserError, match="--gpu-memory-fraction must be between 0"):
        hardware.cap_gpu_memory(1.5)
    hardware.cap_gpu_memory(0.0)                                # no cap
    with pytest.raises(UserError, match="--gpu-memory-utilization must be a share"):
        engine.engine_args("m", gpu_memory_utilization=1.2)
    assert engine.engine_args("m")["gpu_memory_utilization"] == 0.9


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks a host without a GPU")
def test_tinkerd_up_on_a_cpu_host_places_nothing_and_imports_no_torch():
    code = ("import sys; from launcher import cli, gpus, up\n"
            "args = cli.build_parser().parse_args(['up', '--base-model', 'm'])\n"
            "assert gpus.place(args, up.sampler_names(args)) is None\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA: the trainer's allocator cap")
def test_the_trainers_cap_holds_on_its_gpu():
    """In a process of its own (the cap is process-wide): within it an allocation works, past it
    PyTorch refuses, and the activation budget is a quarter of the capped share."""
    code = ("import torch\n"
            "from tinkerd import hardware\n"
            "from trainer_service import microbatches\n"
            "hardware.cap_gpu_memory(0.05)\n"
            "total = torch.cuda.get_device_properties(0).total_memory\n"
            "assert hardware.gpu_memory_bytes(0) == int(total * 0.05)\n"
            "assert microbatches.default_budget_bytes(torch.device('cuda', 0)) == int(total * 0.05) // 4\n"
            "small = torch.empty(int(total * 0.02), dtype=torch.uint8, device='cuda')\n"
            "try:\n"
            "    torch.empty(int(total * 0.06), dtype=torch.uint8, device='cuda')\n"
            "    raise SystemExit('allocated past the cap')\n"
            "except torch.OutOfMemoryError:\n"
            "    pass\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "LOCAL_RANK": "0"})
    assert out.returncode == 0, out.stderr[-2000:]
