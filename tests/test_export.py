"""``sparseloco export``: a verified checkpoint becomes a Hugging Face ``LlamaForCausalLM`` whose
logits are ours (transformers is a test-only dependency)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from checkpoint_fixtures import make_run
from click.testing import CliRunner
from safetensors import safe_open

from client.checkpoints import load_checkpoint, locate, model_of
from client.export import export_hf, hf_names
from client.hf_tokenizer import byte_tokenizer
from client.tools import main
from protocol import layout
from protocol.data.tokenizer import ByteTokenizer
from protocol.errors import DigestMismatch, UnknownSigner
from protocol.identity import Identity

transformers = pytest.importorskip("transformers")

ROPE = {"rope_theta": 500.0, "norm_eps": 1e-6}  # not the defaults: both must reach the config


def exported(tmp_path: Path, *, tied: bool, dtype: str = "fp32") -> tuple[torch.nn.Module, torch.nn.Module, Path]:
    """(our model, the transformers model loaded from the export, the export directory)."""
    run = make_run(tmp_path, windows=(4,), tie_embeddings=tied, **ROPE)
    ckpt = load_checkpoint(run.spec, locate(run.spec, None, window=4, settings=run.settings))
    out = tmp_path / "hf"
    export_hf(ckpt, run.spec, out, dtype=dtype)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    return model_of(run.spec, ckpt), hf.eval(), out


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_transformers_logits_equal_ours(tmp_path: Path, tied: bool) -> None:
    ours, hf, out = exported(tmp_path, tied=tied)
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert hf.config.tie_word_embeddings is tied and hf.config.rms_norm_eps == 1e-6
    assert hf.config.max_position_embeddings == 64
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert ("lm_head.weight" in set(f.keys())) is not tied
    tokens = torch.randint(0, 256, (3, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
    assert diff <= 1e-4


def test_a_wrong_rotary_layout_would_be_caught(tmp_path: Path) -> None:
    """The equality test is sensitive to the q/k layout: the interleaved-pair permutation (what Meta
    checkpoints need) moves the logits far beyond the tolerance."""
    ours, hf, _ = exported(tmp_path, tied=False)
    heads, head_dim = 4, 16
    perm = torch.arange(head_dim).view(2, head_dim // 2).t().reshape(-1)  # (0, 8, 1, 9, …)
    with torch.no_grad():
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                w = proj.weight.view(heads, head_dim, -1)
                proj.weight.copy_(w[:, perm].reshape_as(proj.weight))
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max().item() > 1e-2


def test_bf16_export_writes_bf16_weights_that_load(tmp_path: Path) -> None:
    ours, hf, out = exported(tmp_path, tied=False, dtype="bf16")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
        meta = f.metadata()
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert meta["format"] == "pt" and meta["window"] == "4" and len(meta["fingerprint"]) == 64
    tokens = torch.randint(0, 256, (1, 32))
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max().item() < 0.5  # bf16 weights: rounding only


def test_exported_weights_are_as_readable_as_the_other_files(tmp_path: Path) -> None:
    _, _, out = exported(tmp_path, tied=False)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] and modes["config.json"] & 0o044, modes


def test_every_parameter_has_a_llama_name(tmp_path: Path) -> None:
    run = make_run(tmp_path, windows=(0,))
    names = hf_names(run.spec.model)
    assert set(names) == set(run.params[0]) and len(set(names.values())) == len(names)


def test_byte_tokenizer_json_maps_text_as_the_byte_tokenizer_does(tmp_path: Path) -> None:
    tok = byte_tokenizer()
    ours = ByteTokenizer()
    text = "".join(map(chr, range(128))) + "héllo wörld € 😀 Ā <0x00> \t\r\n  def f():\n    return 0\x00next"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids == ours.encode(text) and set(range(128)) <= set(ids)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.get_vocab_size(with_added_tokens=True) == 256
    # and through transformers' AutoTokenizer on an exported directory
    _, _, out = exported(tmp_path, tied=False)
    auto = transformers.AutoTokenizer.from_pretrained(out)
    assert auto(text)["input_ids"] == ours.encode(text) and auto.decode(auto(text)["input_ids"]) == text
    assert auto.eos_token_id == 0 and auto.pad_token_id == 0
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 0 and gen["bos_token_id"] == 0  # a document starts after the separator


def test_a_checkpoint_signed_by_another_key_is_refused(tmp_path: Path) -> None:
    run = make_run(tmp_path, windows=(4,), signer=Identity.from_seed(bytes(32)))
    with pytest.raises(UnknownSigner):
        load_checkpoint(run.spec, locate(run.spec, None, window=4, settings=run.settings))
    out = CliRunner().invoke(main, ["export", "--run", str(run.run_toml), str(tmp_path / "hf")])
    assert out.exit_code == 2 and "does not verify" in out.output and not (tmp_path / "hf").exists()


def test_tampered_weights_are_refused(tmp_path: Path) -> None:
    run = make_run(tmp_path, windows=(4,))
    weights = run.checkpoint_dir(4) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(DigestMismatch):
        load_checkpoint(run.spec, locate(run.spec, str(run.checkpoint_dir(4))))


def test_cli_exports_by_path_url_or_window(tmp_path: Path) -> None:
    run = make_run(tmp_path, windows=(0, 4))
    runner = CliRunner()
    for i, args in enumerate(
        [
            [str(run.checkpoint_dir(4) / "manifest")],  # the manifest file
            [f"{run.store_url}/{run.run_id}/checkpoint/{layout.window_str(4)}"],  # a URL into the store
            [str(run.store_dir)],  # the store directory, newest checkpoint
            ["--window", "latest"],  # the store of run.toml [local]
        ]
    ):
        out_dir = tmp_path / f"hf{i}"
        res = runner.invoke(main, ["export", "--run", str(run.run_toml), *args, str(out_dir)])
        assert res.exit_code == 0, res.output
        assert "exported checkpoint 4" in res.output
        config = json.loads((out_dir / "config.json").read_text())
        assert config["sparseloco"]["window"] == 4 and config["architectures"] == ["LlamaForCausalLM"]
    res = runner.invoke(main, ["export", "--run", str(run.run_toml), "--window", "0", str(tmp_path / "w0")])
    assert res.exit_code == 0 and "exported checkpoint 0" in res.output
    res = runner.invoke(main, ["export", "--run", str(run.run_toml), "--window", "3", str(tmp_path / "w3")])
    assert res.exit_code == 1 and "no checkpoint of window 3" in res.output
