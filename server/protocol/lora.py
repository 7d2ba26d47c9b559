"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` on the wire: vLLM's
request bodies (its replies are plain text: ``paged_serve.server.lora.runtime_updates``)."""

from __future__ import annotations

import msgspec

from paged_serve.server.protocol.errors import bad_request


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    """Serve the peft adapter folder ``lora_path`` as ``lora_name``."""

    lora_name: str
    lora_path: str
    # vLLM's: replace an adapter served under the same name; refused here (unload it first)
    load_inplace: bool = False

    def check(self) -> None:
        if not self.lora_name:
            raise bad_request("lora_name must not be empty", "lora_name")
        if not self.lora_path:
            raise bad_request("lora_path must not be empty", "lora_path")
        if self.load_inplace:
            raise bad_request(
                "load_inplace is not supported: unload the adapter, then load the new one",
                "load_inplace",
            )


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    """Stop serving the adapter ``lora_name``."""

    lora_name: str
    lora_int_id: int | None = None  # vLLM's; adapters are named by lora_name here

    def check(self) -> None:
        if not self.lora_name:
            raise bad_request("lora_name must not be empty", "lora_name")
