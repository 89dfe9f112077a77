"""``sparseloco sample``: KV-cached decoding gives the logits and tokens of recomputing the whole
sequence, sampling is seeded, and the context slides past ``max_seq_len``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoint_fixtures import make_run, tiny_model, trained_like
from click.testing import CliRunner

from client.kvcache import KVCache, forward_cached
from client.sample import SampleSettings, generate, pick_token
from client.tools import main
from protocol.config import RunSpec
from protocol.model import Transformer


def model(**overrides: object) -> Transformer:
    spec = RunSpec.from_dict({"model": tiny_model(**overrides)})
    m = Transformer(spec.model)
    m.load_state_dict(trained_like(spec))
    return m.eval()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_cached_decoding_equals_recomputing_the_sequence(tied: bool) -> None:
    m = model(tie_embeddings=tied)
    seq = [0, 104, 101, 108, 108, 111]
    cache = KVCache()
    with torch.no_grad():
        step = forward_cached(m, torch.tensor([seq]), cache)[0, -1]
        for _ in range(40):  # greedy, one position per step
            full = m(torch.tensor([seq]))[0, -1]
            assert (step - full).abs().max().item() <= 1e-5
            token = int(torch.argmax(step))
            assert token == int(torch.argmax(full))
            seq.append(token)
            step = forward_cached(m, torch.tensor([[token]]), cache)[0, -1]
    assert cache.length == len(seq)


def test_chunks_after_a_cached_prefix_see_the_prefix_and_stay_causal() -> None:
    m = model()
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(3))
    cache = KVCache()
    with torch.no_grad():
        parts = [forward_cached(m, tokens[:, a:b], cache) for a, b in ((0, 20), (20, 21), (21, 48))]
        assert (torch.cat(parts, dim=1) - m(tokens)).abs().max().item() <= 1e-5


def test_the_cache_ends_where_the_rope_tables_end() -> None:
    m = model(max_seq_len=16)
    cache = KVCache()
    forward_cached(m, torch.zeros(1, 16, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="max_seq_len"):
        forward_cached(m, torch.zeros(1, 1, dtype=torch.long), cache)


def test_generation_is_seeded_and_slides_past_the_context() -> None:
    m = model(max_seq_len=16)
    settings = SampleSettings(max_new_tokens=50, temperature=1.0, top_p=0.9, seed=7, stop_at_eos=False)
    a, b = generate(m, [0, 1, 2], settings), generate(m, [0, 1, 2], settings)
    assert a == b and len(a.tokens) == 50 and a.stopped == "length"
    other = generate(m, [0, 1, 2], SampleSettings(50, 1.0, 0.9, seed=8, stop_at_eos=False))
    assert other.tokens != a.tokens


def test_greedy_decoding_is_the_argmax_of_the_full_forward() -> None:
    m = model()
    out = generate(m, [0, 5], SampleSettings(max_new_tokens=10, temperature=0.0, stop_at_eos=False))
    seq = [0, 5]
    with torch.no_grad():
        for _ in range(10):
            seq.append(int(torch.argmax(m(torch.tensor([seq]))[0, -1])))
    assert out.tokens == seq[2:]


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    gen = torch.Generator().manual_seed(0)
    assert {pick_token(logits, 1.0, 0.5, gen) for _ in range(50)} == {0}
    assert {pick_token(logits, 1.0, 0.8, gen) for _ in range(200)} == {0, 1}
    assert pick_token(logits, 0.0, 1.0, gen) == 0


def test_stops_at_the_end_of_document_token() -> None:
    m = model()
    with torch.no_grad():
        first = int(torch.argmax(m(torch.tensor([[0, 7]]))[0, -1]))
    out = generate(m, [0, 7], SampleSettings(max_new_tokens=5, temperature=0.0), eos_id=first)
    assert out.tokens == [] and out.stopped == "eos"


def test_cli_sample(tmp_path: Path) -> None:
    run = make_run(tmp_path, windows=(0, 4))
    args = ["sample", "--run", str(run.run_toml), "--prompt", "def ", "--max-new-tokens", "20", "--seed", "1"]
    a, b = CliRunner().invoke(main, args), CliRunner().invoke(main, args)
    assert a.exit_code == 0, a.output
    assert a.stdout == b.stdout and a.stdout.startswith("def ")
    assert "checkpoint 4" in a.stderr
