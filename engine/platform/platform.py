"""One answer to every device question, chosen once from the device.

``platform_for(device)`` makes the platform where the configuration's device is resolved: once
by ``LLMEngine`` (a tensor-parallel worker rank makes its own, engine/executor/rank.py), which
hands that object to every part that asks (the runner, the model's preparation, the
speculator's build, the process groups). It is a ``CpuPlatform`` on the CPU, a
``CudaPlatform`` on CUDA, and the base ``Platform`` (no special treatment) on any other device.
It says

* which kernels a step runs (``kernels``: KV write, paged attention, block copy, fused MoE,
  latent attention, the gated DeltaNet convolution and delta rule, the fused draw;
  engine/platform/kernel_backend.py) and which ``--attention-backend`` can run here;
* the dtype ``--dtype auto`` loads (``dtype``) and how large the KV cache may be
  (``kv_budget_bytes``);
* what the host does once per runner (``prepare_host``: malloc keeping freed memory) and for
  the engine thread (``release_thread_pool``: one OpenMP pool);
* what the model gets on this device (``prepare_model``: the CPU's faster exact projections
  and packed experts; ``quantizations``: the weight-only schemes that run; ``fused_rms_norm``);
* whether decode steps are captured as CUDA graphs (``captures_decode_graphs``) and whether
  ``--speculative-config auto`` speculates (``speculates_by_default``);
* where a tensor-parallel rank runs (``rank_device``, ``rank_platform``), what it sets first
  (``enter_rank``) and its torch.distributed backend (``communicator``, ``group_options``).

Nothing outside engine/platform/ branches on ``device.type`` or on a kernel backend's name.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from paged_serve.engine.config import EngineConfig
from paged_serve.engine.platform.dtype_choice import DtypeChoice, choose_dtype
from paged_serve.engine.platform.kernel_backend import KernelBackend, make_kernels
from paged_serve.kernels.triton.runtime import can_run_on

logger = logging.getLogger(__name__)

KERNEL_BACKENDS = ("torch", "triton")


class Platform:
    """What the engine does differently on one kind of device (the base: a device with no
    special treatment)."""

    device: torch.device
    default_kernels = "torch"
    communicator = "gloo"  # torch.distributed backend of the compute group
    quantizations: tuple[str, ...] = ()  # weight-only schemes that run here
    fused_rms_norm = False  # F.rms_norm has Hugging Face's bits here (engine/model/body/norms.py)
    # --speculative-config auto speculates (prompt lookup) here: only where it was measured to
    # pay (docs/measurements/speculation.md); a drafted step also runs outside CUDA's decode graphs.
    speculates_by_default = False

    def __init__(self, device: torch.device):
        self.device = device

    def kernel_backend_name(self, requested: str) -> str:
        """``auto`` is this platform's default; triton where it cannot run is refused."""
        name = self.default_kernels if requested == "auto" else requested
        if name == "triton" and not can_run_on(self.device):
            raise ValueError(
                "the triton backend on a CPU needs TRITON_INTERPRET=1 (and is slow): "
                "use --attention-backend torch"
            )
        if name not in KERNEL_BACKENDS:
            raise ValueError(f"unknown attention backend {name!r}")
        return name

    def kernels(self, config: EngineConfig, *, group_alone: bool = False) -> KernelBackend:
        """The functions a step runs (``config.attention_backend``, resolved here)."""
        name = self.kernel_backend_name(config.attention_backend)
        return make_kernels(name, group_alone=group_alone, decode_kernel=config.cpu_decode_kernel)

    def dtype(self, requested: str) -> DtypeChoice:
        """What ``--dtype`` loads here (``auto``: engine/platform/dtype_choice.py)."""
        return choose_dtype(requested, self.device)

    def kv_budget_bytes(self, config: EngineConfig) -> int:
        """Bytes for the KV cache: ``kv_cache_memory`` when given, else this platform's."""
        if config.kv_cache_memory is not None:
            return config.kv_cache_memory
        return self._default_kv_bytes(config)

    def _default_kv_bytes(self, config: EngineConfig) -> int:
        from paged_serve.engine.config import DEFAULT_CPU_KV_CACHE_BYTES

        return DEFAULT_CPU_KV_CACHE_BYTES

    def check_quantization(self, scheme: str | None) -> None:
        """Raise ValueError for a weight-only scheme that does not run here."""
        if scheme is not None and scheme not in self.quantizations:
            raise ValueError(
                f"{scheme} weight-only quantization runs on the CPU, not {self.device.type}"
            )

    def prepare_model(self, model: nn.Module, config: EngineConfig) -> None:
        """What the model gets on this device after its generic preparation (in place): a
        checkpoint's quantized projections on the Triton kernels where those run."""
        if self.kernel_backend_name(config.attention_backend) == "triton":
            _quantized_on_triton(model)

    def prepare_host(self) -> None:
        """Process-wide settings a runner on this device wants (once per runner)."""

    def release_thread_pool(self) -> None:
        """Free the calling thread's compute threads for the engine thread's."""

    def captures_decode_graphs(self, config: EngineConfig, kernels: KernelBackend) -> bool:
        """Whether decode steps are captured as graphs and replayed."""
        return False

    def rank_device(self, local_rank: int) -> torch.device:
        """The device of the tensor-parallel rank ``local_rank`` of this node."""
        return self.device

    def rank_platform(self, local_rank: int) -> Platform:
        """The platform of the tensor-parallel rank ``local_rank`` of this node: this kind of
        device, at ``rank_device(local_rank)`` (``cuda:1`` for rank 1 on CUDA)."""
        return type(self)(self.rank_device(local_rank))

    def enter_rank(self, world_size: int) -> None:
        """Settings of a tensor-parallel worker process, before it loads anything."""

    def group_options(self) -> dict:
        """Extra keyword arguments of ``torch.distributed.init_process_group``."""
        return {}


class CpuPlatform(Platform):
    """The CPU: torch kernels (the C decode kernel among them), weight-only int8 and int4,
    the projections' exact faster kernels, malloc keeping freed memory, one OpenMP pool."""

    quantizations = ("int8", "int4")
    fused_rms_norm = True
    speculates_by_default = True

    def prepare_model(self, model: nn.Module, config: EngineConfig) -> None:
        from paged_serve.engine.platform.cpu.linears import speed_up_cpu_linears
        from paged_serve.engine.platform.cpu.packed_experts import pack_experts
        from paged_serve.engine.platform.cpu.quantized_linears import place_quantized_linears

        if self.kernel_backend_name(config.attention_backend) == "triton":
            _quantized_on_triton(model)  # interpreted: the GPU's arithmetic, checked on a CPU
        else:
            dtype = next(model.parameters()).dtype
            place_quantized_linears(model, dtype)  # before packing what becomes an nn.Linear
        swapped = speed_up_cpu_linears(model)  # after quantizing: packs what stays an nn.Linear
        if swapped:
            logger.info("CPU projections on their faster exact kernels: %d", swapped)
        if self.kernel_backend_name(config.attention_backend) == "triton":
            return  # the Triton fused-MoE kernel (interpreted) reads the experts as loaded
        experts = pack_experts(model)  # after quantizing: packs what stays plain
        if experts:
            logger.info("experts modules packed for oneDNN: %d", experts)

    def prepare_host(self) -> None:
        from paged_serve.engine.platform.cpu.host_malloc import keep_freed_memory

        keep_freed_memory()  # steps reuse their temporaries' pages

    def release_thread_pool(self) -> None:
        from paged_serve.engine.platform.cpu.openmp_pool import release_openmp_pool

        release_openmp_pool()

    def enter_rank(self, world_size: int) -> None:
        torch.set_num_threads(max(1, torch.get_num_threads() // world_size))  # shared cores


class CudaPlatform(Platform):
    """A CUDA GPU: the Triton kernels, decode CUDA graphs, NCCL, the KV cache sized from the
    memory left free under ``gpu_memory_utilization``."""

    default_kernels = "triton"
    communicator = "nccl"

    def _default_kv_bytes(self, config: EngineConfig) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        # Memory torch's caching allocator holds but no tensor uses (a previous engine's
        # cache, say) is free for us too, though the driver counts it as used.
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        return int(free - total * (1.0 - config.gpu_memory_utilization))

    def captures_decode_graphs(self, config: EngineConfig, kernels: KernelBackend) -> bool:
        if config.enforce_eager:
            return False
        if not kernels.graph_safe:
            logger.info("decode graphs need the triton backend: running eagerly")
            return False
        return True

    def rank_device(self, local_rank: int) -> torch.device:
        return torch.device("cuda", local_rank)  # its node's GPU, with its index

    def enter_rank(self, world_size: int) -> None:
        torch.cuda.set_device(self.device)

    def group_options(self) -> dict:
        return {"device_id": self.device}


def _quantized_on_triton(model: nn.Module) -> None:
    from paged_serve.engine.quant.linear import use_triton_kernels

    count = use_triton_kernels(model)
    if count:
        logger.info("quantized projections on the Triton GEMMs: %d", count)


def resolve_device(name: str) -> torch.device:
    """``auto`` is CUDA where a GPU is visible, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def platform_for(device: torch.device | str) -> Platform:
    """The platform of ``device`` (a device or a name, ``auto`` included)."""
    if isinstance(device, str):
        device = resolve_device(device)
    platforms = {"cpu": CpuPlatform, "cuda": CudaPlatform}
    return platforms.get(device.type, Platform)(device)
