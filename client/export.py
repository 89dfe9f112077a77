"""Export a verified checkpoint as a Hugging Face ``LlamaForCausalLM`` directory (``sparseloco export``).

The decoder of :mod:`protocol.model` is LLaMA's architecture, so θ maps onto
``transformers``' Llama names one tensor to one tensor, with no custom code::

    ckpt = load_checkpoint(spec, locate(spec, None, window="latest"))     # client.checkpoints
    export_hf(ckpt, spec, "out/", dtype="bf16")
    # AutoModelForCausalLM.from_pretrained("out/") -> LlamaForCausalLM, same logits

What has to agree, and why it does:

* rotary embeddings: ours rotates the pairs (x[i], x[i + d/2]) — the "rotate half" convention of
  ``transformers``' Llama — so q and k are copied as they are (Meta's original interleaved-pair
  checkpoints are the ones that need a q/k permutation);
* SwiGLU: ``w_down(silu(w_gate x) * w_up x)`` is Llama's ``down(act(gate x) * up x)``, act silu;
* RMSNorm: same formula (fp32 normalisation, weight applied after), eps = ``model.norm_eps``;
* attention: full multi-head (as many key/value heads as heads), no biases, 1/√head_dim scale;
* tied embeddings: ``tie_word_embeddings`` and no ``lm_head.weight`` in the file;
* ``rope_theta`` and ``max_position_embeddings`` (= ``model.max_seq_len``) from the RunSpec.

Written files: ``config.json``, ``generation_config.json``, ``model.safetensors`` (fp32 or bf16,
with the checkpoint's run hash, window and fingerprint in its metadata) and the tokenizer files of
:mod:`client.hf_tokenizer`. The byte tokenizer has no BOS token; a document starts after the
separator token, so ``bos_token_id`` is that token, as it was in training.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from client.checkpoints import Checkpoint
from client.hf_tokenizer import tokenizer_files
from protocol.config import ModelConfig, RunSpec
from protocol.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from protocol.errors import ConfigError, SchemaMismatch
from protocol.files import atomic_write

__all__ = ["DTYPES", "export_hf", "hf_config", "hf_state_dict"]

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
_TORCH_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}
WEIGHTS = "model.safetensors"

# Our block parameter -> Llama's, below ``blocks.<i>.`` / ``model.layers.<i>.``.
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w_gate.weight": "mlp.gate_proj.weight",
    "mlp.w_up.weight": "mlp.up_proj.weight",
    "mlp.w_down.weight": "mlp.down_proj.weight",
}


def hf_names(cfg: ModelConfig) -> dict[str, str]:
    """Our parameter name -> its ``LlamaForCausalLM`` state-dict name (every parameter of ``cfg``)."""
    names = {"embed.weight": "model.embed_tokens.weight", "head.norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        names["head.output.weight"] = "lm_head.weight"
    for i in range(cfg.n_layers):
        names.update({f"blocks.{i}.{ours}": f"model.layers.{i}.{theirs}" for ours, theirs in _BLOCK_NAMES.items()})
    return names


def hf_state_dict(
    params: Mapping[str, Tensor], cfg: ModelConfig, dtype: torch.dtype = torch.float32
) -> dict[str, Tensor]:
    """θ under Llama's names, contiguous CPU tensors of ``dtype``; SchemaMismatch unless ``params``
    holds exactly the parameters of ``cfg``."""
    names = hf_names(cfg)
    if set(params) != set(names):
        missing, extra = sorted(set(names) - set(params)), sorted(set(params) - set(names))
        raise SchemaMismatch(f"θ does not match the model config: missing {missing[:3]}, unexpected {extra[:3]}")
    return {names[n]: t.detach().to("cpu", dtype).contiguous() for n, t in sorted(params.items())}


def hf_config(
    cfg: ModelConfig, *, eos_id: int | None, dtype: str = "fp32", provenance: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """``config.json`` of the exported ``LlamaForCausalLM``.

    ``rope_theta`` is written both at the top level (transformers 4.x) and in ``rope_parameters``
    (5.x) so either version reads it. ``provenance`` (run hash, window, fingerprint …) is kept under
    ``sparseloco``."""
    head_dim = cfg.dim // cfg.n_heads
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "torch_dtype": _TORCH_DTYPE_NAMES[dtype],
        "use_cache": True,
    }
    if provenance:
        config["sparseloco"] = dict(provenance)
    return config


def generation_config(eos_id: int | None) -> dict[str, Any]:
    """``generation_config.json``: generation stops at the end-of-document token. (No ``max_length``:
    ``transformers`` warns when it meets ``max_new_tokens``; the trained context is in config.json.)"""
    return {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id}


def export_hf(
    ckpt: Checkpoint,
    spec: RunSpec,
    out_dir: str | Path,
    *,
    dtype: str = "fp32",
    tokenizer: ByteTokenizer | HFTokenizer | None = None,
) -> list[Path]:
    """Write the Hugging Face directory of ``ckpt`` (a checkpoint of run ``spec``) into ``out_dir``.

    ``tokenizer``: the run's (:func:`protocol.data.run_data.run_tokenizer` fetches a Hugging Face one
    from the run's store); None loads ``spec.data.tokenizer`` directly (``bytes``). Files are
    replaced one by one, atomically; returns their paths."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    cfg = spec.model
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(spec.data.tokenizer)
    _check_vocab(tokenizer, cfg)
    tok_files = tokenizer_files(tokenizer, max_length=cfg.max_seq_len)
    provenance = {
        "run_hash": spec.hash(),
        "run_name": spec.name,
        "window": ckpt.window,
        "fingerprint": ckpt.manifest.fingerprint,
        "aggregate": ckpt.manifest.aggregate,
        "published_at": ckpt.manifest.published_at,
        "signed_by": ckpt.signer,
        "tokenizer": spec.data.tokenizer,
    }
    files: dict[str, bytes] = {
        "config.json": _json(hf_config(cfg, eos_id=tokenizer.eos_id, dtype=dtype, provenance=provenance)),
        "generation_config.json": _json(generation_config(tokenizer.eos_id)),
        **tok_files,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = out / WEIGHTS
    _write_weights(weights, hf_state_dict(ckpt.params, cfg, DTYPES[dtype]), {k: str(v) for k, v in provenance.items()})
    for name, data in files.items():
        atomic_write(out / name, data)
    return [weights, *(out / name for name in files)]


def _write_weights(path: Path, tensors: dict[str, Tensor], provenance: dict[str, str]) -> None:
    """Stream the tensors into a temporary file beside ``path`` and rename it into place (θ of a
    large model is not held twice in memory, and a crash never leaves half a file under ``path``)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata={"format": "pt", **provenance})
        os.chmod(tmp, 0o666 & ~_umask())  # safetensors creates 0600: readable like the files beside it
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())  # on disk before it has the final name, like every atomic_write
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` would, for every thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def _check_vocab(tokenizer: ByteTokenizer | HFTokenizer, cfg: ModelConfig) -> None:
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} tokens, the model's embedding only {cfg.vocab_size}"
        )


def _json(obj: Mapping[str, Any]) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
