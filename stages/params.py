"""The params schema: one YAML file holds every parameter of one pipeline run.

Every field is optional and documented next to its default; unknown keys and wrong types are
`InputError`s that name the field path. `Overrides` mirrors the schema with every field optional, so
that Prefect validates a deployment's overrides before a run is created.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional, get_args

import yaml
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, create_model, field_validator,
                      model_validator)

from hybridcore.errors import InputError

PARAMS_DIR = Path(__file__).resolve().parent.parent / "params"
STAGES = ("sft", "reward", "ppo", "dpo", "evaluate")  # pipeline order; pipeline.stages picks which run
StageName = Literal[STAGES]


class _Section(BaseModel):
    # inf/nan are refused everywhere: `lr: .inf` passes gt=0 and would only fail as a NaN loss much later
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, v, info: ValidationInfo):
        """YAML's `true` would otherwise pass as the integer 1 (`ppo.iterations: true`)."""
        ann = cls.model_fields[info.field_name].annotation
        if isinstance(v, bool) and {int, float} & {ann, *get_args(ann)}:
            raise ValueError("expected a number, not a boolean")
        return v


PosInt = Field(gt=0)


class Pipeline(_Section):
    name: str = Field("tiny", min_length=1)  # names the MLflow experiment's parent runs and registered models
    seed: int = 0                           # one seed: data generation, init, sampling
    # the stages to run, each with its inputs listed too: [sft, reward, ppo, evaluate] (RLHF with a learned RM),
    # [sft, ppo, evaluate] (critic-free RL on ppo.reward_function), [sft, dpo, evaluate]; run in pipeline order
    stages: list[StageName] = Field(["sft", "reward", "ppo", "evaluate"], min_length=1)
    artifacts_dir: str = Field("artifacts", min_length=1)  # the cache: <artifacts_dir>/<stage>/<key>/


class Model(_Section):
    path: Optional[str] = None              # local HF folder (safetensors); when null, `preset` is built
    preset: Literal["tiny", "micro"] = "tiny"  # built-in Llama config with random weights + locally trained BPE
    tokenizer: Optional[str] = None         # tokenizer folder; default: the model folder's own
    trust_remote_code: bool = False         # never run a model folder's code unless turned on
    allow_pickle: bool = False              # load pickled weights (pytorch_model.bin) when a folder has no
                                            # safetensors; unpickling can run code, so only for folders you trust


class Synthetic(_Section):
    """The built-in task: word problems adding two digits, with a sloppy demonstrator (see stages/data.py)."""
    n_sft: int = Field(4000, gt=0)          # demonstrations
    n_preferences: int = Field(4000, gt=0)  # preference pairs
    n_prompts: int = Field(2048, gt=0)      # PPO prompts
    n_heldout: int = Field(256, gt=0)       # held-out prompts/pairs for every evaluation
    carry_error_rate: float = Field(0.6, ge=0, le=1)  # how often the demonstrator drops the carry


class DataFile(_Section):
    path: Optional[str] = None              # JSONL, .json array, Parquet, or a datasets.save_to_disk folder;
                                            # null = the built-in synthetic task
    columns: Optional[dict[str, str]] = None  # our column name -> the file's, e.g. {prompt: question, response: answer}


class Data(_Section):
    synthetic: Synthetic = Synthetic()
    # formats (stages/formats.py): standard text, or conversational turns rendered with the chat template
    sft: DataFile = DataFile()              # prompt, response | messages
    preferences: DataFile = DataFile()      # [prompt,] chosen, rejected (text or turns; no prompt = implicit)
    prompts: DataFile = DataFile()          # prompt (text or turns) [+ answer, for evaluation's checker]
    heldout_fraction: float = Field(0.1, gt=0, lt=1)  # share of a user's file kept for evaluation
    chat_template: Optional[str] = None     # for conversational rows: chatml | plain | a .jinja file; null = the
                                            # tokenizer's own (the tiny preset's has chatml)


class Steps(_Section):
    """What every training stage shares: step checkpoints for exact resume, and what to do on NaN/inf."""
    checkpoint_every: int = Field(50, gt=0)   # optimizer steps (PPO: rollout iterations) between checkpoints
    keep_checkpoints: int = Field(2, gt=0)    # the newest K are kept; older ones are deleted
    on_nonfinite: Literal["stop", "skip"] = "stop"  # a NaN/inf loss, reward or advantage: stop, or skip the batch


class Optim(Steps):
    epochs: int = Field(3, gt=0)
    batch_size: int = Field(32, gt=0)       # sequences per optimizer step
    micro_batch_size: int = Field(32, gt=0) # sequences per forward; batch_size / micro = grad accumulation
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_ratio: float = Field(0.05, ge=0, lt=1)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)  # cosine decays to lr * min_lr_ratio
    max_grad_norm: float = Field(1.0, gt=0)
    max_seq_len: Optional[int] = Field(None, gt=0)  # prompt + response tokens; longer rows are an input error;
                                            # null = the longest row of the data (within the model's context)

    @model_validator(mode="after")
    def _divides(self):
        if self.micro_batch_size > self.batch_size:
            raise ValueError(f"micro_batch_size ({self.micro_batch_size}) is larger than batch_size "
                             f"({self.batch_size}); expected micro_batch_size <= batch_size")
        if self.batch_size % self.micro_batch_size:
            raise ValueError(f"batch_size ({self.batch_size}) must be a multiple of micro_batch_size "
                             f"({self.micro_batch_size})")
        return self


class SFT(Optim):
    pass


class Reward(Optim):
    lr: float = Field(3e-4, gt=0)
    init: Literal["sft"] = "sft"            # the RM starts from the SFT model


class PPO(Steps):
    checkpoint_every: int = Field(10, gt=0)  # rollout iterations between checkpoints
    iterations: int = Field(40, gt=0)       # rollout batches
    rollout_batch_size: int = Field(64, gt=0)  # prompts per rollout
    minibatch_size: int = Field(32, gt=0)   # sequences per optimizer step
    micro_batch_size: int = Field(32, gt=0) # sequences per forward
    ppo_epochs: int = Field(4, gt=0)        # passes over each rollout batch
    # gae with one epoch and one minibatch a rollout: the critic's values (and GAE's returns and advantages) come
    # from its update's own forward, not a scoring forward before it (one critic forward fewer a step; the values
    # are the same weights' either way). false: scored first, as with several epochs or minibatches
    values_from_update: bool = True
    actor_lr: float = Field(5e-5, gt=0)
    critic_lr: float = Field(1e-4, gt=0)
    warmup_ratio: float = Field(0.0, ge=0, lt=1)
    max_grad_norm: float = Field(1.0, gt=0)
    clip_range: float = Field(0.2, gt=0)    # policy ratio clip
    value_clip: float = Field(0.2, gt=0)    # value clip around the rollout's values
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(0.95, ge=0, le=1)
    kl_coef: float = Field(0.05, ge=0)      # per-token KL penalty against the reference
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    entropy_coef: float = Field(0.0, ge=0)
    temperature: float = Field(1.0, gt=0)
    top_k: int = Field(0, ge=0)             # 0 = off
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: Optional[int] = Field(None, gt=0)  # null = from the data: the longest SFT/preference
                                            # response + its end token, + 25 % (stages/examples.py)
    missing_eos_penalty: Optional[float] = None  # added to the reward of responses that never end
    critic_init: Literal["reward", "sft"] = "reward"  # value head from the RM (score head) or fresh on SFT
    # the advantage estimator: gae (a critic, learned values); the critic-free ones build no critic at all:
    # grpo (reward - group mean, / group std), rloo (leave-one-out baseline), reinforce_pp (batch-whitened returns)
    estimator: Literal["gae", "grpo", "rloo", "reinforce_pp"] = "gae"
    samples_per_prompt: int = Field(1, gt=0)  # responses per prompt in one rollout (grpo, rloo: >= 2, the group)
    scale_rewards: bool = True              # grpo: divide by the group's std (false: Dr. GRPO's unscaled form)
    kl_in_loss: bool = False                # the KL to the reference as a loss term (GRPO's form), not in the reward
    loss_agg: Literal["token_mean", "seq_mean"] = "token_mean"  # token_mean: DAPO's token-level; seq_mean: per
                                            # response first, then over responses
    reward_function: Optional[str] = None   # "FILE.py:NAME", called NAME(prompts, responses, rows) -> list[float]
    reward_model_weight: float = Field(1.0, ge=0)  # reward = weight x RM score (+ the function's value, if named)

    @model_validator(mode="after")
    def _divides(self):
        sequences = self.rollout_batch_size * self.samples_per_prompt  # rows of one rollout batch
        rows = "rollout_batch_size" + (" x samples_per_prompt" if self.samples_per_prompt > 1 else "")
        for big, small, n in ((rows, "minibatch_size", sequences),
                              ("minibatch_size", "micro_batch_size", self.minibatch_size)):
            m = getattr(self, small)
            if m > n:
                raise ValueError(f"{small} ({m}) is larger than {big} ({n}); expected {small} <= {big}")
            if n % m:
                raise ValueError(f"{big} ({n}) must be a multiple of {small} ({m})")
        if self.estimator in ("grpo", "rloo") and self.samples_per_prompt < 2:
            raise ValueError(f"estimator {self.estimator} compares the responses of one prompt with each other; "
                             f"found samples_per_prompt={self.samples_per_prompt}, expected at least 2")
        return self


class DPO(Optim):
    """Direct preference optimisation on the preference data; the reference is the SFT model (with LoRA: the
    base with its adapters off, no second copy)."""
    epochs: int = Field(1, gt=0)
    lr: float = Field(5e-6, gt=0)           # DPO moves a policy far with small steps (TRL's default: 1e-6)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    beta: float = Field(0.1, gt=0)          # strength of the pull to the reference (higher = closer)
    loss: Literal["sigmoid", "ipo"] = "sigmoid"  # sigmoid: Rafailov et al.; ipo: Azar et al.


class Evaluate(_Section):
    max_new_tokens: Optional[int] = Field(None, gt=0)  # null = as ppo's (from the data)
    checker: Optional[str] = None           # "FILE.py:NAME", called NAME(prompt, response, row) -> bool on prompts
                                            # with an answer; null = exact match after whitespace normalisation
                                            # (the built-in task: its first number)
    batch_size: int = Field(64, gt=0)
    samples: int = Field(16, ge=0)          # sample generations kept in the artifact


class Tracking(_Section):
    enabled: bool = True
    uri: str = "sqlite:///mlruns/mlflow.db"  # relative paths are taken from the working directory
    artifacts: str = "mlruns/artifacts"
    experiment: str = "hybrid-rlhf"


class Lora(_Section):
    """LoRA adapters (peft) on a role's Linear layers; the names are checked against the model when it loads."""
    rank: int = Field(gt=0)
    alpha: float = Field(gt=0)              # scaling = alpha / rank
    targets: list[str] = Field(min_length=1)  # leaf module names, e.g. [q_proj, k_proj, v_proj, o_proj]

    @field_validator("targets")
    @classmethod
    def _named(cls, v: list[str]) -> list[str]:
        if any(not t.strip() for t in v):
            raise ValueError("expected non-empty module names")
        return v


class Role(_Section):
    precision: Optional[Literal["fp32", "bf16"]] = None  # null = engine.precision (4-bit compute dtype too)
    quantization: Literal["none", "8bit", "4bit"] = "none"  # bitsandbytes; 4bit = NF4 + double quantisation
    lora: Optional[Lora] = None             # {rank, alpha, targets}; a quantised trained role needs it (QLoRA)
    offload: bool = False                   # reward, reference: weights on the CPU, on the device only to score
    activation_checkpointing: Optional[bool] = None  # trained roles; null = engine.activation_checkpointing


class Roles(_Section):
    actor: Role = Role()
    critic: Role = Role()
    reference: Role = Role()
    reward: Role = Role()


class Layout(_Section):
    dp: int = Field(1, gt=0)
    tp: int = Field(1, gt=0)
    zero_stage: int = Field(0, ge=0, le=3)
    offload_optimizer: bool = False
    offload_params: bool = False


class Vllm(_Section):
    """The colocated vLLM engine (engine.rollout.backend: vllm; needs the vllm extra)."""
    bucket_mib: float = Field(256, gt=0)          # most weight bytes handed to the engine at once per sync
    kv_cache_gib: float = Field(1.0, gt=0)        # its KV cache (CPU builds round up to whole GiB)
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1)  # CUDA builds: the share of the GPU it may plan for
    sleep: Optional[bool] = None                  # null: sleep between rollouts where the build can (CUDA)


class Rollout(_Section):
    backend: Literal["native", "vllm"] = "native"  # native: static KV cache on the training weights; vllm: extra
    tp: int = Field(1, gt=0)
    offload_optimizer: bool = False                 # the actor's AdamW states go to CPU while rolling out
    # the most sequences generated at once (one KV cache's rows; more go chunk after chunk); null: the whole
    # rollout batch, or under engine.memory_budget_gib the largest chunk the planner measures to fit
    chunk_size: Optional[int] = Field(None, gt=0)
    # how the native rollout decodes a 4-bit actor's linears: bitsandbytes' own path, or the fused NF4 kernel
    # (hybridcore/fused_decode.py; CUDA); auto: fused on a GPU (a 25 % shorter GRPO step at 8B, bench/RESULTS.md
    # 2026-12-06), bitsandbytes on a CPU
    decode_4bit: Literal["auto", "bitsandbytes", "fused"] = "auto"
    # how the native rollout's decode steps attend: filled = a Triton kernel that reads only the KV-cache columns
    # written so far (hybridcore/decode_attention.py; CUDA), sdpa = SDPA over the whole preallocated cache;
    # auto: filled on a GPU where the kernel takes the model's heads (1.4-2.8x faster than sdpa per layer, decode
    # step 10 % shorter at the 1.5B shape on an H100, bench/RESULTS.md 2026-12-06 21:52), sdpa otherwise
    attention: Literal["auto", "sdpa", "filled"] = "auto"
    vllm: Vllm = Vllm()


class Engine(_Section):
    # where the stages run; auto = the GPU when torch sees one (the stages' GPU path: bench/stages_smoke.sh)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    precision: Literal["fp32", "bf16"] = "bf16"
    attention: Literal["sdpa", "eager"] = "sdpa"
    activation_checkpointing: bool = True
    # the planner is on when set: GiB for this process on its device; each stage measures its micro-step and picks
    # the largest power-of-two micro-batch that fits (hybridcore/planner.py); the batch sizes stay as configured
    memory_budget_gib: Optional[float] = Field(None, gt=0)
    share_base: bool = False                # actor + critic adapters on one frozen base
    # where the trained roles' AdamW moments wait between optimizer steps. host: in pinned CPU memory, on the
    # device only while it steps (2 x their bytes over PCIe a step; LoRA-sized states: a few hundred MiB off the
    # update's and the rollout's peaks). The plain torch engine's; DeepSpeed layouts: layout.offload_optimizer
    optimizer_states: Literal["device", "host"] = "device"
    roles: Roles = Roles()
    layout: Layout = Layout()
    rollout: Rollout = Rollout()


class Params(_Section):
    pipeline: Pipeline = Pipeline()
    model: Model = Model()
    data: Data = Data()
    sft: SFT = SFT()
    reward: Reward = Reward()
    ppo: PPO = PPO()
    dpo: DPO = DPO()
    evaluate: Evaluate = Evaluate()
    tracking: Tracking = Tracking()
    engine: Engine = Engine()


def _partial(model: type[BaseModel]) -> type[BaseModel]:
    """The same schema with every field optional and None by default, sections nested the same way."""
    fields = {}
    for name, f in model.model_fields.items():
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            ann = _partial(ann)
        fields[name] = (Optional[ann], None)
    return create_model(f"{model.__name__}Overrides", __config__=ConfigDict(extra="forbid"), **fields)


Overrides = _partial(Params)


def _loc_part(part) -> str:
    """A field path segment as written; a key that is not a plain name (spaces, line breaks, not a string)
    is quoted so that the path stays readable and on one line."""
    text = str(part)
    return text if isinstance(part, str) and text.replace("_", "a").replace("-", "a").isalnum() else repr(part)


def _one_line(err: ValidationError, source: str) -> str:
    e = err.errors()[0]
    loc = ".".join(_loc_part(p) for p in e["loc"] if not str(p).startswith("function-after")) or "(top level)"
    if e["type"] == "extra_forbidden":
        return f"{source}: unknown key '{loc}' (check the spelling; see params/tiny.yaml for every key)"
    got = e.get("input")
    got = "" if isinstance(got, dict) else f", got {_short(got)}"
    return f"{source}: {loc}: {e['msg'].removeprefix('Value error, ')}{got}"


def _short(value, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def resolve_preset(preset: str) -> Path:
    """A preset name in params/ or a path to a YAML file."""
    p = Path(preset)
    try:
        exists = p.exists()
    except (OSError, ValueError):  # a name too long for the file system, or holding a NUL byte
        exists = False
    if p.suffix in (".yaml", ".yml") or exists:
        if not p.is_file():
            raise InputError(f"params file {preset}: not found (expected a YAML file or a name in {PARAMS_DIR})")
        return p
    p = PARAMS_DIR / f"{preset}.yaml"
    if not p.is_file():
        names = ", ".join(sorted(q.stem for q in PARAMS_DIR.glob("*.yaml")))
        raise InputError(f"params preset '{preset}': not found (expected one of: {names}, or a YAML path)")
    return p


def parse_sets(sets: list[str]) -> dict:
    """`--set a.b.c=value` lines -> a nested dict; values are parsed as YAML scalars."""
    out: dict = {}
    for item in sets:
        key, eq, raw = item.partition("=")
        if not eq or not key.strip():
            raise InputError(f"--set {item!r}: expected key.path=value")
        node = out
        *parents, leaf = key.strip().split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise InputError(f"--set {item!r}: '{part}' was already set to a value, not a section")
        if isinstance(node.get(leaf), dict):
            raise InputError(f"--set {item!r}: '{key.strip()}' is a section already given fields by another --set")
        try:
            node[leaf] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            raise InputError(f"--set {item!r}: the value is not a YAML scalar or list "
                             f"({str(e).splitlines()[0]}); quote it if it is a string") from None
    return out


def load_params(preset: str = "tiny", overrides: Optional[dict] = None) -> Params:
    """Read a preset/YAML file, deep-merge overrides onto it and validate the result."""
    path = resolve_preset(preset)
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    except OSError as e:
        raise InputError(f"{path}: could not read it ({e.strerror or e}); expected a readable YAML file") from None
    except RecursionError:
        raise InputError(f"{path}: nested too deeply to read (expected sections of keys and values)") from None
    if not isinstance(doc, dict):
        raise InputError(f"{path}: expected a mapping of sections at the top level, got {type(doc).__name__}")
    doc = {k: ({} if v is None else v) for k, v in doc.items()}  # a section left with every key commented out
    if overrides:
        doc = deep_merge(doc, overrides)
    try:
        params = Params.model_validate(doc)
    except ValidationError as e:
        raise InputError(_one_line(e, str(path))) from None
    check_supported(params)
    return params



def fusable_4bit_decode(e: Engine) -> bool:
    """What the fused NF4 decode needs (engine.rollout.decode_4bit): a 4-bit actor rolled out by the native backend."""
    return e.rollout.backend == "native" and e.roles.actor.quantization == "4bit"


def check_supported(p: Params) -> None:
    """Engine options whose code has not landed yet are refused up front, naming the issue that brings them."""
    e = p.engine
    check_stages(p)
    check_roles(p)
    check_layout(p)
    if e.rollout.decode_4bit == "fused" and not fusable_4bit_decode(e):
        raise InputError(f"engine.rollout.decode_4bit: fused, but the actor is {e.roles.actor.quantization} and the "
                         f"backend {e.rollout.backend}; expected engine.roles.actor.quantization: 4bit with the "
                         f"native backend (or decode_4bit: bitsandbytes)")
    if e.rollout.attention == "filled" and e.rollout.backend != "native":
        raise InputError(f"engine.rollout.attention: filled is the native backend's decode attention, but the "
                         f"backend is {e.rollout.backend}; expected backend: native (or attention: auto)")
    if e.optimizer_states == "host":
        from hybridcore.engine import backend_for
        from hybridcore.parallel import Layout as Plain
        if backend_for(Plain.of(e.layout)) != "torch":
            raise InputError("engine.optimizer_states: host is the plain torch engine's, but engine.layout asks for "
                             "DeepSpeed; expected device (engine.layout.offload_optimizer keeps DeepSpeed's states "
                             "on the CPU)")
        if e.rollout.offload_optimizer:
            raise InputError("engine.rollout.offload_optimizer: true, but engine.optimizer_states: host already keeps "
                             "the states off the device between steps; expected false")
    if e.layout.tp % e.rollout.tp:
        raise InputError(f"engine.rollout.tp: found {e.rollout.tp}, expected a divisor of engine.layout.tp="
                         f"{e.layout.tp} (the rollout regroups the training shards into fewer, larger ones)")


def check_layout(p: Params) -> None:
    """What the stages run today: one process, plain AdamW or DeepSpeed ZeRO-1/2 (optimizer states optionally on
    CPU) for full fine-tunes, in one process or as a torchrun job of dp x tp ranks (tp: Megatron-style splits of
    the native model's linears). ZeRO-3 (parameters optionally on the CPU) with tp=1 for full fine-tunes. ZeRO-1/2
    also train LoRA adapters over a frozen (4/8-bit or shared) base in one process."""
    e, lay = p.engine, p.engine.layout
    if lay == Layout():
        return
    check_dpo_layout(p)
    from hybridcore.parallel import Layout as Plain, validate  # torch: only when a layout is asked for
    validate(Plain.of(lay))
    check_layout_features(p)
    if lay.dp > 1:
        check_dp_batches(p)
    if lay.zero_stage == 0:
        return
    # ZeRO-1/2 over LoRA adapters (+ a value head) on a frozen, possibly quantised or shared base: DeepSpeed sees
    # only the trained parameters (hybridcore/zero.py TrainedOnly)
    if e.rollout.offload_optimizer:
        raise InputError("engine.rollout.offload_optimizer: true under ZeRO (engine.layout.zero_stage > 0); expected "
                         "false, and engine.layout.offload_optimizer: true to keep the optimizer states on the CPU")


def check_dpo_layout(p: Params) -> None:
    """DPO runs in one process for now: its steps share batches over dp ranks as the RM's do, but no several-rank
    job of it has been run (stages/launch.py DISTRIBUTED leaves it out). Refused before SFT runs, not after."""
    lay = p.engine.layout
    if "dpo" in p.pipeline.stages and lay.dp * lay.tp > 1:
        from hybridcore.errors import NotYetSupported
        raise NotYetSupported(f"the dpo stage with engine.layout.dp={lay.dp}, tp={lay.tp} (dpo runs in one process; "
                              f"ZeRO and offload in one process work)", "issue 15's multi-process DPO")


TRAINED = ("actor", "critic", "reward")  # actor: SFT and PPO; reward: the RM stage; critic: PPO


def check_layout_features(p: Params) -> None:
    """What the layout cannot do yet, read from the one table the engines and the hybrid actor read too
    (hybridcore/engine.py limits): with dp > 1, tp > 1 or ZeRO-3, full fine-tunes (no adapters, quantised roles or
    share_base) without the planner; dp > 1 and tp > 1 roll out natively without optimizer offload; ZeRO-3 rolls
    out natively from parameters gathered in place (hybridcore/zero.py). The model's heads and widths are checked
    against tp where its config is read (stages/checks.py)."""
    from hybridcore.engine import refuse_unsupported
    e = p.engine
    roles = [getattr(e.roles, r) for r in TRAINED]
    refuse_unsupported(e.layout, {
        "adapters": e.share_base or any(r.lora is not None or r.quantization != "none" for r in roles),
        "rollout_backend": e.rollout.backend if e.rollout.backend != "native" else None,
        "rollout_offload": e.rollout.offload_optimizer,
        "planner": e.memory_budget_gib is not None})


def check_dp_batches(p: Params) -> None:
    """dp > 1 (a torchrun job, stages/launch.py): every batch split into equal shares per rank."""
    dp = p.engine.layout.dp
    for field, value in (("sft.batch_size", p.sft.batch_size), ("reward.batch_size", p.reward.batch_size),
                         ("ppo.rollout_batch_size", p.ppo.rollout_batch_size),
                         ("ppo.minibatch_size", p.ppo.minibatch_size)):
        if value % dp:
            raise InputError(f"{field}: found {value}, expected a multiple of engine.layout.dp={dp} (each rank "
                             f"takes an equal share of every batch)")


def check_roles(p: Params) -> None:
    """Role settings that cannot work together: a quantised trained role without LoRA (its base cannot take
    updates), LoRA on the never-trained reference, and share_base without both adapters or with roles that
    ask for a base different from the actor's."""
    e = p.engine
    for role in TRAINED:
        r = getattr(e.roles, role)
        if r.quantization != "none" and r.lora is None:
            raise InputError(f"engine.roles.{role}.quantization={r.quantization}: a quantised model that is "
                             f"trained needs adapters (QLoRA); expected engine.roles.{role}.lora to be set")
    if e.roles.reference.lora is not None:
        raise InputError("engine.roles.reference.lora: the reference policy is never trained; expected null")
    for role in ("actor", "critic"):
        if getattr(e.roles, role).offload:
            raise InputError(f"engine.roles.{role}.offload: true, but the {role} trains on the device every step; "
                             f"expected false (engine.layout.offload_optimizer moves its optimizer states instead)")
    if e.roles.reference.activation_checkpointing is not None:
        raise InputError("engine.roles.reference.activation_checkpointing: the reference policy is never trained "
                         "(nothing to recompute); expected null")
    if e.share_base and e.roles.critic.activation_checkpointing not in (None, e.roles.actor.activation_checkpointing):
        raise InputError("engine.roles.critic.activation_checkpointing: with engine.share_base the critic runs on "
                         "the actor's layers; expected null or the actor's value")
    if e.share_base and e.roles.reference.offload:
        raise InputError("engine.roles.reference.offload: true, but with engine.share_base the reference is the "
                         "actor's own base; expected false")
    if not e.share_base:
        return
    for role in ("actor", "critic") if p.ppo.estimator == "gae" else ("actor",):  # critic-free: no critic adapter
        if getattr(e.roles, role).lora is None:
            raise InputError(f"engine.share_base=true: the trained roles are adapters on one base; expected "
                             f"engine.roles.{role}.lora to be set")
    actor = e.roles.actor
    for role in ("critic", "reference"):
        r = getattr(e.roles, role)
        if r.quantization not in ("none", actor.quantization) or r.precision not in (None, actor.precision):
            raise InputError(f"engine.roles.{role}: with engine.share_base=true the {role} runs on the actor's "
                             f"base ({actor.quantization}, precision {actor.precision or e.precision}); found "
                             f"quantization={r.quantization}, precision={r.precision}; expected the actor's "
                             f"or none/null")


POLICY_STAGES = ("ppo", "dpo")  # the stages that train the final policy; evaluation compares one with SFT


def stage_list(p: Params) -> list[str]:
    """The stages to run, in pipeline order (pipeline.stages may list them in any order)."""
    return [s for s in STAGES if s in p.pipeline.stages]


def policy_stage(p: Params) -> Optional[str]:
    """The stage whose policy evaluation compares with SFT (ppo or dpo), None when neither runs."""
    return next((s for s in POLICY_STAGES if s in p.pipeline.stages), None)


def stage_inputs(p: Params, stage: str) -> list[str]:
    """The stages whose artifacts `stage` reads: PPO reads the RM when the reward stage runs; evaluation reads the
    SFT policy, the trained one and, when there is one, the RM."""
    run = p.pipeline.stages
    rm = ["reward"] if "reward" in run else []
    return {"sft": [], "reward": ["sft"], "ppo": ["sft", *rm], "dpo": ["sft"],
            "evaluate": ["sft", *rm, *([policy_stage(p)] if policy_stage(p) else [])]}[stage]


def check_stages(p: Params) -> None:
    """pipeline.stages: every stage's inputs listed too, one policy stage, and PPO with something to learn from."""
    run, listed = stage_list(p), p.pipeline.stages
    if len(set(listed)) != len(listed):
        raise InputError(f"pipeline.stages: {listed} names a stage twice; expected each stage once")
    if "sft" not in run:  # every other stage starts from SFT's artifact
        raise InputError(f"pipeline.stages: {run[0]} reads the sft stage's artifact, but sft is not listed (found "
                         f"{listed}); expected e.g. [sft, reward, ppo, evaluate], [sft, ppo, evaluate] or "
                         f"[sft, dpo, evaluate] (a cached stage costs nothing)")
    if all(s in run for s in POLICY_STAGES):
        raise InputError(f"pipeline.stages: both ppo and dpo listed (found {listed}); expected one policy stage "
                         f"per run (run the other with its own pipeline.stages)")
    if "evaluate" in run and policy_stage(p) is None:
        raise InputError(f"pipeline.stages: evaluate compares SFT with a trained policy, but neither ppo nor dpo is "
                         f"listed (found {listed}); expected ppo or dpo before evaluate")
    if "ppo" in run:
        check_ppo_rewards(p, "reward" in run)


def check_ppo_rewards(p: Params, has_rm: bool) -> None:
    """PPO learns from the RM, a reward function, or both mixed; a critic from the RM needs the RM."""
    cfg = p.ppo
    if not has_rm and cfg.reward_function is None:
        raise InputError("ppo.reward_function: null, and pipeline.stages has no reward stage, so PPO has no reward; "
                         "expected ppo.reward_function: FILE.py:NAME, or the reward stage listed before ppo")
    if has_rm and cfg.reward_model_weight == 0 and cfg.reward_function is None:
        raise InputError("ppo.reward_model_weight: 0 with no ppo.reward_function leaves PPO no reward; expected a "
                         "weight > 0 or a reward function")
    if not has_rm and cfg.estimator == "gae" and cfg.critic_init == "reward":
        raise InputError("ppo.critic_init: reward, but pipeline.stages has no reward stage to start the critic "
                         "from; expected critic_init: sft, or a critic-free ppo.estimator (grpo, rloo, "
                         "reinforce_pp)")
