"""lora-sync for SGLang: plugin (routes + scheduler handlers), engine bridge and launcher."""
from lora_sync.server.pins import SUPPORTED

TESTED_SGLANG = list(SUPPORTED["SGLang"])[-1]  # the pin lives in pins.SUPPORTED (newest here)
