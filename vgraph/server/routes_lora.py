"""``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``: vLLM's routes for serving LoRA
adapters at run time (behind the API key like every ``/v1`` route; the registry is
lora_adapters.py). They answer in plain text, as vLLM's do; errors keep OpenAI's JSON shape."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from .protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from .state import ServerState

router = APIRouter()


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> PlainTextResponse:
    state: ServerState = request.app.state.server
    body = await state.read(request, LoadLoRAAdapterRequest)
    state.require_ready()
    await state.load_adapter(body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    state: ServerState = request.app.state.server
    body = await state.read(request, UnloadLoRAAdapterRequest)
    state.unload_adapter(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
