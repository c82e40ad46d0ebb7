"""lora-sync for SGLang: plugin (routes + scheduler handlers), engine bridge and launcher."""

TESTED_SGLANG = "0.5.23"  # the version engine_api.py was written against
