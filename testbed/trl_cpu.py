"""Moved to lora_sync/integrations/trl_cpu.py (shipped with the package, so `pip install`
users have it too): `from lora_sync.integrations import trl_cpu; trl_cpu.patch()`. This
name is kept for the checkout's older importers."""
from lora_sync.integrations.trl_cpu import TOUCHED, patch, torch_tree_attention  # noqa: F401

__all__ = ["TOUCHED", "patch", "torch_tree_attention"]
