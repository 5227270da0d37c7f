"""The hybrid actor: one set of weights serves both training and rollout.

Entering rollout flips the module to eval mode, turns activation checkpointing and autograd off, may move
the optimizer's states to CPU, and generates with the very parameters the optimizer updates (the rollout
backend keeps no copy of them). Leaving rollout frees the backend's KV cache and restores training: the
states come back and the mode is restored. Each transition's time and memory change are recorded in
`last_transition_s` / `last_transition_bytes` so stages can log them.
"""
from __future__ import annotations

import contextlib
import time

import torch

from hybridcore.batch import left_pad
from hybridcore.chat import stop_ids
from hybridcore.errors import NotYetSupported
from hybridcore.models import set_activation_checkpointing
from hybridcore.rollout import make_backend
from hybridcore.tensor_parallel import tp_state


class HybridActor:
    def __init__(self, model, tokenizer, activation_checkpointing: bool = False, backend: str = "native",
                 optimizer: torch.optim.Optimizer | None = None, offload_optimizer: bool = False,
                 backend_options: dict | None = None, groups=None, rollout_tp: int | None = None,
                 train_engine=None):
        """backend: "native" (static KV cache, CUDA graphs on GPU) or "hf" (transformers generate, the
        baseline) or "vllm" (an in-process vLLM engine synced on entry; the extra); backend_options are its
        constructor's keywords. offload_optimizer moves `optimizer`'s states to CPU for each rollout.
        A tensor-parallel model (tensor_parallel.split_model) needs `groups` (parallel.init's) and is regrouped
        into `rollout_tp` (default: its training tp) for each rollout; every rank constructs the actor.
        train_engine: the zero.TrainEngine that trains `model`; under ZeRO-3 its partitioned parameters are gathered
        in place for each rollout and re-partitioned after (every dp rank rolls out together)."""
        if offload_optimizer and optimizer is None:
            raise ValueError("offload_optimizer=True needs the optimizer whose states to offload")
        self.model, self.tokenizer = model, tokenizer
        self.stop_ids = stop_ids(tokenizer)  # EOS and the chat template's end-of-turn token
        self.activation_checkpointing = activation_checkpointing
        set_activation_checkpointing(model, activation_checkpointing)
        self.backend = make_backend(backend, model, **(backend_options or {}))
        self.optimizer, self.offload_optimizer = optimizer, offload_optimizer
        self.resharder = None
        self.zero3 = None
        if train_engine is not None and train_engine.ds is not None and train_engine.layout.zero_stage == 3:
            if train_engine.module is not model:
                raise ValueError("train_engine must be the engine that trains this actor's model")
            if backend == "vllm":
                raise NotYetSupported("engine.rollout.backend=vllm under ZeRO-3",
                                      "the 3D sharding issue (#8): use the native backend")
            self.zero3 = train_engine
        self._gathered = None
        if tp_state(model).size > 1:
            if groups is None:
                raise ValueError("a tensor-parallel model needs the process groups (groups=parallel.init(...))")
            if backend == "vllm":
                raise NotYetSupported("engine.rollout.backend=vllm with a tensor-parallel actor",
                                      "the 3D sharding issue (#8): use the native backend")
            from hybridcore.reshard import Resharder
            self.resharder = Resharder(model, groups, rollout_tp or tp_state(model).size)
        self.in_rollout = False
        self.last_transition_s: dict[str, float] = {}
        self.last_transition_bytes: dict[str, int] = {}
        self._host_states: dict[tuple[int, str], torch.Tensor] = {}  # pinned CPU copies, reused every rollout
        self._offloaded: list[tuple[dict, str, torch.device]] = []

    @contextlib.contextmanager
    def rollout(self):
        """Serve generation from the training weights, then hand them back to training."""
        start = self._mark()
        was_training = self.model.training
        self.model.eval()
        if self.activation_checkpointing:
            set_activation_checkpointing(self.model, False)
        if self.offload_optimizer:
            self._offload_optimizer_states()
        self._gather_weights()
        self.backend.enter()
        self.in_rollout = True
        self._record("enter", start)
        try:
            with torch.no_grad():
                yield self
        finally:
            start = self._mark()
            kv_bytes = self.backend.kv_cache_bytes
            self.in_rollout = False
            self.backend.exit()
            self._release_weights()
            if self.offload_optimizer:
                self._restore_optimizer_states()
            if self.activation_checkpointing:
                set_activation_checkpointing(self.model, True)
            self.model.train(was_training)
            self._record("exit", start)
            self.last_transition_bytes["kv_cache"] = kv_bytes

    def generate(self, prompts: list[list[int]], max_new_tokens: int, greedy: bool = False,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> list[list[int]]:
        """Responses (token ids, ending with a stop token, EOS or the template's end of turn, when the model
        stopped) for left-padded prompts."""
        if not self.in_rollout:
            raise RuntimeError("HybridActor.generate must run inside `with actor.rollout():`")
        if self.resharder is not None:  # each rollout group generates its share; every rank gets all responses
            r = self.resharder
            mine = r.share(prompts)
            seed = r.same_seed() if not (greedy or temperature == 0) else None
            with torch.random.fork_rng(devices=[] if seed is None or not torch.cuda.is_available()
                                       else [torch.cuda.current_device()], enabled=seed is not None):
                if seed is not None:
                    torch.manual_seed(seed)
                out = self._generate(mine, max_new_tokens, greedy, temperature, top_k, top_p) if mine else []
            return r.gather(out)
        return self._generate(prompts, max_new_tokens, greedy, temperature, top_k, top_p)

    def _generate(self, prompts, max_new_tokens, greedy, temperature, top_k, top_p) -> list[list[int]]:
        tok = self.tokenizer
        ids, mask = left_pad(prompts, tok.pad_token_id)
        device = next(self.model.parameters()).device
        out = self.backend.generate(ids.to(device), mask.to(device), max_new_tokens, eos_id=self.stop_ids,
                                    pad_id=tok.pad_token_id, greedy=greedy, temperature=temperature, top_k=top_k,
                                    top_p=top_p)
        responses = []
        for row in out.tolist():
            end = next((i for i, t in enumerate(row) if t in self.stop_ids), None)
            responses.append(row if end is None else row[: end + 1])
        return responses

    def close(self) -> None:
        """Release what the backend holds beyond the KV cache (a vLLM engine and its memory)."""
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()

    # -------------------------------------------------------------------------------- layout hooks

    def _gather_weights(self) -> None:
        """Where the training layout becomes the rollout layout, in place. Today weights are whole tensors on
        one device and nothing moves. ZeRO-3 gathers its partitioned parameters here (and `_release_weights`
        re-partitions them; the bytes gathered go to last_transition_bytes["zero3_gathered"]); tensor parallelism
        regroups training shards into the rollout's tp size here.
        Both must leave `self.model`'s parameters as the tensors the backend reads, so no copy is kept."""
        if self.resharder is not None:
            self.resharder.enter()
            self.last_transition_bytes["reshard_peak"] = self.resharder.peak_bytes
        if self.zero3 is not None:
            self._gathered = contextlib.ExitStack()
            self.last_transition_bytes["zero3_gathered"] = self._gathered.enter_context(self.zero3.gathered())

    def _release_weights(self) -> None:
        """The inverse of `_gather_weights`, run after the backend has freed its cache."""
        if self.resharder is not None:
            self.resharder.exit()
        if self._gathered is not None:
            self._gathered, gathered = None, self._gathered
            gathered.close()  # re-partitions: each rank keeps only its shard again

    # -------------------------------------------------------------------------------- optimizer offload

    def reserve_host_states(self) -> int:
        """Allocate the pinned CPU buffers the optimizer states will be offloaded into, outside any transition
        (pinning GiBs takes seconds once; call it after the first optimizer step, when the states exist).
        Returns the bytes reserved so far."""
        if self.offload_optimizer:
            for state in self.optimizer.state.values():
                for k, v in state.items():
                    if torch.is_tensor(v):
                        self._host_buffer(state, k, v)
        return sum(t.nbytes for t in self._host_states.values())

    def _host_buffer(self, state: dict, k: str, v: torch.Tensor) -> torch.Tensor:
        key = (id(state), k)
        host = self._host_states.get(key)
        if host is None or host.shape != v.shape or host.dtype != v.dtype:
            host = torch.empty(v.shape, dtype=v.dtype, pin_memory=v.is_cuda)
            self._host_states[key] = host
        return host

    def _offload_optimizer_states(self) -> None:
        """Copy every optimizer state tensor to (pinned, reused) CPU memory and drop the device copy, so the
        KV cache can use that memory during rollout."""
        cuda = False
        for state in self.optimizer.state.values():
            for k, v in list(state.items()):
                if not torch.is_tensor(v):
                    continue
                host = self._host_buffer(state, k, v)
                host.copy_(v, non_blocking=v.is_cuda)
                cuda |= v.is_cuda
                self._offloaded.append((state, k, v.device))
                state[k] = host
        if cuda:
            torch.cuda.synchronize()  # the host copies are complete before anyone reads them

    def _restore_optimizer_states(self) -> None:
        for state, k, device in self._offloaded:
            host = state[k]
            state[k] = torch.empty(host.shape, dtype=host.dtype, device=device).copy_(host, non_blocking=True)
        self._offloaded = []

    # -------------------------------------------------------------------------------- measurement

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _mark(self) -> tuple[float, int]:
        if self._device().type == "cuda":
            torch.cuda.synchronize()
            return time.perf_counter(), torch.cuda.memory_allocated()
        return time.perf_counter(), 0

    def _record(self, name: str, start: tuple[float, int]) -> None:
        t, m = self._mark()
        self.last_transition_s[name] = t - start[0]
        self.last_transition_bytes[name] = m - start[1]
