"""``sparseloco checkpoints | export | eval | sample``: use the model a run trained.

Every command reads a checkpoint the validator signed, verified end to end (manifest signer among
the RunSpec's validator keys, file hashes, θ fingerprint: :mod:`client.checkpoints`). The RunSpec
is always given (``--run``): it holds the model's shape, the tokenizer and those keys. A checkpoint
is then named by a path or URL inside a store (``…/<run>/checkpoint/<window>[/manifest]``), a
store URL or directory with ``--window``, or ``--window`` alone (the store of the local settings:
run.toml's ``[local]`` table, ``SPARSELOCO_*`` variables)::

    sparseloco checkpoints --run run.toml
    sparseloco export --run run.toml --window latest hf-model/
    sparseloco eval --run run.toml --json
    sparseloco sample --run run.toml --prompt "def main(" --max-new-tokens 200

These commands import torch (and transformers, lm-eval) only when they run, so ``--help`` is quick.
Exit status: 0 done, 1 a configuration or store problem, 2 the checkpoint does not verify.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.table import Table

from client.store_access import ReadAccess, key_option
from protocol.config import RunSpec
from protocol.errors import ConfigError, ProtocolError, StoreError
from protocol.settings_cli import COMPUTE_FLAGS, STORE_FLAGS, Overrides, setting_options

if TYPE_CHECKING:
    from client.checkpoints import Checkpoint, Location
    from protocol.data.tokenizer import ByteTokenizer, HFTokenizer
    from protocol.store.base import ObjectStore

EXIT_ERROR = 1
EXIT_INVALID = 2
DEFAULT_SEQUENCES = 256

_run_option = click.option(
    "--run", "run_path", required=True, type=click.Path(dir_okay=False), help="The run's RunSpec TOML."
)
# --store (default: store.url of the local settings), --dht-peer and --settings; --device and --threads.
# The run's store opens as join opens it (store.grant_url: grants signed with --key, client.store_access).
_store_options = setting_options(*STORE_FLAGS)
_store_compute_options = setting_options(*STORE_FLAGS, *COMPUTE_FLAGS)
_window_option = click.option(
    "--window", default=None, help="Checkpoint window, or 'latest' (the default: the newest checkpoint)."
)


@contextmanager
def _user_errors() -> Iterator[None]:
    """Configuration and store problems exit 1, a checkpoint that does not verify exits 2."""
    try:
        yield
    except ProtocolError as exc:
        click.echo(f"error: the checkpoint does not verify: {exc}", err=True)
        sys.exit(EXIT_INVALID)
    except (ConfigError, StoreError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_ERROR)


def _load(
    access: ReadAccess, checkpoint: str | None, overrides: Overrides, window: str | None
) -> tuple[Location, Checkpoint]:
    from client.checkpoints import load_checkpoint, locate

    spec, store = access.spec, access.local.store
    store_url, dht_peers = overrides.get("store.url"), tuple(overrides.get("store.dht_bootstrap") or ())
    loc = locate(spec, checkpoint, store_url=store_url, window=window, dht_peers=dht_peers, settings=store)
    return loc, load_checkpoint(spec, loc, store, identity=access.identity)


def _open(access: ReadAccess, loc: Location) -> ObjectStore:
    """The store of ``loc``: the run's own store as join opens it (grants), another with its credentials."""
    return access.open(loc.store_url, loc.dht_peers)


def _run_tokenizer(access: ReadAccess, loc: Location) -> ByteTokenizer | HFTokenizer:
    """The run's tokenizer (a Hugging Face one fetched from the checkpoint's store and verified)."""
    from protocol.data.run_data import run_tokenizer

    with _open(access, loc) as store:
        return run_tokenizer(access.spec, store, access.local.data)


def _device(overrides: Overrides) -> str:
    """The torch device of ``--device`` (cuda when there is one; ``cuda:N`` checked against the
    devices torch sees); ``--threads`` > 0 sets torch's CPU threads."""
    import torch

    from protocol.devices import resolve_device

    threads = overrides.get("compute.threads") or 0
    if threads > 0:
        torch.set_num_threads(threads)
    return resolve_device(overrides.get("compute.device") or "")


def _when(ts: float | None) -> str:
    return "–" if ts is None else datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _console() -> Console:
    # piped output is not cut to 80 columns (a table read in a file or a pager)
    return Console(width=None if sys.stdout.isatty() else 200, highlight=False)


# ------------------------------------------------------------------------------ checkpoints
@click.command("checkpoints")
@_run_option
@_store_options
@key_option
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array of checkpoints.")
def checkpoints_cmd(run_path: str, overrides: Overrides, key_path: str | None, as_json: bool) -> None:
    """List the run's checkpoints: window, size, signer, θ fingerprint, time.

    \b
    --json fields: window, size (bytes of its files), signed_by (hex public key),
    signer_peer_id, fingerprint, published_at (unix s: when the window opened),
    aggregate (digest θ results from), error (why the manifest does not verify, else null).
    Manifests are verified (signer, run); weights are not read.
    """
    from dataclasses import asdict

    from client.checkpoints import list_checkpoints

    with _user_errors():
        access = ReadAccess.load(run_path, overrides, key_path)
        spec = access.spec
        store = access.open()
        try:
            infos = list_checkpoints(spec, store)
        finally:
            store.close()
    if as_json:
        click.echo(json.dumps([asdict(i) for i in infos]))
        return
    t = Table(title=f"checkpoints of run {spec.name} ({len(infos)})")
    for c in ("window", "size", "signed by", "fingerprint", "published at"):
        t.add_column(c, justify="right" if c in ("window", "size") else "left")
    for i in infos:
        if i.error is not None:
            t.add_row(str(i.window), "–", f"[red]INVALID[/red] {i.error}", "", "")
            continue
        t.add_row(
            str(i.window), f"{i.size:,}", (i.signed_by or "")[:16], (i.fingerprint or "")[:16], _when(i.published_at)
        )
    _console().print(t)


# ------------------------------------------------------------------------------ export
@click.command("export")
@click.argument("paths", nargs=-1, required=True, metavar="[CHECKPOINT] OUT_DIR")
@_run_option
@_store_options
@key_option
@_window_option
@click.option("--dtype", type=click.Choice(["bf16", "fp32"]), default="fp32", show_default=True, help="Weight dtype.")
def export_cmd(
    paths: tuple[str, ...],
    run_path: str,
    overrides: Overrides,
    key_path: str | None,
    window: str | None,
    dtype: str,
) -> None:
    """Write a checkpoint as a Hugging Face model directory (LlamaForCausalLM, no custom code).

    OUT_DIR gets config.json, generation_config.json, model.safetensors and the tokenizer
    files; transformers' AutoModelForCausalLM / AutoTokenizer .from_pretrained(OUT_DIR) load it.
    CHECKPOINT (optional): a checkpoint folder or manifest inside a store, a store URL or
    directory; without it, --store / the local store.url and --window.
    """
    if len(paths) > 2:
        raise click.UsageError("expected [CHECKPOINT] OUT_DIR")
    checkpoint, out_dir = (None, paths[0]) if len(paths) == 1 else paths
    from client.export import export_hf

    started = time.perf_counter()
    with _user_errors():
        access = ReadAccess.load(run_path, overrides, key_path)
        spec = access.spec
        loc, ckpt = _load(access, checkpoint, overrides, window)
        files = export_hf(ckpt, spec, out_dir, dtype=dtype, tokenizer=_run_tokenizer(access, loc))
    n_params = sum(t.numel() for t in ckpt.params.values())
    for f in files:
        click.echo(f"wrote {f}")
    click.echo(
        f"exported checkpoint {ckpt.window} of run {spec.name} (fingerprint {ckpt.manifest.fingerprint[:16]}, "
        f"signed by {ckpt.signer[:16]}): LlamaForCausalLM, {n_params:,} parameters, {dtype}, "
        f"{time.perf_counter() - started:.1f} s -> {out_dir}"
    )


# ------------------------------------------------------------------------------ eval
@click.command("eval")
@click.argument("checkpoint", required=False)
@_run_option
@_store_compute_options
@key_option
@_window_option
@click.option(
    "--data",
    default=None,
    help="Held-out data: builtin:stdlib, a shard directory or any text [default: the run's validation split].",
)
@click.option(
    "--sequences", type=click.IntRange(1), default=DEFAULT_SEQUENCES, show_default=True, help="Sequences to score."
)
@click.option(
    "--tasks",
    default=None,
    help="Zero-shot lm-eval tasks, comma-separated ('' for none) [default: arc_easy,hellaswag,piqa].",
)
@click.option("--task-limit", type=click.IntRange(1), default=None, help="At most this many examples per task.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def eval_cmd(
    checkpoint: str | None,
    run_path: str,
    overrides: Overrides,
    key_path: str | None,
    window: str | None,
    data: str | None,
    sequences: int,
    tasks: str | None,
    task_limit: int | None,
    as_json: bool,
) -> None:
    """Validation loss, perplexity and bits per byte of a checkpoint, and zero-shot tasks.

    \b
    Held-out data: the validation split of the run's dataset (the validator's), another
    dataset's validation split (builtin:stdlib, a shard directory) or all of any text.
    Zero-shot tasks run through lm-eval's Python API on the exported model when lm-eval is
    installed and the tasks' data is in the local Hugging Face cache (the default tasks only
    where lm-eval is installed); a task asked for with --tasks that cannot run is listed as
    skipped, with the reason.
    --json fields: checkpoint {window, fingerprint, signed_by, store}, data, sequences,
    tokens, bytes, loss (nats/token), perplexity, bits_per_byte, tasks [{task, metrics,
    skipped}], seconds.
    """
    from client.checkpoints import model_of
    from client.evaluate import heldout_data
    from client.zero_shot import DEFAULT_TASKS, lm_eval_available
    from protocol.evaluation import score_lm

    started = time.perf_counter()
    # The default tasks run where lm-eval is installed; without it only tasks asked for are listed
    # (as skipped, with why): a default nobody asked for is not news.
    default = list(DEFAULT_TASKS) if lm_eval_available() else []
    task_list = default if tasks is None else [t.strip() for t in tasks.split(",") if t.strip()]
    with _user_errors():
        dev = _device(overrides)  # a device that does not exist fails before any download
        access = ReadAccess.load(run_path, overrides, key_path)
        spec, local = access.spec, access.local
        loc, ckpt = _load(access, checkpoint, overrides, window)
        with _open(access, loc) as store:  # the run's dataset and tokenizer lie there
            held = heldout_data(spec, data, sequences=sequences, local=local.data, store=store)
        score = score_lm(model_of(spec, ckpt, dev), held.batches, held.tokenizer, dev)
        task_results = _zero_shot(spec, ckpt, task_list, dev, task_limit, lambda: _run_tokenizer(access, loc))
    report: dict[str, Any] = {
        "checkpoint": {
            "window": ckpt.window,
            "fingerprint": ckpt.manifest.fingerprint,
            "signed_by": ckpt.signer,
            "store": loc.store_url,
        },
        "data": held.description,
        "sequences": score.sequences,
        "tokens": score.tokens,
        "bytes": score.bytes,
        "loss": score.loss,
        "perplexity": score.perplexity,
        "bits_per_byte": score.bits_per_byte,
        "tasks": [{"task": r.task, "metrics": r.metrics, "skipped": r.skipped} for r in task_results],
        "seconds": round(time.perf_counter() - started, 2),
    }
    if as_json:
        click.echo(json.dumps(report))
        return
    _print_eval(report)


def _zero_shot(
    spec: RunSpec,
    ckpt: Checkpoint,
    tasks: list[str],
    device: str,
    limit: int | None,
    tokenizer: Callable[[], ByteTokenizer | HFTokenizer],
) -> list[Any]:
    """lm-eval on the exported model (exported into a temporary directory only when lm-eval is there)."""
    from client.export import export_hf
    from client.zero_shot import lm_eval_available, run_tasks

    if not tasks or not lm_eval_available():
        return run_tasks("", tasks)  # empty, or each task skipped with the reason
    with tempfile.TemporaryDirectory(prefix="sparseloco-eval-") as tmp:
        export_hf(ckpt, spec, tmp, dtype="fp32", tokenizer=tokenizer())
        return run_tasks(tmp, tasks, device=device, limit=limit)


def _print_eval(r: dict[str, Any]) -> None:
    console = _console()
    console.print(f"checkpoint {r['checkpoint']['window']} ({r['checkpoint']['fingerprint'][:16]}) on {r['data']}")
    t = Table()
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("sequences", f"{r['sequences']:,}")
    t.add_row("tokens", f"{r['tokens']:,}")
    t.add_row("bytes", f"{r['bytes']:,}")
    t.add_row("loss (nats/token)", f"{r['loss']:.4f}")
    t.add_row("perplexity", f"{r['perplexity']:.3f}")
    t.add_row("bits per byte", f"{r['bits_per_byte']:.4f}")
    console.print(t)
    if r["tasks"]:
        tt = Table(title="zero-shot tasks (lm-eval)")
        tt.add_column("task")
        tt.add_column("result")
        for task in r["tasks"]:
            if task["metrics"] is not None:
                tt.add_row(task["task"], "  ".join(f"{k} {v:.4f}" for k, v in sorted(task["metrics"].items())))
            else:
                tt.add_row(task["task"], f"skipped: {task['skipped']}")
        console.print(tt)


# ------------------------------------------------------------------------------ sample
@click.command("sample")
@click.argument("checkpoint", required=False)
@_run_option
@_store_compute_options
@key_option
@_window_option
@click.option("--prompt", required=True, help="Text to continue.")
@click.option("--max-new-tokens", type=click.IntRange(1), default=200, show_default=True)
@click.option("--temperature", type=click.FloatRange(0.0), default=0.8, show_default=True, help="0: greedy.")
@click.option("--top-p", type=click.FloatRange(0.0, 1.0, min_open=True), default=0.95, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def sample_cmd(
    checkpoint: str | None,
    run_path: str,
    overrides: Overrides,
    key_path: str | None,
    window: str | None,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
) -> None:
    """Continue a prompt with a checkpoint's model (KV-cached decoding).

    The prompt and its continuation go to stdout; a line about the checkpoint goes to stderr.
    Generation stops at the end-of-document token or after --max-new-tokens.
    """
    from client.checkpoints import model_of
    from client.sample import SampleSettings, generate

    with _user_errors():
        dev = _device(overrides)  # a device that does not exist fails before any download
        access = ReadAccess.load(run_path, overrides, key_path)
        spec = access.spec
        loc, ckpt = _load(access, checkpoint, overrides, window)
        tok = _run_tokenizer(access, loc)
        model = model_of(spec, ckpt, dev)
    ids = ([tok.eos_id] if tok.eos_id is not None else []) + tok.encode(prompt)  # documents follow a separator
    if not ids:
        raise click.BadParameter("the prompt encodes to no tokens", param_hint="--prompt")
    settings = SampleSettings(max_new_tokens, temperature, top_p, seed)
    out = generate(model, ids, settings, tok.eos_id)
    click.echo(
        f"checkpoint {ckpt.window} ({ckpt.manifest.fingerprint[:16]}): {len(out.tokens)} tokens, stopped at {out.stopped}",
        err=True,
    )
    click.echo(prompt + tok.decode(out.tokens))


COMMANDS = (checkpoints_cmd, export_cmd, eval_cmd, sample_cmd)
