"""Runs inside the vLLM worker (named by `worker_extension_cls`): registers LoRA snapshots
from in-memory tensors, so a streamed adapter never touches disk on its way in."""

from __future__ import annotations

import torch


class SnapshotWorkerExtension:
    def tinkerd_add_lora_tensors(self, lora_int_id: int, tensors: dict[str, torch.Tensor],
                                 adapter_config: dict) -> bool:
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        worker_manager = self.model_runner.lora_manager
        manager = worker_manager._adapter_manager
        config = dict(adapter_config)
        config["vllm_max_position_embeddings"] = worker_manager.max_position_embeddings
        helper = PEFTHelper.from_dict(config)
        helper.validate_legal(worker_manager.lora_config)
        mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
        lora = LoRAModel.from_lora_tensors(
            lora_int_id, tensors, helper, device="cpu",
            dtype=worker_manager.lora_config.lora_dtype, model_vocab_size=worker_manager.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(manager.model, "lora_skip_prefixes", None),
        )
        manager.remove_adapter(lora_int_id)
        if len(manager) + 1 > manager.capacity:
            manager.remove_oldest_adapter()
        return manager.add_adapter(lora)
