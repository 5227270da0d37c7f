"""The hybrid actor: one set of weights serves both training and rollout.

`rollout()` enters a list of transitions (hybridcore/transitions.py) through one ExitStack: eval mode with
activation checkpointing off, the optimizer's states to CPU (optional), the training backend's rollout weights
(the ZeRO-3 gather, the tensor-parallel regrouping, or nothing), the rollout backend itself; it then generates
with the very parameters the optimizer updates (the backend keeps no copy of them). Leaving rollout runs the
list in reverse: the KV cache is freed, weights re-partitioned, states back, mode restored. The whole enter and
exit are timed in `last_transition_s` / `last_transition_bytes` (plus the transitions' own byte counts, e.g.
"kv_cache"); each transition's own time and memory change in `last_transitions[name]`.
"""
from __future__ import annotations

import contextlib
import time

import torch

from hybridcore.batch import left_pad
from hybridcore.chat import stop_ids
from hybridcore.engine import refuse_unsupported
from hybridcore.fused_decode import FusedNf4Decode
from hybridcore.models import set_activation_checkpointing
from hybridcore.parallel import Layout
from hybridcore.rollout import make_backend
from hybridcore.transitions import BackendCache, OptimizerOffload, TrainMode, tp_regrouping


class HybridActor:
    def __init__(self, model, tokenizer, activation_checkpointing: bool = False, backend: str = "native",
                 optimizer: torch.optim.Optimizer | None = None, offload_optimizer: bool = False,
                 backend_options: dict | None = None, groups=None, rollout_tp: int | None = None,
                 train_engine=None, chunk_size: int | None = None, fused_4bit: bool = False):
        """backend: "native" (static KV cache, CUDA graphs on GPU) or "hf" (transformers generate, the
        baseline) or "vllm" (an in-process vLLM engine synced on entry; the extra); backend_options are its
        constructor's keywords. offload_optimizer moves `optimizer`'s states to CPU for each rollout.
        train_engine: the engine (hybridcore/engine.py) that trains `model`; its rollout_weights() is entered for
        each rollout (under ZeRO-3 every dp rank rolls out together). Without one, a tensor-parallel model
        (tensor_parallel.split_model) needs `groups` (parallel.init's) and is regrouped into `rollout_tp`
        (default: its training tp); every rank constructs the actor. chunk_size: the most sequences generated at
        once (one KV cache's rows; None: all of them); more are generated chunk after chunk. fused_4bit: the
        native backend decodes bitsandbytes 4-bit linears through the fused NF4 kernel (hybridcore/fused_decode.py)."""
        if offload_optimizer and optimizer is None:
            raise ValueError("offload_optimizer=True needs the optimizer whose states to offload")
        if train_engine is not None and train_engine.module is not model and train_engine.layout.zero_stage == 3:
            raise ValueError("train_engine must be the engine that trains this actor's model")
        self.model, self.tokenizer = model, tokenizer
        self.stop_ids = stop_ids(tokenizer)  # EOS and the chat template's end-of-turn token
        self.activation_checkpointing = activation_checkpointing
        set_activation_checkpointing(model, activation_checkpointing)
        self.backend = make_backend(backend, model, **(backend_options or {}))
        self.train_engine = train_engine
        weights = (train_engine.rollout_weights(rollout_tp) if train_engine is not None
                   else tp_regrouping(model, groups, rollout_tp))
        if weights is not None and backend == "vllm":
            layout = train_engine.layout if train_engine is not None else Layout(tp=weights.resharder.T)
            refuse_unsupported(layout, {"rollout_backend": backend})
        self.resharder = getattr(weights, "resharder", None)  # generate() splits prompts among rollout groups
        self.offload = OptimizerOffload(optimizer) if offload_optimizer else None
        if fused_4bit and backend != "native":
            raise ValueError(f"fused_4bit needs the native backend, not {backend!r}")
        fused = FusedNf4Decode(model) if fused_4bit else None
        self.transitions = [t for t in (TrainMode(model, activation_checkpointing), self.offload, weights, fused,
                                        BackendCache(self.backend)) if t is not None]
        self.chunk_size = chunk_size
        self.in_rollout = False
        self.last_stats: dict[str, float] = {}
        self.last_logprobs: list[list[float]] | None = None
        self.last_transition_s: dict[str, float] = {}
        self.last_transition_bytes: dict[str, int] = {}
        self.last_transitions: dict[str, dict[str, float]] = {}

    @contextlib.contextmanager
    def rollout(self):
        """Serve generation from the training weights, then hand them back to training."""
        stack = contextlib.ExitStack()
        start = self._mark()
        with stack:  # a transition that fails on entry unwinds the ones entered before it
            for t in self.transitions:
                self._run(t, "enter")
                stack.callback(self._run, t, "exit")
            stack = stack.pop_all()
        self.in_rollout = True
        self._record("enter", start)
        try:
            with torch.no_grad():
                yield self
        finally:
            start = self._mark()
            self.in_rollout = False
            stack.close()
            self._record("exit", start)

    def _run(self, transition, phase: str) -> None:
        start = self._mark()
        extra = getattr(transition, phase)()
        t, m = self._mark()
        stats = self.last_transitions.setdefault(transition.name, {})
        stats[f"{phase}_s"], stats[f"{phase}_bytes"] = t - start[0], m - start[1]
        self.last_transition_bytes.update(extra)

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

    def _generate(self, prompts, max_new_tokens, greedy, temperature, top_k, top_p, steps=None) -> list[list[int]]:
        """Chunk after chunk of at most chunk_size prompts, all chunks of one size (the last one filled up with
        copies of its first prompt, whose responses are dropped) so the native backend keeps one KV cache and one
        captured graph for the whole rollout."""
        n = len(prompts)
        chunks = -(-n // min(self.chunk_size or n, n))
        size = -(-n // chunks)
        responses, logprobs, stats = [], [], []
        for start in range(0, n, size):
            part = prompts[start:start + size]
            real = len(part)
            part = part + [part[0]] * (size - real)
            out, logp = self._generate_chunk(part, max_new_tokens, greedy, temperature, top_k, top_p, steps)
            responses += out[:real]
            logprobs = None if logp is None or logprobs is None else logprobs + logp[:real]
            stats.append(dict(getattr(self.backend, "last_stats", {})))
        self.last_logprobs = logprobs
        self.last_stats = {**stats[-1], "chunks": len(stats), "chunk_rows": size,
                           **{k: sum(st.get(k, 0) for st in stats)
                              for k in ("build_s", "prefill_s", "decode_s", "steps") if k in stats[-1]}}
        return responses

    def _generate_chunk(self, prompts, max_new_tokens, greedy, temperature, top_k, top_p, steps):
        """(responses cut after their stop token, each response token's rollout log-prob or None)."""
        tok = self.tokenizer
        ids, mask = left_pad(prompts, tok.pad_token_id)
        device = next(self.model.parameters()).device
        extra = {"steps": steps} if steps is not None else {}
        out = self.backend.generate(ids.to(device), mask.to(device), max_new_tokens, eos_id=self.stop_ids,
                                    pad_id=tok.pad_token_id, greedy=greedy, temperature=temperature, top_k=top_k,
                                    top_p=top_p, **extra)
        logp = getattr(self.backend, "last_logprobs", None)
        logp = logp.tolist() if logp is not None else None
        responses, logps = [], []
        for i, row in enumerate(out.tolist()):
            end = next((j for j, t in enumerate(row) if t in self.stop_ids), None)
            responses.append(row if end is None else row[: end + 1])
            if logp is not None:
                logps.append(logp[i][: len(responses[-1])])
        return responses, (logps if logp is not None else None)

    def probe(self, prompt: list[int], rows: int, max_new_tokens: int, steps: int = 2) -> None:
        """What the memory planner measures of a rollout of `rows` copies of `prompt`: its transitions, a KV cache
        sized for max_new_tokens, the prefill and `steps` decode steps (native backend: the others cannot stop
        early, and generate the whole length)."""
        with self.rollout():
            self._generate_chunk([prompt] * rows, max_new_tokens, True, 1.0, 0, 1.0,
                                 steps if self.backend.name == "native" else None)

    def close(self) -> None:
        """Release what the backend holds beyond the KV cache (a vLLM engine and its memory)."""
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()

    def reserve_host_states(self) -> int:
        """Allocate the pinned CPU buffers the optimizer states will be offloaded into, outside any transition
        (pinning GiBs takes seconds once; call it after the first optimizer step, when the states exist).
        Returns the bytes reserved so far (0 without offload)."""
        return self.offload.reserve() if self.offload is not None else 0

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

