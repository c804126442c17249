"""Score modifications on the CPU: a softcapped forward against sdpa without one, and capture.

1. **Softcap forward** (issue 31): ``functional.attention(q, k, v, softcap=50, is_causal=True)``
   on Gemma-2-2b's attention shape (B = 1, 8 query heads on 4 key/value heads, D = 256,
   T = 1024, float32, softcap 50, scale 256^-1/2) ÷ ``F.scaled_dot_product_attention`` of the
   same call without the softcap (``is_causal=True``, ``enable_gqa=True``). Target ≤ 1.2×.
   Beside it, torch's FlexAttention with the softcap as a ``score_mod`` and a causal
   ``BlockMask``: compiled (``torch.compile``; its compile time said apart) and, with
   ``--flex-reference``, uncompiled (its unfused reference). multihead runs the explicit formula
   a block of query rows at a time (scores, cap, mask, softmax, values; the keys past a causal
   block's last row skipped).
2. **Capture** (issue 31): ``capture(rows=[-1])`` (one row, every head) on a Gemma-2-shaped
   stack of softcapped attention layers (width 2304, 8 heads on 4 of D = 256, T = 4096) ÷ its
   plain forward. Attention layers only, no feed-forward: the forward is smallest, so the
   capture's share is largest. Target ≤ 1.15×.

Each ratio is the median over ``--rounds`` interleaved rounds of per-round ratios of medians
(``Timer.blocked_autorange``), measured twice: wall clock on ``--threads`` threads, and the
process's CPU time on one thread (``time.process_time``), which a busy machine disturbs much
less. ``--quick`` runs small shapes (T = 128, D = 64; capture at T = 256) in seconds, without
compiling, for the smoke test.

Run:  python benchmarks/bench_score_mods.py [--rounds 5] [--threads N] [--flex-reference]
      [--no-compile] [--quick] [--results-dir DIR]
Writes benchmarks/results/score_mods.json (score_mods_quick.json with --quick).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import format_table, machine_info, median_time, write_json
from torch import Tensor, nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import multihead
from multihead.functional import attention

TARGETS = {"softcap forward ÷ sdpa": 1.2, "capture(rows=[-1]) ÷ forward": 1.15}

FULL = {"B": 1, "H": 8, "Hk": 4, "D": 256, "T": 1024, "softcap": 50.0}
QUICK = {"B": 1, "H": 4, "Hk": 2, "D": 64, "T": 128, "softcap": 50.0}
CAPTURE = {"layers": 2, "width": 2304, "H": 8, "Hk": 4, "D": 256, "T": 4096}
CAPTURE_QUICK = {"layers": 2, "width": 64, "H": 4, "Hk": 2, "D": 16, "T": 256}


class SoftcapBlock(nn.Module):
    """A pre-norm residual attention block whose attention is softcapped (Gemma-2's 50)."""

    def __init__(self, width: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = multihead.MultiHeadAttention(
            width, heads, num_kv_heads=kv_heads, head_dim=head_dim, bias=False
        )

    def forward(self, x: Tensor) -> Tensor:
        return x + self.attn(self.norm(x), is_causal=True, softcap=50.0)


def ratio_rounds(
    contenders: dict[str, Callable[[], object]],
    base: str,
    rounds: int,
    *,
    min_run_time: float,
    cpu_time: bool,
) -> tuple[dict[str, float], dict[str, float]]:
    """Per contender: the median over interleaved rounds of its median ÷ ``base``'s, and its
    median seconds."""
    timer = time.process_time if cpu_time else None
    ratios: dict[str, list[float]] = {name: [] for name in contenders if name != base}
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        per = {
            name: median_time(fn, min_run_time=min_run_time, timer=timer)
            for name, fn in contenders.items()
        }
        for name, value in per.items():
            seconds[name].append(value)
            if name != base:
                ratios[name].append(value / per[base])
    return (
        {name: statistics.median(r) for name, r in ratios.items()},
        {name: statistics.median(s) for name, s in seconds.items()},
    )


def softcap_contenders(
    shape: dict[str, Any], compile_flex: bool, reference: bool
) -> tuple[dict[str, Callable[[], object]], dict[str, float]]:
    """The softcap forward's contenders (no grad), and facts found on the way (compile time,
    largest differences)."""
    torch.manual_seed(0)
    b, h, hk, d, t, cap = (shape[k] for k in ("B", "H", "Hk", "D", "T", "softcap"))
    q = torch.randn(b, h, t, d)
    k = torch.randn(b, hk, t, d)
    v = torch.randn(b, hk, t, d)
    scale = 1 / math.sqrt(d)

    def softcap(score: Tensor, bi: Tensor, hi: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        return cap * torch.tanh(score / cap)

    causal = create_block_mask(lambda bi, hi, qi, ki: qi >= ki, None, None, t, t, device="cpu")
    flex_kwargs: dict[str, Any] = {
        "score_mod": softcap,
        "block_mask": causal,
        "scale": scale,
        "enable_gqa": True,
    }
    contenders: dict[str, Callable[[], object]] = {
        "sdpa, no softcap": lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=True
        ),
        "multihead, softcap": lambda: attention(q, k, v, is_causal=True, scale=scale, softcap=cap),
    }
    facts: dict[str, float] = {}
    ours = attention(q, k, v, is_causal=True, scale=scale, softcap=cap)
    if compile_flex:
        compiled = torch.compile(flex_attention)
        start = time.perf_counter()
        out = compiled(q, k, v, **flex_kwargs)
        facts["flex compile seconds"] = time.perf_counter() - start
        facts["max |multihead - compiled flex|"] = float((out - ours).abs().max())
        contenders["flex compiled, softcap"] = lambda: compiled(q, k, v, **flex_kwargs)
    if reference:
        out = flex_attention(q, k, v, **flex_kwargs)
        facts["max |multihead - flex|"] = float((out - ours).abs().max())
        contenders["flex uncompiled, softcap"] = lambda: flex_attention(q, k, v, **flex_kwargs)
    return contenders, facts


def capture_contenders(shape: dict[str, int]) -> dict[str, Callable[[], object]]:
    torch.manual_seed(0)
    model = nn.Sequential(
        *(
            SoftcapBlock(shape["width"], shape["H"], shape["Hk"], shape["D"])
            for _ in range(shape["layers"])
        )
    ).eval()
    x = torch.randn(1, shape["T"], shape["width"])

    def captured() -> None:
        with multihead.capture(model, rows=[-1]) as rec:
            model(x)
        assert rec.records

    return {"forward": lambda: model(x), "capture(rows=[-1])": captured}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for wall time")
    parser.add_argument(
        "--flex-reference", action="store_true", help="also time uncompiled FlexAttention"
    )
    parser.add_argument("--no-compile", action="store_true", help="skip compiled FlexAttention")
    parser.add_argument("--quick", action="store_true", help="small shapes, seconds, no compile")
    parser.add_argument("--results-dir", default=None, help="where to write the JSON")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    load_before = list(os.getloadavg())
    shape = QUICK if args.quick else FULL
    small = CAPTURE_QUICK if args.quick else CAPTURE
    rounds = 1 if args.quick else args.rounds
    min_run = 0.05 if args.quick else 1.0
    contenders, facts = softcap_contenders(
        shape, compile_flex=not (args.quick or args.no_compile), reference=args.flex_reference
    )
    capture_fns = capture_contenders(small)
    results: dict[str, Any] = {}
    with torch.no_grad():
        for clock, cpu_time in (("wall", False), ("cpu", True)):
            if cpu_time:
                torch.set_num_threads(1)
            soft, soft_s = ratio_rounds(
                contenders, "sdpa, no softcap", rounds, min_run_time=min_run, cpu_time=cpu_time
            )
            cap, cap_s = ratio_rounds(
                capture_fns, "forward", rounds, min_run_time=min_run, cpu_time=cpu_time
            )
            results[clock] = {"softcap": soft, "softcap_seconds": soft_s}
            results[clock] |= {"capture": cap, "capture_seconds": cap_s}
            torch.set_num_threads(threads)
    headers = ["measure", f"wall, {threads} threads", "CPU time, 1 thread", "target"]
    rows = [
        ["sdpa, no softcap (ms)"]
        + [
            f"{results[c]['softcap_seconds']['sdpa, no softcap'] * 1e3:.1f}"
            for c in ("wall", "cpu")
        ]
        + [""]
    ]
    for name in results["wall"]["softcap"]:
        target = TARGETS["softcap forward ÷ sdpa"] if name == "multihead, softcap" else None
        rows.append(
            [f"{name} ÷ sdpa"]
            + [f"{results[c]['softcap'][name]:.2f}x" for c in ("wall", "cpu")]
            + [f"≤ {target}x" if target else ""]
        )
    rows.append(
        ["forward at capture's shape (ms)"]
        + [f"{results[c]['capture_seconds']['forward'] * 1e3:.1f}" for c in ("wall", "cpu")]
        + [""]
    )
    rows.append(
        ["capture(rows=[-1]) ÷ forward"]
        + [f"{results[c]['capture']['capture(rows=[-1])']:.3f}x" for c in ("wall", "cpu")]
        + [f"≤ {TARGETS['capture(rows=[-1]) ÷ forward']}x"]
    )
    print(format_table(headers, rows))
    for name, value in facts.items():
        print(f"{name}: {value:.3g}")
    info = machine_info()
    caption = (
        f"Softcap: {', '.join(f'{k}={v}' for k, v in shape.items())}, float32, causal. Capture: "
        f"{', '.join(f'{k}={v}' for k, v in small.items())}, softcap 50. {rounds} rounds "
        "(median of per-round ratios)."
    )
    name = "score_mods" + ("_quick" if args.quick else "")
    path = write_json(
        name,
        {
            "machine": info,
            "shape": shape,
            "capture_shape": small,
            "threads": threads,
            "rounds": rounds,
            "results": results,
            "facts": facts,
            "targets": TARGETS,
        },
        directory=None if args.results_dir is None else Path(args.results_dir),
        report={
            "title": "Score modifications (issue 31): `benchmarks/bench_score_mods.py`",
            "tables": [
                {"caption": caption, "header": headers, "rows": rows, "target_column": "target"}
            ],
            "load_before": load_before,
            "load_after": list(os.getloadavg()),
            "notes": [f"{name}: {value:.3g}." for name, value in facts.items()],
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
