"""Drop-ins for training frameworks (each imports its framework only when imported itself):

  lora_sync.integrations.trl           AsyncGRPOTrainer: TRL's, syncing its LoRA with lora-sync
  lora_sync.integrations.trl_cpu       patch(): TRL's AsyncGRPOTrainer on a CPU-only machine
  lora_sync.integrations.server_watch  ServerWatch: restarted servers restored, ServerDown
  lora_sync.integrations.transformers  LoRASyncCallback: any transformers.Trainer, every N steps
"""
