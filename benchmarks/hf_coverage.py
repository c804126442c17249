"""Which transformers text model families run on attn_implementation="multihead".

For every model type of the installed transformers with a base model in ``AutoModel`` and a
plain text config (no sub-configs: vision, audio and multimodal models are left out), build a
tiny random model from its config (2 layers, width 64, 4 heads, vocabulary 100), then:

- run a padded batch through "multihead" and through "sdpa" (or "eager" where the family has
  no sdpa) and compare the last hidden state on the real tokens (torch.testing's float32
  closeness passes: 1e-5 + 1.3e-6 times the reference's size);
- capture every head and row with :func:`multihead.capture` and compare with "eager"'s
  ``output_attentions`` on the real query rows (<= 1e-5 passes; skipped where eager returns no
  weights).

Each family ends as ``supported``, ``forward only`` (the forward matches, observing its heads is
refused: hybrids with attention outside the interface, several calls per layer), ``refused``
(multihead raised its own clear error: a feature it does not support, or attention not routed
through the interface), ``no softmax attention`` (state-space and Fourier-mixing families: no
heads), ``mismatch`` (a silent difference: a bug), ``failed`` (anything else raised inside the
multihead path) or ``skipped`` (the family could not be built or run with a small config even on
sdpa/eager: not counted). A supported family's row lists the score modifications its calls
carry (``softcap``, ``sinks``) and whether it is a hybrid observed on its softmax layers.

Usage::

    python benchmarks/hf_coverage.py [--only llama,bert] [--results-dir DIR] [--quick]
    python benchmarks/hf_coverage.py --docs    # docs/huggingface.md's table from the JSON

Writes ``benchmarks/results/hf_coverage.json`` and prints the table; a full run (not ``--only``
or ``--quick``) also rewrites docs/huggingface.md's table, between its ``hf_coverage`` markers.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import json
import logging
import os
import re
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from common import format_table, machine_info, write_json  # noqa: E402

import multihead  # noqa: E402

TOL = 1e-5
RTOL = 1.3e-6  # torch.testing's float32 rtol, for the hidden states (beside TOL)
STATUSES = (
    "supported", "forward only", "refused", "no softmax attention", "mismatch", "failed",
    "skipped",
)  # fmt: skip
DOCS = Path(__file__).resolve().parents[1] / "docs" / "huggingface.md"
BEGIN, END = (
    "<!-- hf_coverage: begin (benchmarks/hf_coverage.py --docs) -->",
    "<!-- hf_coverage: end -->",
)
QUICK = ["bert", "gpt2", "llama", "t5", "gemma2", "gpt_oss", "gptj"]
# Text families whose config holds sub-configs of text modules (an encoder's and a decoder's):
# built with SMALL applied to each.
TEXT_SUB_CONFIGS = ("t5gemma",)

# Config attributes set on every family that has them (names vary by family).
SMALL: dict[str, Any] = {
    "vocab_size": 100,
    "hidden_size": 64,
    "d_model": 64,
    "n_embd": 64,
    "dim": 64,
    "embed_dim": 64,
    "num_hidden_layers": 2,
    "num_layers": 2,
    "n_layer": 2,
    "n_layers": 2,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "num_decoder_layers": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "num_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "d_kv": 16,
    "intermediate_size": 128,
    "ffn_dim": 128,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "d_ff": 128,
    "n_inner": 128,
    "hidden_dim": 128,
    "max_position_embeddings": 128,
    "n_positions": 128,
    "rotary_dim": 8,
    "pad_token_id": 0,
    "num_experts": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
}


class Timeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: int):  # type: ignore[no-untyped-def]
    def fire(*_: object) -> None:
        raise Timeout(f"took more than {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def families() -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    out = []
    for model_type in sorted(MODEL_MAPPING_NAMES):
        try:
            config_cls = CONFIG_MAPPING[model_type]
        except (KeyError, ValueError, ImportError):
            continue
        if getattr(config_cls, "sub_configs", None) and model_type not in TEXT_SUB_CONFIGS:
            continue  # vision / audio / multimodal: not a text family
        if "vocab_size" not in inspect.signature(config_cls.__init__).parameters:
            continue
        out.append(model_type)
    return out


def small_config(model_type: str) -> Any:
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    _shrink(config)
    if model_type in TEXT_SUB_CONFIGS:  # the whole config made again from its small parts
        parts = {name: getattr(config, name) for name in config.sub_configs}
        for part in parts.values():
            _shrink(part)
        config = type(config)(**parts, vocab_size=SMALL["vocab_size"])
    return config


def _shrink(config: Any) -> None:
    for name, value in SMALL.items():
        if name in ("head_dim",) and getattr(config, name, None) is None:
            continue
        if hasattr(config, name) and isinstance(getattr(config, name), int):
            try:
                setattr(config, name, value)
            except AttributeError:  # a read-only property derived from other fields
                pass
    for name in ("layer_types", "block_types"):
        value = getattr(config, name, None)
        if isinstance(value, list) and value:
            try:  # the first layers' kinds, for 2 layers
                setattr(config, name, (value * 2)[:2])
            except AttributeError:
                pass


def build(model_type: str) -> tuple[Any, Any]:
    from transformers import AutoModel

    config = small_config(model_type)
    torch.manual_seed(0)
    model = AutoModel.from_config(config, attn_implementation="eager").eval()
    return config, model


def inputs_for(model: Any, config: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A padded batch (B=2, T=8): left padding for causal models, right otherwise."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 100, (2, 8), generator=g)
    mask = torch.ones(2, 8, dtype=torch.long)
    causal = any(getattr(m, "is_causal", False) for m in model.modules())
    if config.is_encoder_decoder:
        causal = False
    if causal:
        mask[1, :3] = 0
    else:
        mask[1, 5:] = 0
    params = inspect.signature(model.forward).parameters
    kw: dict[str, torch.Tensor] = {"input_ids": ids}
    if "attention_mask" in params:
        kw["attention_mask"] = mask
    else:
        mask = torch.ones_like(mask)
    if config.is_encoder_decoder and "decoder_input_ids" in params:
        kw["decoder_input_ids"] = torch.randint(4, 100, (2, 5), generator=g)
    return kw, mask


def hidden(out: Any) -> torch.Tensor:
    if getattr(out, "last_hidden_state", None) is not None:
        return out.last_hidden_state
    return next(v for v in out.values() if isinstance(v, torch.Tensor))


def eager_attentions(out: Any) -> list[torch.Tensor] | None:
    if getattr(out, "encoder_attentions", None) is not None:
        pairs = zip(out.decoder_attentions or (), out.cross_attentions or (), strict=False)
        found = list(out.encoder_attentions) + [w for p in pairs for w in p]
        return found if all(isinstance(a, torch.Tensor) for a in found) else None
    attentions = getattr(out, "attentions", None)
    if not attentions or not all(isinstance(a, torch.Tensor) for a in attentions):
        return None  # none, or per-layer structures (Pegasus-X's global/local dicts)
    return list(attentions)


def check(model_type: str) -> dict[str, Any]:
    """One family's row: status, reason, max differences."""
    row: dict[str, Any] = {"family": model_type, "status": "skipped", "reason": ""}
    model: Any = None
    try:
        config, model = build(model_type)
        kw, mask = inputs_for(model, config)
        reference = "sdpa" if getattr(model, "_supports_sdpa", False) else "eager"
        with torch.no_grad():
            if reference == "sdpa":
                model.set_attn_implementation("sdpa")
            ref = hidden(model(**kw))
            model.set_attn_implementation("eager")
            eager = eager_attentions(model(**kw, output_attentions=True))
    except Exception as error:  # noqa: BLE001 - a family that cannot be built is skipped
        row["reason"] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
        return row
    row["reference"] = reference
    real = mask.bool()
    problems: list[str] = []
    try:  # 1. the forward on "multihead": output vs the reference, output_attentions vs eager
        with torch.no_grad():
            model.set_attn_implementation("multihead")
            got = hidden(model(**kw))
            try:
                direct = eager_attentions(model(**kw, output_attentions=True))
            except NotImplementedError as error:  # weights refused (sinks): the output stands
                direct = None
                row["output_attentions"] = str(error).splitlines()[0][:160]
    except Exception as error:  # noqa: BLE001 - classified below
        return _fail(row, error)
    finally:
        model.set_attn_implementation("eager")
    if got.shape != ref.shape:
        row["reason"] = f"the reference's own output shape varies ({tuple(ref.shape)})"
        return row  # skipped: a random-length output (VITS's durations), nothing to compare
    if got.shape[:2] != real.shape:
        real = torch.ones(got.shape[:2], dtype=torch.bool)
    row["max_diff_output"] = float((got[real] - ref[real]).abs().max())
    # torch.testing's float32 closeness: the hidden states are no weights in [0, 1], and their
    # rounding grows with their size (Gemma's embeddings scaled by sqrt(width))
    if not bool(torch.isclose(got[real], ref[real], rtol=RTOL, atol=TOL).all()):
        problems.append(f"output differs by {row['max_diff_output']:.2e}")
    if eager is not None and direct is not None:
        _compare_weights(row, "output_attentions", direct, eager, real, problems)
    if problems:
        row["status"], row["reason"] = "mismatch", "; ".join(problems)
        return row
    try:  # 2. capture every head and row (the model on eager outside the block)
        with torch.no_grad(), multihead.capture(model) as rec, modifications(model) as mods:
            model(**kw)
    except Exception as error:  # noqa: BLE001 - classified below
        _fail(row, error)
        if row["status"] == "refused" and "does not route" not in row["reason"]:
            row["status"] = "forward only"  # the routed forward matched; observing is refused
        return row
    row["layers"] = len(rec.weights)
    if eager is not None and len(rec.weights) < len(eager):
        # a hybrid whose other mixers are no attention layers (MiniMax's linear attention
        # returns its own matrices as "attentions"): eager's weights of the captured layers
        where = [getattr(model.get_submodule(r.name), "layer_idx", None) for r in rec.records]
        if all(isinstance(i, int) and i < len(eager) for i in where):
            row["reason"] = f"{len(where)} of its {len(eager)} layers are softmax attention"
            eager = [eager[i] for i in where]
            mods.add("hybrid")
    row["features"] = sorted(mods)
    if eager is not None:
        _compare_weights(row, "capture", rec.weights, eager, real, problems)
    if problems:
        row["status"], row["reason"] = "mismatch", "; ".join(problems)
    else:
        row["status"] = "supported"
        if eager is None:
            row["reason"] = "weights not compared (eager returns none)"
    return row


@contextlib.contextmanager
def modifications(model: Any):  # type: ignore[no-untyped-def]
    """The score modifications the model's attention calls carry, seen by observers on every
    site while the block runs: a set of "softcap" and "sinks" (and "recipe" for a family whose
    attention is computed in the module's own code, observed through its output projection
    and its score recipe)."""
    seen: set[str] = set()

    from multihead import hf

    for site in multihead.model_map(model).sites:
        if not hf.routed(type(site.module)):  # heads at its output projection, a score recipe
            seen.add("recipe")

    def observer(call: Any, out: torch.Tensor) -> None:
        if call.mods.softcap is not None:
            seen.add("softcap")
        if call.mods.sinks is not None:
            seen.add("sinks")

    handles = [
        site.attention.register_observer(observer) for site in multihead.model_map(model).sites
    ]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def _fail(row: dict[str, Any], error: Exception) -> dict[str, Any]:
    """multihead's own refusals (they name multihead or the interface) vs anything else."""
    message = str(error).splitlines()[0] if str(error) else ""
    ours = isinstance(error, (NotImplementedError, ValueError)) and (
        "multihead" in message or "AttentionInterface" in message
    )
    row["status"] = "refused" if ours else "failed"
    if ours and "has no attention layers" in message:
        row["status"] = "no softmax attention"
    row["reason"] = f"{type(error).__name__}: {message[:160]}"
    return row


def _compare_weights(
    row: dict[str, Any],
    what: str,
    got: list[torch.Tensor],
    eager: list[torch.Tensor],
    real: torch.Tensor,
    problems: list[str],
) -> None:
    """Per-layer weights vs eager's on the real query rows; the worst difference in ``row``."""
    if len(got) != len(eager):
        problems.append(f"{what}: {len(got)} layers, eager has {len(eager)}")
        return
    worst = 0.0
    for w, e in zip(got, eager, strict=True):
        if w.shape != e.shape:
            problems.append(f"{what}: {tuple(w.shape)} vs eager {tuple(e.shape)}")
            return
        rows = real if e.shape[2] == real.shape[1] else torch.ones(e.shape[0], e.shape[2])
        rows = rows.bool()
        worst = max(worst, float((w.transpose(1, 2)[rows] - e.transpose(1, 2)[rows]).abs().max()))
    row[f"max_diff_weights_{what}"] = worst
    if not worst <= TOL:
        problems.append(f"{what}: weights differ by {worst:.2e}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model types")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--results-dir", type=Path, default=None)
    parser.add_argument("--timeout", type=int, default=60, help="seconds per family")
    parser.add_argument(
        "--docs", action="store_true", help="only rewrite docs/huggingface.md's table from the JSON"
    )
    args = parser.parse_args(argv)
    if args.docs:
        results = (args.results_dir or Path(__file__).parent / "results") / "hf_coverage.json"
        write_docs(json.loads(results.read_text(encoding="utf-8")))
        print(f"rewrote {DOCS}'s table from {results}")
        return 0

    import transformers

    import multihead.hf  # noqa: F401 - registers "multihead"

    transformers.logging.set_verbosity_error()
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    names = args.only.split(",") if args.only else QUICK if args.quick else families()
    rows = []
    start = time.perf_counter()
    for name in names:
        sink = io.StringIO()
        try:
            with time_limit(args.timeout), contextlib.redirect_stderr(sink):
                row = check(name)
        except Timeout as error:
            row = {"family": name, "status": "skipped", "reason": f"Timeout: {error}"}
        except Exception as error:  # noqa: BLE001 - this script's own comparison broke
            reason = f"coverage script: {type(error).__name__}: {error}"[:200]
            row = {"family": name, "status": "failed", "reason": reason}
        rows.append(row)
        print(f"{name:28s} {row['status']:9s} {row.get('reason', '')}", flush=True)
    counts = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    table = format_table(
        ["family", "status", "output diff", "captured weights diff", "reason"],
        [
            [
                r["family"],
                r["status"],
                f"{r['max_diff_output']:.1e}" if "max_diff_output" in r else "",
                f"{r['max_diff_weights_capture']:.1e}" if "max_diff_weights_capture" in r else "",
                r.get("reason", ""),
            ]
            for r in rows
            if r["status"] != "skipped"
        ],
    )
    print(table)
    print(", ".join(f"{k}: {v}" for k, v in counts.items()))
    payload = {
        "machine": machine_info(),
        "transformers": transformers.__version__,
        "tolerance": TOL,
        "output_rtol": RTOL,
        "seconds": time.perf_counter() - start,
        "counts": counts,
        "rows": rows,
    }
    path = write_json(
        "hf_coverage_quick" if args.quick else "hf_coverage", payload, directory=args.results_dir
    )
    print(f"wrote {path}")
    if not args.quick and not args.only and args.results_dir is None:
        write_docs(payload)
        print(f"rewrote {DOCS}'s table")
    return 0


def _families(rows: list[dict[str, Any]], detail: bool = False) -> str:
    """The families of ``rows``, comma-separated (each with its detail in parentheses)."""
    return ", ".join(f"{r['family']} ({r['detail']})" if detail else r["family"] for r in rows)


def _unrouted_class(reason: str) -> str:
    """The attention class a refusal names in its parentheses after the interface, or ""."""
    match = re.search(r"AttentionInterface \((\w+)\)|: (\w+) makes", reason)
    return next((g for g in match.groups() if g), "") if match else ""


def render_table(payload: dict[str, Any]) -> str:
    """docs/huggingface.md's coverage table (markdown) from a full run's JSON ``payload``."""
    rows = payload["rows"]

    def of(status: str) -> list[dict[str, Any]]:
        return [r for r in rows if r["status"] == status]

    supported = of("supported")
    feature = {
        k: [r for r in supported if k in r.get("features", ())]
        for k in ("softcap", "sinks", "hybrid", "recipe")
    }
    forward = [{**r, "detail": _unrouted_class(r["reason"])} for r in of("forward only")]
    several = [r for r in forward if "attention calls per layer" in r["reason"]]
    outside = [r for r in forward if r not in several]
    refused = of("refused")
    unrouted = [r for r in refused if "does not route" in r["reason"]]
    other = [{**r, "detail": r["reason"]} for r in refused if r not in unrouted]
    hybrids = [{**r, "detail": r["reason"]} for r in feature["hybrid"]]
    lines = [
        "| status | families |",
        "| --- | --- |",
        f"| **supported: {len(supported)}** (output, output_attentions and capture all match) "
        f"| {_families(supported)} |",
        f"| of which with attention-logit softcapping ({len(feature['softcap'])}) "
        f"| {_families(feature['softcap'])} |",
        f"| of which with attention sinks ({len(feature['sinks'])}), weights in each family's "
        f"convention | {_families(feature['sinks'])} |",
        f"| of which hybrids observed on their softmax attention ({len(hybrids)}) "
        f"| {_families(hybrids, detail=True)} |",
        f"| of which computed in the module's own code, not the interface: heads at the output "
        f"projection, weights by the family's score recipe ({len(feature['recipe'])}) "
        f"| {_families(feature['recipe'])} |",
        f"| forward only: hybrid, some softmax attention in the module's own code, not the "
        f"interface ({len(outside)}) | {_families(outside, detail=True)} |",
        f"| forward only: several attention calls per layer ({len(several)}) "
        f"| {_families(several, detail=True)} |",
        f"| refused: not routed through the interface ({len(unrouted)}) | {_families(unrouted)} |",
    ]
    if other:
        lines.append(f"| refused: other ({len(other)}) | {_families(other, detail=True)} |")
    lines += [
        f"| no softmax attention ({len(of('no softmax attention'))}): other token mixers "
        f"(state-space, Fourier, convolutional), no heads "
        f"| {_families(of('no softmax attention'))} |",
        f"| **mismatch (silent difference): {len(of('mismatch'))}** "
        f"| {_families(of('mismatch'))} |",
        f"| **failed: {len(of('failed'))}** | {_families(of('failed'))} |",
    ]
    machine = payload["machine"]
    cpu = machine.get("cpu") or ""
    head = (
        f"Measured with transformers {payload['transformers']}, torch "
        f"{machine.get('torch', '')} ({cpu}), {payload['seconds'] / 60:.0f} min for the "
        f"{len(rows)} model types:"
    )
    tail = (
        f"{len(of('skipped'))} more model types were skipped: not buildable or runnable with a "
        f"small text-only config even on sdpa/eager (forwards that need pixel or audio inputs, "
        f"configs that reject the small sizes, ...). The JSON (`benchmarks/results/"
        f"hf_coverage.json`) has every row with its reason and maximal differences."
    )
    return "\n".join([head, "", *lines, "", tail])


def write_docs(payload: dict[str, Any]) -> None:
    """Replace the table between docs/huggingface.md's markers with :func:`render_table`'s."""
    text = DOCS.read_text(encoding="utf-8")
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    DOCS.write_text(f"{text[:start]}\n{render_table(payload)}\n{text[stop:]}", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
