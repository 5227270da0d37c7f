"""Rollout backends: how the hybrid actor turns prompts into responses with its own training weights.

`native` is a decode loop over the model's own parameters (no copy) with a preallocated static KV cache.
Decoding one token for a batch is about a thousand small kernels that each read weights once: the step is
bound by launch overhead and kernel count, not by arithmetic. So on CUDA the one-token step is compiled
(inductor fuses the norms, rotary, activations and cache writes: ~14 kernels a layer instead of ~35), then
captured once in a CUDA graph and replayed (one launch per token); on CPU it runs eagerly. Its attention reads
only the cache columns written so far through a Triton kernel on CUDA (hybridcore/decode_attention.py; SDPA
over the whole preallocated cache, masked, on a CPU or with attention="sdpa"). `hf` is plain
transformers `generate`, kept as the baseline the native loop is tested and benchmarked against.

Both take a left-padded batch ([B, P] ids and 0/1 mask) and return the new tokens [B, n] (n <= max_new),
rows that met EOS padded with `pad_id` after it.
"""
from __future__ import annotations

import time
import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, GenerationConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from hybridcore import decode_attention
from hybridcore.adapters import compute_dtype
from hybridcore.batch import position_ids
from hybridcore.quant import is_quantized
from hybridcore.sampling import draw
from hybridcore.tensor_parallel import head_shape, local_kv_heads, tp_state
from hybridcore.triton_device import runs_on

ATTENTION = "hybrid_rollout"
ATTENTIONS = ("auto", "sdpa", "filled")  # NativeRollout(attention=...): auto = filled on CUDA, else sdpa


def grouped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                      filled=None, **kwargs):
    """SDPA that folds the query heads sharing one KV head into the query axis.

    With a padding mask, transformers' sdpa path repeats K/V once per query head before the kernel: for a
    6:1 grouped-query model that copies the whole cache six times per layer per step. Folded, each cached
    K/V is read once. Attends to the first mask.shape[-1] cache columns (the prefill passes a shorter mask).
    filled: the columns written so far, a device tensor that decode_step passes through the model's kwargs
    when the rollout's attention is "filled"; a one-token step then reads only those (decode_attention.attend).
    """
    if sliding_window is not None:
        raise NotImplementedError("the native rollout backend has no sliding-window attention yet")
    if attention_mask is None:  # a call with no padding, e.g. a plain forward of the actor inside rollout
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling, **kwargs)
    B, H, Q, D = query.shape
    Hkv, L = key.shape[1], attention_mask.shape[-1]
    g = H // Hkv
    q = query.reshape(B, Hkv, g * Q, D)  # head h = kv * g + r, so rows are (r, q) with r major
    if filled is not None and Q == 1 and not dropout and runs_on(query.device):
        out = decode_attention.attend(q, key[:, :, :L], value[:, :, :L], attention_mask.reshape(B, L), filled,
                                      D ** -0.5 if scaling is None else scaling)
        return out.reshape(B, H, Q, D).transpose(1, 2), None
    mask = attention_mask if Q == 1 else attention_mask.unsqueeze(2).expand(B, 1, g, Q, L).reshape(B, 1, g * Q, L)
    out = F.scaled_dot_product_attention(q, key[:, :, :L], value[:, :, :L], attn_mask=mask, dropout_p=dropout,
                                         scale=scaling)
    return out.reshape(B, H, Q, D).transpose(1, 2), None


AttentionInterface.register(ATTENTION, grouped_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


class StaticKVCache:
    """Every layer's K and V preallocated as [B, kv_heads, capacity, head_dim].

    Writes land at the cache columns in `index`, a tensor the decode loop advances in place, so a captured
    CUDA graph replays unchanged. Only `update` is part of the model's cache protocol that we rely on: the
    loop always passes position ids and a 4D mask, so the model never asks the cache for lengths.
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], index: torch.Tensor | None = None):
        self.keys, self.values, self.index = keys, values, index

    @classmethod
    def allocate(cls, config, batch: int, capacity: int, dtype, device, kv_heads: int | None = None
                 ) -> "StaticKVCache":
        """kv_heads: this rank's (a tensor-parallel model holds num_key_value_heads / tp); default the config's."""
        _, config_kv_heads, head_dim = head_shape(config)
        shape = (batch, kv_heads or config_kv_heads, capacity, head_dim)
        n = config.num_hidden_layers
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)],
                   [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)])

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k.index_copy_(2, self.index, key_states)
        v.index_copy_(2, self.index, value_states)
        return k, v

    def zero_(self) -> None:
        for t in self.keys + self.values:
            t.zero_()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


def decode_step(model, tokens, positions, column, mask, keys, values, attention: str = "sdpa") -> torch.Tensor:
    """Feed `tokens` [B, 1] at cache `column`: next-token logits [B, V]. Advances column and positions and
    marks the column in `mask` [B, capacity], all in place, so the step can be replayed from a graph. A plain
    function of tensors, so torch.compile guards on shapes, not on which decoder's buffers it is given.
    attention "filled": the model's attention is also given `filled` = column + 1, a tensor computed inside the
    step (so inside a captured graph), and reads only the columns before it; "sdpa": the whole cache, masked."""
    mask.index_fill_(1, column, True)
    extra = {"filled": column + 1} if attention == "filled" else {}
    out = model(input_ids=tokens, attention_mask=mask[:, None, None, :], position_ids=positions,
                past_key_values=StaticKVCache(keys, values, column), use_cache=True, logits_to_keep=1, **extra)
    positions.add_(1)
    column.add_(1)
    return out.logits[:, -1]


_compiled_step = None


def compiled_decode_step():
    """decode_step through torch.compile (inductor fuses the norms, rotary and activations that otherwise cost
    one kernel each); one compiled function per process, recompiled only for a new model, batch size or
    capacity. Default mode: our own CUDA graph wraps it, so inductor must not capture one of its own."""
    global _compiled_step
    if _compiled_step is None:
        _compiled_step = torch.compile(decode_step, dynamic=False)
    return _compiled_step


def chunk_mask(written: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """[B, 1, rows, L] bool for the prefill's queries at cache columns start .. start + rows - 1 over the first L
    columns (`written` [B, L], the decoder's mask): each sees the prompt's real tokens at or before its own column,
    and itself, so a padding query's softmax row is never empty (an empty row is NaN, and NaN keys would poison real
    rows through 0 * NaN). The compiled prefill passes every cache column (unwritten ones masked: one shape for
    every chunk), the eager one the columns up to its chunk's end."""
    q = torch.arange(start, start + rows, device=written.device)[:, None]
    k = torch.arange(written.shape[1], device=written.device)[None, :]
    return (((k <= q)[None] & written[:, None, :]) | (k == q)[None])[:, None]


def prefill_chunk(model, ids, mask, positions, index, keep, keys, values, dtype) -> torch.Tensor:
    """Feed prompt chunk `ids` [B, c] at cache columns `index` [c] through `mask` [B, 1, c, L]: the logits
    [B, V] at chunk row `keep` (a [1] tensor). dtype: the autocast of training's forward (adapters.mixed_precision)
    or None. Like decode_step a plain function of tensors whose shapes are fixed for one decoder, so torch.compile
    compiles it once per batch size and capacity (inductor fuses the norms, rotary, activations and cache writes
    that otherwise cost about half the prefill's GPU time at the 1.5B shape)."""
    def forward():
        return model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                     past_key_values=StaticKVCache(keys, values, index), logits_to_keep=keep).logits[:, -1]
    if dtype is None:
        return forward()
    with torch.autocast(device_type=ids.device.type, dtype=dtype, cache_enabled=False):
        return forward()


_compiled_prefill = None


def compiled_prefill_chunk():
    """prefill_chunk through torch.compile: one compiled function per process, as compiled_decode_step."""
    global _compiled_prefill
    if _compiled_prefill is None:
        _compiled_prefill = torch.compile(prefill_chunk, dynamic=False)
    return _compiled_prefill


def prefill_starts(prompt: int, chunk: int) -> list[int]:
    """The first cache column of each prefill chunk of `chunk` columns over a `prompt`-column prompt: back to back,
    the last one ending at the prompt's end (overlapping the one before: its columns are written again with the
    same values), or, for a prompt shorter than a chunk, one chunk reaching past the prompt into columns the decode
    steps overwrite before they read them. Every chunk the same shape: one compile."""
    if prompt <= chunk:
        return [0]
    return list(range(0, prompt - chunk, chunk)) + [prompt - chunk]


# prompt tokens over the whole batch per prefill chunk. The whole KV cache is allocated first, so a chunk's
# activations sit on top of it: at the Llama-3-8B shape, 4,096 tokens held 868 MiB there with float32 LoRA
# inputs (bench/mem_trace.py, H100, 2026-12-06) and ~0.7 GiB under mixed_precision; 1,024 tokens ~0.2 GiB
# (with the fused decode, the GRPO step's rollout peak: 0.35 GiB above weights + cache, 2026-12-06). Fewer tokens
# a chunk cost time: a 4-bit + LoRA forward launches ~4,000 kernels, and at 512 tokens (8 rows x 1,024 prompt tokens
# in 16 chunks) the 8B prefill took 1.45 s, of which its kernels ran 0.58 s (bench/memory.py --profile, H100,
# 2026-12-07): the rest was launching them. 2,048 makes that 4 chunks, ~0.35 GiB of activations.
PREFILL_TOKENS = 2048
# ... but at most this many chunks: each is a forward of the whole model, and for a large batch PREFILL_TOKENS
# alone made the prefill a decode loop (Qwen2.5-1.5B shape, batch 256 x 256 prompt tokens: 128 chunks of 2
# positions took 3.0 s on an H100, bench/RESULTS.md 2026-12-06 21:54, against 0.44 s for one pass on an H200).
# A chunk is at least capacity / 16 columns (capacity = P + new, rounded up), so its activations stay a fraction
# of the KV cache, and its shape depends on the batch size and capacity alone (the compiled prefill's one shape).
PREFILL_CHUNKS = 16

_capture_streams: dict = {}


def _capture_stream(device) -> "torch.cuda.Stream":
    if device not in _capture_streams:
        _capture_streams[device] = torch.cuda.Stream(device)
    return _capture_streams[device]


class _Decoder:
    """The static state of one (batch size, capacity): KV cache, input/output buffers, the captured graph."""

    def __init__(self, model, batch: int, capacity: int, cuda_graph: bool, compile: bool | None,
                 attention: str = "sdpa", prefill_tokens: int = PREFILL_TOKENS, compile_prefill: bool = True):
        """compile: True compiles the step (an error if that fails); None compiles it but falls back to the
        plain step, with a warning and `compile_error` set, if compiling fails; False never compiles. The prefill
        is compiled where the step is (a failure under None: `prefill_error`, the eager prefill), but for
        bitsandbytes models (their prefill keeps its eager forward: not timed compiled) or with compile_prefill
        False. attention: decode_step's, "sdpa" or "filled". prefill_tokens: see NativeRollout."""
        p = next(model.parameters())
        self.model, self.batch, self.capacity, self.attention = model, batch, capacity, attention
        # prompt columns a prefill chunk: about prefill_tokens over the batch, at least capacity / PREFILL_CHUNKS
        self.chunk = min(capacity, max(1, prefill_tokens // batch, -(-capacity // PREFILL_CHUNKS)))
        self.required = compile is True
        self.cache = StaticKVCache.allocate(model.config, batch, capacity, p.dtype, p.device,
                                            kv_heads=local_kv_heads(model))
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=p.device)
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=p.device)
        self.column = torch.zeros(1, dtype=torch.long, device=p.device)  # cache column of the token fed
        self.mask = torch.zeros(batch, capacity, dtype=torch.bool, device=p.device)  # columns written so far
        self.step_fn = decode_step if compile is False else compiled_decode_step()
        eager_prefill = compile is False or not compile_prefill or is_quantized(model)
        self.prefill_fn = prefill_chunk if eager_prefill else compiled_prefill_chunk()
        self.compile_error: str | None = None
        self.prefill_error: str | None = None
        self.graph = self.logits = None
        if compile is not False:
            self._compile()
        if cuda_graph:
            self._capture()

    @property
    def compiled(self) -> bool:
        return self.step_fn is not decode_step

    def _compile(self) -> None:
        """Run the compiled step once (the compile happens here, outside any graph capture), then reset."""
        try:
            self._forward()
        except Exception as e:  # noqa: BLE001 -- any compiler failure; the plain step computes the same
            if self.required:
                raise
            self.compile_error = self._give_up(e, "the decode step", "decoding with the uncompiled step")
            self.step_fn = decode_step
            self.prefill_fn = prefill_chunk  # not tried: the same compiler on the same model
            self.cache.zero_()
        self.reset()

    @staticmethod
    def _give_up(e: Exception, what: str, instead: str) -> str:
        """An automatic compile failed: a warning saying what runs instead, and the error's first line."""
        first = str(e).strip().splitlines()
        error = f"{type(e).__name__}: {first[0] if first else ''}"
        warnings.warn(f"native rollout: torch.compile of {what} failed ({error}); {instead}", RuntimeWarning,
                      stacklevel=4)
        return error

    @torch.no_grad()  # also when called outside generate (a profiler): a compiled step must not trace autograd
    def _forward(self) -> torch.Tensor:
        return self.step_fn(self.model, self.tokens, self.positions, self.column, self.mask, self.cache.keys,
                            self.cache.values, self.attention)

    def _capture(self) -> None:
        """Warm up on the capture stream (lazy inits, cuBLAS workspace), reset, then record the step once.

        One stream per device for every capture: cuBLAS keeps a workspace (~32 MiB on Hopper) per stream for
        the life of the process, so a fresh stream per rollout leaked that much per PPO iteration."""
        side = _capture_stream(self.tokens.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward()
        torch.cuda.current_stream().wait_stream(side)
        self.reset()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=side):
            self.logits = self._forward()

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, dtype) -> tuple[torch.Tensor, int]:
        """Write the left-padded prompt ids [B, P] (mask [B, P]) into the cache in chunks of `self.chunk` columns:
        the logits [B, V] after its last token, and the number of chunks. Compiled, every chunk has one shape
        (prefill_starts; keys: every cache column); eager, the chunks are back to back, the last one shorter, each
        attending to the columns up to its end (no work past the prompt: on a CPU, or a small batch whose chunk
        would be the whole cache). A compiled prefill that fails under compile=None warns, records `prefill_error`
        and runs uncompiled (the chunk is simply redone). dtype: training's autocast (adapters.compute_dtype) or
        None."""
        B, P = ids.shape
        compiled = self.prefill_fn is not prefill_chunk
        c = self.chunk if compiled else min(self.chunk, P)
        self.mask[:, :P] = mask.bool()
        positions = position_ids(mask)
        if P < c:  # one chunk reaching past the prompt: padding queries (token 0, positions going on) see themselves
            ids = F.pad(ids, (0, c - P))
            positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, c - P + 1, device=ids.device)], 1)
        starts = prefill_starts(P, c) if compiled else range(0, P, c)
        for s in starts:  # each chunk attends to the cache columns written so far and to its own
            end = min(s + c, ids.shape[1])
            row = min(P, end) - 1 - s  # the prompt's last row, in the last chunk (a kernel, not a host copy)
            keys = self.mask[:, :self.capacity if compiled else end]
            # contiguous: a slice's strides follow P, and torch.compile guards on strides (a recompile a length)
            args = (self.model, ids[:, s:end].contiguous(), chunk_mask(keys, s, end - s),
                    positions[:, s:end].contiguous(), torch.arange(s, end, device=ids.device),
                    torch.arange(row, row + 1, device=ids.device), self.cache.keys, self.cache.values, dtype)
            try:
                logits = self.prefill_fn(*args)
            except Exception as e:  # noqa: BLE001 -- a compiler failure; the plain forward computes the same
                if self.prefill_fn is prefill_chunk or self.required:
                    raise
                self.prefill_error = self._give_up(e, "the prefill", "prefilling uncompiled")
                self.prefill_fn = prefill_chunk
                logits = prefill_chunk(*args)
        return logits, len(starts)

    def reset(self) -> None:
        self.mask.zero_()
        self.column.zero_()
        self.positions.zero_()

    def step(self) -> torch.Tensor:
        if self.graph is None:
            return self._forward()
        self.graph.replay()
        return self.logits


class NativeRollout:
    """The static-cache decode loop. State (cache, graph) lives from first use until `exit`, and is reused
    across generate calls of the same batch size that fit its capacity (PPO: every call)."""

    name = "native"

    def __init__(self, model, cuda_graph: bool | None = None, stop_check_every: int | None = None,
                 capacity_multiple: int = 64, compile: bool | None = None, prefill_tokens: int = PREFILL_TOKENS,
                 attention: str = "auto"):
        """cuda_graph: None = on for CUDA models. compile: run the decode step, and the prefill's chunks but for
        bitsandbytes models, through torch.compile; None = on where the step is a CUDA graph (falling back to the
        plain forward, with a warning, if compiling fails). It compiles once per process for each model, batch size
        and capacity (~30 s for a 1.5B model on an H200), whatever the prompt length inside that capacity; later
        rollouts of the same shape only re-capture the graph. prefill_tokens: the prompt is prefilled in chunks of
        about this many tokens over the batch (in PREFILL_CHUNKS at most), so its activations stay small beside the
        KV cache, which is allocated whole before the prefill. attention: how decode steps attend,
        "filled" (the Triton kernel that reads only the cache columns written so far: CUDA), "sdpa" (the whole
        cache, masked) or "auto" (filled on CUDA where the kernel takes the model's heads, else sdpa); the prefill
        is always sdpa."""
        if attention not in ATTENTIONS:
            raise ValueError(f"native rollout: attention {attention!r}, expected one of {', '.join(ATTENTIONS)}")
        self.model, self.attention = model, attention
        self.prefill_tokens = prefill_tokens
        self.cuda_graph, self.compile = cuda_graph, compile
        self.stop_check_every = stop_check_every
        self.capacity_multiple = capacity_multiple
        self._decoder: _Decoder | None = None
        self.compile_error: str | None = None  # the first automatic compile's failure (then the plain step)
        self.prefill_error: str | None = None  # the prefill's (then the eager prefill, the step still compiled)
        self.attention_error: str | None = None  # why auto took sdpa where the kernel's self-check failed
        self._saved_attention = None
        self.last_stats: dict[str, float] = {}
        self.last_logprobs: torch.Tensor | None = None

    def enter(self) -> None:
        """Route the actor's attention through `grouped_attention` for the rollout (restored by exit)."""
        self._saved_attention = self.model.config._attn_implementation
        self.model.config._attn_implementation = ATTENTION

    def exit(self) -> None:
        """Free the KV cache, the graph and its memory pool; the weights are untouched."""
        self._decoder = None
        if self._saved_attention is not None:
            self.model.config._attn_implementation = self._saved_attention
            self._saved_attention = None

    @property
    def kv_cache_bytes(self) -> int:
        return self._decoder.cache.nbytes if self._decoder is not None else 0

    def _resolve_compile(self, graph: bool) -> bool | None:
        """True / False as asked; by default None (compile, fall back if that fails) under a graph, else False."""
        if self.compile is None:
            return None if graph else False
        return self.compile

    def _resolve_attention(self, device) -> str:
        """"sdpa" or "filled" for this model on `device` (see __init__). The kernel is checked against its
        reference first (decode_attention.self_check): where that fails, auto warns and takes sdpa; an explicit
        "filled" is an error naming why, there and for heads or a device the kernel cannot take."""
        if self.attention == "sdpa" or self.attention == "auto" and device.type != "cuda":
            return "sdpa"
        heads, kv_heads, head_dim = head_shape(self.model.config)
        problem = decode_attention.unsupported(head_dim, heads // kv_heads)
        if problem is not None:
            if self.attention == "filled":
                raise ValueError(f"native rollout: attention='filled' cannot take this model's heads: {problem}")
            return "sdpa"
        if not runs_on(device):
            raise RuntimeError("native rollout: attention='filled' runs a Triton kernel on CUDA (on a CPU only "
                               "under Triton's interpreter, TRITON_INTERPRET=1: tests); expected a GPU, or 'sdpa'")
        dtype = next(self.model.parameters()).dtype  # the KV cache's (StaticKVCache.allocate)
        problem = decode_attention.self_check(head_dim, heads // kv_heads, dtype, device)
        if problem is None:
            return "filled"
        if self.attention == "filled":
            raise ValueError(f"native rollout: attention='filled', but the kernel failed its self-check: {problem}")
        if self.attention_error is None:
            warnings.warn(f"native rollout: the filled-columns attention kernel failed its self-check ({problem}); "
                          "decoding with SDPA over the whole cache", RuntimeWarning, stacklevel=4)
        self.attention_error = problem
        return "sdpa"

    def _decoder_for(self, batch: int, length: int, device) -> _Decoder:
        d = self._decoder
        if d is None or d.batch != batch or d.capacity < length:
            self._decoder = d = None  # free the old cache before allocating the new one
            # a tensor-parallel step all-reduces every layer: not captured in a graph by default (untested there)
            graph = device.type == "cuda" and tp_state(self.model).size == 1 if self.cuda_graph is None \
                else self.cuda_graph
            compile = self._resolve_compile(graph)
            if compile is None and self.compile_error:  # failed once: not again every rollout (seconds, memory)
                compile = False
            capacity = -(-length // self.capacity_multiple) * self.capacity_multiple
            self._decoder = d = _Decoder(self.model, batch, capacity, graph, compile, self._resolve_attention(device),
                                         self.prefill_tokens, compile_prefill=self.prefill_error is None)
            self.compile_error = self.compile_error or d.compile_error
        d.reset()
        return d

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, *,
                 eos_id: int | Sequence[int] | None, pad_id: int, greedy: bool = False, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, steps: int | None = None) -> torch.Tensor:
        """eos_id: the token(s) that end a response (EOS and a chat template's end of turn); None: none do.
        steps: decode at most this many tokens in a cache sized for max_new_tokens (the memory planner's probe).
        `last_logprobs` [B, n] keeps each sampled token's log-probability under the model's own softmax (before
        temperature and truncation: what training computes), so PPO can log how far the two paths drift apart."""
        B, P = ids.shape
        stops = stop_tensor(eos_id, ids.device)
        out = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=ids.device)
        logps = torch.zeros(B, max_new_tokens, dtype=torch.float32, device=ids.device)
        self.last_logprobs = logps[:, :0]
        if max_new_tokens == 0:
            return out
        clock = _Clock(ids.device)
        d = self._decoder_for(B, P + max_new_tokens, ids.device)  # a new shape: cache, compile, graph capture
        clock.mark()
        # autocast as training's forward (forward.py's mixed_precision); decode steps run without
        logits, chunks = d.prefill(ids, mask, compute_dtype(self.model))
        self.prefill_error = self.prefill_error or d.prefill_error  # the step's and the prefill's failures apart
        d.column.fill_(P)
        d.positions.copy_(mask.sum(1, keepdim=True))
        clock.mark()
        every = self.stop_check_every or (8 if ids.device.type == "cuda" else 1)
        finished = torch.zeros(B, dtype=torch.bool, device=ids.device)
        n = last = min(max_new_tokens, steps or max_new_tokens)
        for t in range(last):
            nxt, logps[:, t] = draw(logits, greedy, temperature, top_k, top_p)  # one pass on CUDA (sampling.py)
            if stops is not None:
                nxt = nxt.masked_fill(finished, pad_id)
                finished |= torch.isin(nxt, stops)
            out[:, t] = nxt
            if t + 1 == last:
                break
            if stops is not None and (t + 1) % every == 0 and bool(finished.all()):
                n = t + 1
                break
            d.tokens.copy_(nxt[:, None])
            logits = d.step()
        out, self.last_logprobs = out[:, :n], logps[:, :n]
        clock.mark()
        build_s, prefill_s, decode_s = clock.intervals()
        self.last_stats = {"build_s": build_s, "prefill_s": prefill_s, "prefill_chunks": chunks,
                           "decode_s": decode_s, "steps": n,
                           "kv_cache_bytes": d.cache.nbytes, "cuda_graph": d.graph is not None,
                           "compiled": d.compiled, "prefill_compiled": d.prefill_fn is not prefill_chunk,
                           "compile_error": self.compile_error or self.prefill_error, "attention": d.attention}
        return out


class HFGenerate:
    """transformers' generate on the same weights: the baseline (dynamic cache, or cache_implementation="static",
    which transformers compiles on CUDA)."""

    name = "hf"

    def __init__(self, model, cache_implementation: str | None = None):
        self.model, self.cache_implementation = model, cache_implementation
        self.kv_cache_bytes = 0
        self.last_stats: dict[str, float] = {}

    def enter(self) -> None:
        pass

    def exit(self) -> None:
        pass

    @torch.no_grad()
    def generate(self, ids, mask, max_new_tokens, *, eos_id, pad_id, greedy=False, temperature=1.0, top_k=0,
                 top_p=1.0) -> torch.Tensor:
        # top_k=0 explicitly: None would let generate() fill in its global default of 50, and rollouts would
        # then come from a truncated distribution while PPO scores them under the full softmax.
        do_sample = not (greedy or temperature == 0)
        knobs = dict(temperature=temperature, top_k=top_k, top_p=top_p) if do_sample else \
            dict(temperature=None, top_k=None, top_p=None)
        cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=do_sample, pad_token_id=pad_id,
                               eos_token_id=stop_list(eos_id) or None, bos_token_id=None,
                               cache_implementation=self.cache_implementation, **knobs)
        out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        return out[:, ids.shape[1]:]


def stop_list(eos_id: int | Sequence[int] | None) -> list[int]:
    """The ids that end a response, as a list (a backend's `eos_id` may be one id, several, or None)."""
    if eos_id is None:
        return []
    return [int(eos_id)] if isinstance(eos_id, int) else [int(i) for i in eos_id]


def stop_tensor(eos_id, device) -> torch.Tensor | None:
    ids = stop_list(eos_id)
    return torch.tensor(ids, dtype=torch.long, device=device) if ids else None


def _vllm_rollout(model, **kwargs):
    """Imported on use: `import hybridcore.rollout` never imports vllm (an optional extra)."""
    from hybridcore.rollout_vllm import VLLMRollout
    return VLLMRollout(model, **kwargs)


BACKENDS = {"native": NativeRollout, "hf": HFGenerate, "vllm": _vllm_rollout}


def make_backend(name: str, model, **kwargs):
    if name not in BACKENDS:
        raise ValueError(f"rollout backend must be one of {sorted(BACKENDS)}, got {name!r}")
    return BACKENDS[name](model, **kwargs)


class _Clock:
    """Interval timer: CUDA events on a GPU (no sync until read), perf_counter on CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.marks = [self._now()]

    def _now(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def mark(self) -> None:
        self.marks.append(self._now())

    def intervals(self) -> list[float]:
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1000 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]
