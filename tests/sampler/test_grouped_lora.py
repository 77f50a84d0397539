"""The grouped CPU LoRA ops (sampler_service/grouped_lora.py) against vLLM's own PyTorch ops on
random inputs: mixed slots in runs (base rows, slot -1, among them), adapters of several ranks
zero-padded to the engine's maximum, shrink and expand (plain and slice), bgmv and sgmv forms."""

from __future__ import annotations

import pytest
import torch

from sampler_service import grouped_lora

lora_ops = pytest.importorskip("vllm.lora.ops.torch_ops.lora_ops")
compute_meta = pytest.importorskip("vllm.lora.punica_wrapper.utils").compute_meta

MAX_LORAS, MAX_RANK, HIDDEN, OUT = 4, 16, 24, 40
RANKS = [4, 16, 0, 8]          # slot 2 holds an all-zero adapter


def _stacked(gen, ranks=RANKS):
    a = torch.zeros(MAX_LORAS, 1, MAX_RANK, HIDDEN)
    b = torch.zeros(MAX_LORAS, 1, OUT, MAX_RANK)
    for slot, r in enumerate(ranks):
        a[slot, 0, :r] = torch.randn(r, HIDDEN, generator=gen)
        b[slot, 0, :, :r] = torch.randn(OUT, r, generator=gen)
    return a, b


def _tokens(pattern):
    """Per-token slots from (slot, count) runs."""
    return torch.tensor([s for s, n in pattern for _ in range(n)], dtype=torch.long)


PATTERNS = [
    [(1, 7)],                                          # one adapter, the common case
    [(0, 3), (-1, 2), (3, 4), (0, 1), (1, 5), (-1, 1)],  # mixed, a slot in two runs, base rows
    [(-1, 3), (2, 2), (3, 1)],
]


def _sgmv_meta(indices):
    start, lengths, slots, batches, max_len, tokens, _ = compute_meta(indices)
    return start, lengths, slots, batches, max_len, tokens


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("form", ["bgmv", "sgmv"])
def test_shrink_matches_vllm_with_base_rows_zero(pattern, form):
    gen = torch.Generator().manual_seed(0)
    a, _ = _stacked(gen)
    idx = _tokens(pattern)
    x = torch.randn(len(idx), HIDDEN, generator=gen)
    want, got = torch.full((len(idx), MAX_RANK), 7.0), torch.full((len(idx), MAX_RANK), 7.0)
    lora_ops.bgmv_shrink(x, a, want, idx, 0.5)
    want[idx < 0] = 0                                   # base rows: nothing added
    if form == "bgmv":
        grouped_lora.bgmv_shrink(x, a, got, idx, 0.5)
    else:
        grouped_lora.sgmv_shrink(x, a, got, *_sgmv_meta(idx), 0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("form", ["bgmv", "sgmv"])
@pytest.mark.parametrize("add", [True, False])
def test_expand_and_expand_slice_match_vllm(pattern, form, add):
    gen = torch.Generator().manual_seed(1)
    _, b = _stacked(gen)
    idx = _tokens(pattern)
    x = torch.randn(len(idx), MAX_RANK, generator=gen)
    x[idx < 0] = 0                                      # what shrink hands expand for base rows
    y0 = torch.randn(len(idx), OUT + 10, generator=gen)
    for offset, size in [(None, None), (3, OUT)]:
        want, got = y0.clone(), y0.clone()
        if offset is None:
            lora_ops.bgmv_expand(x, b, want, idx, add)
            if form == "bgmv":
                grouped_lora.bgmv_expand(x, b, got, idx, add)
            else:
                grouped_lora.sgmv_expand(x, b, got, *_sgmv_meta(idx), add)
        else:
            lora_ops.bgmv_expand_slice(x, b, want, idx, offset, size, add)
            if form == "bgmv":
                grouped_lora.bgmv_expand_slice(x, b, got, idx, offset, size, add)
            else:
                grouped_lora.sgmv_expand_slice(x, b, got, *_sgmv_meta(idx), offset, size, add)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_true_rank_is_found_and_rescanned_after_a_slot_is_rewritten():
    gen = torch.Generator().manual_seed(2)
    a, b = _stacked(gen)
    assert [grouped_lora.true_rank(a, s, rank_dim=0) for s in range(MAX_LORAS)] == RANKS
    assert [grouped_lora.true_rank(b, s, rank_dim=1) for s in range(MAX_LORAS)] == RANKS
    # vLLM's set_lora: zero the slot, then copy the new adapter in (here rank 12 into slot 0)
    a[0] = 0
    a[0, 0, :12].copy_(torch.randn(12, HIDDEN, generator=gen))
    assert grouped_lora.true_rank(a, 0, rank_dim=0) == 12
    idx = _tokens([(0, 4), (-1, 2)])
    x = torch.randn(len(idx), HIDDEN, generator=gen)
    want, got = torch.zeros(len(idx), MAX_RANK), torch.zeros(len(idx), MAX_RANK)
    lora_ops.bgmv_shrink(x, a, want, idx, 1.0)
    want[idx < 0] = 0
    grouped_lora.bgmv_shrink(x, a, got, idx, 1.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bf16_weights_into_an_fp32_buffer_and_back():
    gen = torch.Generator().manual_seed(3)
    a, b = (w.to(torch.bfloat16) for w in _stacked(gen))
    idx = _tokens([(3, 3), (-1, 1), (1, 2)])
    x = torch.randn(len(idx), HIDDEN, generator=gen).to(torch.bfloat16)
    want, got = torch.zeros(len(idx), MAX_RANK), torch.zeros(len(idx), MAX_RANK)
    lora_ops.bgmv_shrink(x, a, want, idx, 1.0)
    want[idx < 0] = 0
    grouped_lora.bgmv_shrink(x, a, got, idx, 1.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    y_want = torch.zeros(len(idx), OUT, dtype=torch.bfloat16)
    y_got = y_want.clone()
    lora_ops.bgmv_expand(want, b, y_want, idx, True)
    grouped_lora.bgmv_expand(got, b, y_got, idx, True)
    torch.testing.assert_close(y_got.float(), y_want.float(), rtol=2e-2, atol=2e-2)


def _per_op_lora_linear(y, x, a_slices, b_slices, scale, output_slices, idx):
    """vLLM's CPU add_lora_linear (punica_cpu.py) over the grouped ops: each slice shrunk into a
    zeroed fp32 buffer of the engine's maximum rank, then expanded from it, adding."""
    buffers = [torch.zeros(len(idx), b.shape[-1]) for b in b_slices]
    for buf, a in zip(buffers, a_slices):
        grouped_lora.bgmv_shrink(x, a, buf, idx, scale)
    offset = 0
    for buf, b, size in zip(buffers, b_slices, output_slices):
        grouped_lora.bgmv_expand_slice(buf, b, y, idx, offset, size, True)
        offset += size


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_fused_lora_linear_is_the_per_op_path_bit_for_bit(pattern, dtype, scale):
    """grouped_lora.add_lora_linear (a qkv-like layer of three slices, the plan made once) gives
    exactly the per-op path's numbers, in fp32 and bf16, whatever the slots' ranks (slot 3's B
    reaches past its A's rank; slot 2 is all zero); calling it again uses the cached fp32 A."""
    gen = torch.Generator().manual_seed(4)
    outs = (OUT, 8, 8)
    a_slices, b_slices = [], []
    for out in outs:
        a = torch.zeros(MAX_LORAS, 1, MAX_RANK, HIDDEN)
        b = torch.zeros(MAX_LORAS, 1, out, MAX_RANK)
        for slot, (ra, rb) in enumerate([(4, 4), (16, 16), (0, 0), (5, 9)]):
            a[slot, 0, :ra] = torch.randn(ra, HIDDEN, generator=gen)
            b[slot, 0, :, :rb] = torch.randn(out, rb, generator=gen)
        a_slices.append(a.to(dtype)), b_slices.append(b.to(dtype))
    idx = _tokens(pattern)
    x = torch.randn(len(idx), HIDDEN, generator=gen).to(dtype)
    y0 = torch.randn(len(idx), sum(outs), generator=gen).to(dtype)
    want = y0.clone()
    _per_op_lora_linear(want, x, a_slices, b_slices, scale, outs, idx)
    plan = grouped_lora.plan_from_tokens(idx)
    for _ in range(2):
        got = y0.clone()
        grouped_lora.add_lora_linear(got, x, tuple(a_slices), tuple(b_slices), scale, outs, plan)
        assert torch.equal(got, want)
    assert torch.equal(got[idx < 0], y0[idx < 0])       # base rows: untouched


def test_fused_lora_linear_sees_a_slot_rewritten():
    """A new adapter written into a slot (vLLM's zero, then copy) is used at once, not the
    fp32 copy of the old one kept for speed."""
    gen = torch.Generator().manual_seed(5)
    a, b = _stacked(gen)
    idx = _tokens([(0, 3), (-1, 1)])
    plan = grouped_lora.plan_from_tokens(idx)
    x = torch.randn(len(idx), HIDDEN, generator=gen)
    grouped_lora.add_lora_linear(torch.zeros(len(idx), OUT), x, (a,), (b,), 1.0, (OUT,), plan)
    a[0] = 0
    a[0, 0, :6].copy_(torch.randn(6, HIDDEN, generator=gen))
    want, got = torch.zeros(len(idx), OUT), torch.zeros(len(idx), OUT)
    _per_op_lora_linear(want, x, [a], [b], 1.0, (OUT,), idx)
    grouped_lora.add_lora_linear(got, x, (a,), (b,), 1.0, (OUT,), plan)
    assert torch.equal(got, want)


def test_prompt_logits_map_each_scored_token_to_its_adapter_for_cpu_ops_and_gpu_kernels():
    """worker_ext.scoring_tokens, on vLLM's real punica wrapper and kernel metadata: while one
    request's prompt tokens are scored, the sampler indices (CPU ops) and the prompt kernel
    metadata (GPU Triton kernels, `prompt_mapping_meta`, vLLM issue #51594) map each of those
    tokens to the request's adapter; after, both are the step's per-sequence mapping again."""
    from vllm.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    from sampler_service.worker_ext import scoring_tokens

    punica = PunicaWrapperCPU(64, 8, device="cpu")
    # A step of two requests: 5 prompt tokens through slot 1, then 3 of a base-model request.
    punica._token_lora_indices[:8].copy_(torch.tensor([1, 1, 1, 1, 1, -1, -1, -1]))
    punica._sampler_indices[:2].copy_(torch.tensor([1, -1]))
    punica.indices_len[:2] = [8, 2]
    # As the GPU wrapper keeps it: prepared from the sampler indices once per step.
    punica.prompt_mapping_meta = LoRAKernelMeta.make(4, 64, device="cpu")
    punica.prompt_mapping_meta.prepare_tensors(punica.sampler_indices)

    def kernel_mapping(n):
        mapping, _, counts, _, lora_ids, no_lora, _ = punica.prompt_mapping_meta.meta_args(n, True)
        return mapping.tolist(), dict(zip(lora_ids.tolist(), counts.tolist())), bool(no_lora)

    assert kernel_mapping(2)[0] == [1, -1]
    with scoring_tokens(punica, offset=0, n=4):          # the first request's tokens 0..3 scored
        assert punica.sampler_indices.tolist() == [1, 1, 1, 1]
        mapping, counts, no_lora = kernel_mapping(4)
        assert mapping == [1, 1, 1, 1] and counts[1] == 4 and not no_lora
    assert punica.sampler_indices.tolist() == [1, -1] and kernel_mapping(2)[0] == [1, -1]
    with scoring_tokens(punica, offset=5, n=2):          # base-model tokens: no adapter at all
        assert punica.sampler_indices.tolist() == [-1, -1] and kernel_mapping(2)[2]
    assert punica.sampler_indices.tolist() == [1, -1] and kernel_mapping(2)[0] == [1, -1]
