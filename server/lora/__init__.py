"""LoRA adapters over HTTP: loading and unloading them while the server runs."""
