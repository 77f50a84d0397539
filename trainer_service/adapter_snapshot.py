"""An adapter snapshot gathered straight into weight-stream chunks: in the serving dtype for a
push, as trained for a checkpoint's adapter file (TrainerEngine.save_state).

The push path's one copy: each LoRA parameter is copied (and cast) into its place in the send
buffer, which the stream and the persisted copy then share. Which parameter goes under which
PEFT name is worked out once per model (PEFT's state-dict walk visits the whole model, every
tenant's adapter included) and kept while the model lives.
"""

from __future__ import annotations

import weakref

import torch

from tinkerd import weight_stream
from trainer_service.registry import LoraModel

# Send buffers, reused: the next push of the same adapter fills memory already touched.
_buffers = weight_stream.BufferPool()
# id(model) -> (a weak reference to it, [(PEFT name, parameter)]); an entry goes with its model.
_names: dict[int, tuple[weakref.ref, list[tuple[str, torch.Tensor]]]] = {}


def gather(peft_model, model: LoraModel, *, zero_stage: int, dtype: torch.dtype | None,
           chunk_bytes: int = weight_stream.DEFAULT_CHUNK_BYTES) -> weight_stream.Packed:
    """The adapter's full tensors (gathered under ZeRO-3) with PEFT names, cast to `dtype` (None:
    each in its own), in send chunks; call the result's `release` once nothing reads them any more."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(model.params, enabled=zero_stage == 3):
        named = _named_parameters(peft_model, model)
        specs, sizes = weight_stream.layout(((name, dtype or t.dtype, t.shape) for name, t in named), chunk_bytes)
        flat = _buffers.take(sum(sizes))
        chunks = weight_stream.allocate(sizes, flat)
        for spec, (_, t) in zip(specs, named):
            spec.view(chunks[spec.chunk]).copy_(t.detach())
    return weight_stream.Packed(specs, chunks, release=lambda: _buffers.give(flat))


def _named_parameters(peft_model, model: LoraModel) -> list[tuple[str, torch.Tensor]]:
    """PEFT's names for the model's adapter tensors, each with the parameter holding it (the
    tensors themselves when one is not a parameter of the model: then nothing is kept)."""
    from peft import get_peft_model_state_dict

    kept = _names.get(id(model))
    if kept is not None and kept[0]() is model:
        return kept[1]
    state = get_peft_model_state_dict(peft_model, adapter_name=model.adapter_name, save_embedding_layers=False)
    by_storage = {(p.data_ptr(), tuple(p.shape)): p for p in model.params}
    named = [(name, by_storage.get((t.data_ptr(), tuple(t.shape)))) for name, t in state.items()]
    if any(p is None for _, p in named):
        return list(state.items())
    key = id(model)
    _names[key] = (weakref.ref(model, lambda _: _names.pop(key, None)), named)
    return named
