"""Headroom's custom ComfyUI io types, declared once: every node module takes its sockets from here, so a type's
name (what the graph editor matches links by) is spelled in one place."""
from comfy_api.latest import io

DatasetType = io.Custom("DATASET")  # training/data/dataset.Dataset: items and crop plans (pixels load lazily)
LatentCacheType = io.Custom("LATENT_CACHE")  # training/data/cache_store.LatentCache
TextCacheType = io.Custom("TEXT_CACHE")  # training/data/cache_store.TextCache
OffloadPolicyType = io.Custom("OFFLOAD_POLICY")  # training/memory/policy.OffloadPolicy
LoraConfigType = io.Custom("LORA_CONFIG")  # training/core/adapters.AdapterConfig
OptimizerConfigType = io.Custom("OPTIMIZER_CONFIG")  # training/core/optimizers.OptimizerConfig
TrainingRunType = io.Custom("TRAINING_RUN")  # nodes/bridge/comfy_bridge.TrainingRun (a LoRA or a ControlNet run)
