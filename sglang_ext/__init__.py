"""lora-sync for SGLang: plugin (routes + scheduler handlers), engine bridge and launcher."""
