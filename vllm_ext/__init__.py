"""lora-sync for vLLM: routes (endpoint plugin), engine bridge and launcher."""
