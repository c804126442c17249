"""multihead.cache_corpus: a corpus' activations streamed to safetensors shards, each equal to
multihead.cache of its batch and, at real positions, of each text alone; an SAE's features
beside them equal SAELens's encoding formulas, written here, of each text alone's activation."""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("safetensors.torch")
pytest.importorskip("tokenizers")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from tiny_bert import write_dir  # noqa: E402

import multihead  # noqa: E402
from multihead.pretrained import load_text_model  # noqa: E402
from multihead.sae import SAE, SAEConfig  # noqa: E402
from multihead.text.corpus_cache import MANIFEST, cache_corpus  # noqa: E402

TEXTS = ["the cat sat on the mat .", "a dog sat .", "cat", "the mat the mat .", "dog . dog ."]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    return Path(write_dir(tmp_path_factory.mktemp("tiny") / "m", tokenizer=True))


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Any:
    return load_text_model(model_dir)


def test_shards_hold_each_batch_and_each_text_alone(model: Any, tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []
    paths = cache_corpus(
        model, TEXTS, tmp_path / "acts", names=["resid_post", ("z", 1), ("result", 0)],
        batch_size=2,
        progress=lambda done, total: seen.append((done, total)),
    )  # fmt: skip
    assert [p.name for p in paths] == [
        "texts-0000000-0000002.safetensors",
        "texts-0000002-0000004.safetensors",
        "texts-0000004-0000005.safetensors",
    ]
    assert seen == [(2, 5), (4, 5), (5, 5)]
    manifest = json.loads((tmp_path / "acts" / MANIFEST).read_text())
    assert manifest["texts"] == 5 and manifest["shards"] == [p.name for p in paths]
    layers = model.num_layers
    names = sorted([f"blocks.{i}.hook_resid_post" for i in range(layers)])
    assert manifest["names"] == sorted(
        [*names, "blocks.1.attn.hook_z", "blocks.0.attn.hook_result"]
    )
    for path in paths:
        shard = load_file(path)
        for row, index in enumerate(shard["text_index"].tolist()):
            ids = model.tokenize(TEXTS[index]).input_ids
            alone = multihead.cache(model, ids, names=["resid_post", ("z", 1), ("result", 0)])
            n = ids.shape[1]
            assert int(shard["attention_mask"][row].sum()) == n
            for i in range(layers):
                torch.testing.assert_close(
                    shard[f"blocks.{i}.hook_resid_post"][row, :n], alone["resid_post", i][0].cpu(),
                    rtol=1e-5, atol=1e-5,
                )  # fmt: skip
            for name, key in (
                ("blocks.1.attn.hook_z", ("z", 1)),
                ("blocks.0.attn.hook_result", ("result", 0)),
            ):
                torch.testing.assert_close(
                    shard[name][row, :n], alone[key][0].cpu(), rtol=1e-5, atol=1e-5
                )
    assert multihead.cache_corpus is cache_corpus


def _sae(
    d_in: int,
    hook: str,
    architecture: str = "standard",
    head: int | None = None,
    seed: int = 0,
    normalize: str = "none",
) -> SAE:
    """A random SAE (every bias nonzero; a jumprelu's thresholds positive) through the class."""
    config = SAEConfig(
        architecture=architecture, d_in=d_in, d_sae=12, d_out=d_in, dtype=torch.float32,
        apply_b_dec_to_input=True, hook_name=hook, hook_head_index=head,
        normalize_activations=normalize,
    ).check("test")  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    tensors = {n: torch.randn(s, generator=gen) for n, s in config.tensor_shapes().items()}
    if "threshold" in tensors:
        tensors["threshold"] = tensors["threshold"].abs()
    return SAE(config, tensors)


def _encoded(sae: SAE, x: torch.Tensor) -> torch.Tensor:
    """SAELens's encode (sae_lens/saes/standard_sae.py, jumprelu_sae.py; constant_norm_rescale
    in sae.py): (..., E) -> (..., F)."""
    if sae.normalize_activations == "constant_norm_rescale":
        x = x * x.shape[-1] ** 0.5 / x.norm(dim=-1, keepdim=True)
    pre = (x - sae.b_dec) @ sae.W_enc + sae.b_enc
    acts = torch.relu(pre)
    return acts * (pre > sae.threshold) if sae.architecture == "jumprelu" else acts


def test_sae_features_of_each_text_alone_zero_at_padding(model: Any, tmp_path: Path) -> None:
    heads, width = 4, 16  # tiny_bert.CONFIG
    z_sae = _sae(width, "blocks.1.attn.hook_z")  # every head, head-major
    one_head = _sae(width // heads, "blocks.0.attn.hook_z", "jumprelu", head=2, seed=1)
    # a normalising SAE: the packed model's zeros at padding would encode to NaN
    resid = _sae(
        width, "blocks.0.hook_resid_post", "jumprelu", seed=2, normalize="constant_norm_rescale"
    )
    paths = cache_corpus(model, TEXTS, tmp_path / "f", saes=[z_sae, one_head, resid], batch_size=2)
    manifest = json.loads((tmp_path / "f" / MANIFEST).read_text())
    names = {
        "blocks.1.attn.hook_z.hook_sae_acts_post": z_sae,
        "blocks.0.attn.hook_z.2.hook_sae_acts_post": one_head,
        "blocks.0.hook_resid_post.hook_sae_acts_post": resid,
    }
    assert manifest["names"] == sorted(names)  # with saes and no names: features alone
    assert manifest["saes"]["blocks.0.attn.hook_z.2.hook_sae_acts_post"] == {
        "hook_name": "blocks.0.attn.hook_z", "architecture": "jumprelu", "d_in": width // heads,
        "d_sae": 12,
    }  # fmt: skip
    seen = 0
    for path in paths:
        shard = load_file(path)
        assert set(shard) == {*names, "attention_mask", "text_index"}
        for row, index in enumerate(shard["text_index"].tolist()):
            ids = model.tokenize(TEXTS[index]).input_ids
            alone = multihead.cache(model, ids, names=[("z", 1), ("z", 0), ("resid_post", 0)])
            n = ids.shape[1]
            inputs = {
                "blocks.1.attn.hook_z.hook_sae_acts_post": alone["z", 1][0].flatten(1),
                "blocks.0.attn.hook_z.2.hook_sae_acts_post": alone["z", 0][0, :, 2],
                "blocks.0.hook_resid_post.hook_sae_acts_post": alone["resid_post", 0][0],
            }
            for name, sae in names.items():
                got = shard[name][row]
                want = _encoded(sae, inputs[name])
                assert bool((want > 0).any()), name  # the reference is not all zeros
                torch.testing.assert_close(got[:n], want, rtol=1e-5, atol=1e-5, msg=name)
                assert not got[n:].any(), name  # padding: zero
                seen += int(got.shape[0] > n)
    assert seen  # some rows were padded
    # beside the activations named, in the dtype asked for; the SAE's own site unstored
    both = cache_corpus(
        model, TEXTS[:2], tmp_path / "both", names=[("resid_pre", 0)], saes=z_sae,
        dtype=torch.float16,
    )  # fmt: skip
    shard = load_file(both[0])
    assert set(shard) == {
        "blocks.0.hook_resid_pre", "blocks.1.attn.hook_z.hook_sae_acts_post",
        "attention_mask", "text_index",
    }  # fmt: skip
    assert shard["blocks.1.attn.hook_z.hook_sae_acts_post"].dtype == torch.float16


def test_sae_refusals_write_nothing(model: Any, tmp_path: Path) -> None:
    width = 16  # tiny_bert.CONFIG
    z = _sae(width, "blocks.1.attn.hook_z")
    for saes, error, match in [
        ("an sae", TypeError, "saes must be a multihead.sae.SAE, a sequence of them or None"),
        ([z, "x"], TypeError, r"saes\[1\]: sae must be a multihead.sae.SAE"),
        ([z, _sae(width, "blocks.1.attn.hook_z", seed=3)], ValueError,
         r"saes\[1\] reads the site saes\[0\] reads \(blocks.1.attn.hook_z\)"),
        ([_sae(width + 1, "blocks.0.hook_resid_pre")], ValueError,
         r"saes\[0\]: the SAE reads 17 values per position \(d_in\), and .* has 16"),
        ([_sae(width, "blocks.7.hook_resid_pre")], ValueError,
         r"saes\[0\]: the SAE reads 'blocks.7.hook_resid_pre', layer 7, and the model has 2"),
        # a post-LN block (BERT) has no attn_out: the cache's reason
        ([z, _sae(width, "blocks.0.hook_attn_out")], ValueError,
         r"saes\[1\]: attn_out of layer 0: .* is not the sum"),
    ]:  # fmt: skip
        for names in (None, lambda site, layer: site == "resid_pre"):  # a predicate too
            with pytest.raises(error, match=match):
                cache_corpus(model, TEXTS, tmp_path / "x", saes=saes, names=names)  # type: ignore[arg-type]
            assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match=r"names: \(\) names no activation and no saes are given"):
        cache_corpus(model, TEXTS, tmp_path / "x", names=())
    assert not (tmp_path / "x").exists()


def test_dtype_and_refusals_write_nothing(model: Any, tmp_path: Path) -> None:
    half = cache_corpus(model, TEXTS[:2], tmp_path / "half", dtype=torch.float16)
    assert load_file(half[0])["blocks.0.hook_resid_post"].dtype == torch.float16
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("keep me")
    with pytest.raises(ValueError, match="out_dir must be a new or empty directory, got a dir"):
        cache_corpus(model, TEXTS, taken)
    assert sorted(p.name for p in taken.iterdir()) == ["mine.txt"]
    with pytest.raises(ValueError, match="names items must be one of"):
        cache_corpus(model, TEXTS, tmp_path / "bad", names=["nothing"])
    with pytest.raises(ValueError, match=r"texts\[1\] .*empty|texts"):
        cache_corpus(model, ["a cat", ""], tmp_path / "empty")
    with pytest.raises(TypeError, match="model must be a multihead.TextModel"):
        cache_corpus(torch.nn.Linear(2, 2), TEXTS, tmp_path / "x")  # type: ignore[arg-type]
    assert not any((tmp_path / d).exists() for d in ("bad", "empty", "x"))


def _same_files(got: Path, want: Path) -> None:
    """Two cache_corpus outputs hold the same files: the manifest and every shard's tensors."""
    assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in want.iterdir())
    assert json.loads((got / MANIFEST).read_text()) == json.loads((want / MANIFEST).read_text())
    for name in json.loads((want / MANIFEST).read_text())["shards"]:
        a, b = load_file(got / name), load_file(want / name)
        assert a.keys() == b.keys()
        for key in b:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


def test_row8_a_failed_run_leaves_nothing_a_rerun_refuses(model: Any, tmp_path: Path) -> None:
    """Issue 51 row 8 in one process (was: the shards written before the failure stayed, with
    no manifest, and a rerun refused them): the run's own files are removed, the directory it
    made too; an empty directory given stays, empty; the rerun writes a clean run's files."""
    want = tmp_path / "want"
    cache_corpus(model, TEXTS, want, batch_size=2)

    def stop(done: int, total: int) -> None:
        if done == 4:  # two shards on disk
            raise KeyError("stopped part-way")

    made = tmp_path / "new" / "acts"  # its parent made by the run too
    given = tmp_path / "given"
    given.mkdir()
    for out in (made, given):
        with pytest.raises(KeyError, match="stopped part-way"):
            cache_corpus(model, TEXTS, out, batch_size=2, progress=stop)
    assert not (tmp_path / "new").exists()
    assert list(given.iterdir()) == []
    for out in (made, given):
        cache_corpus(model, TEXTS, out, batch_size=2)
        _same_files(out, want)


def test_row8_a_killed_runs_leftovers_are_replaced_never_a_users_files(
    model: Any, model_dir: Path, tmp_path: Path
) -> None:
    """A run killed part-way (SIGKILL: no cleanup) leaves its shards and its marker, no
    manifest: the rerun replaces them (one warning); refused while another run holds the
    marker's lock, or when the directory also holds a file the run did not write."""
    want = tmp_path / "want"
    cache_corpus(model, TEXTS, want, batch_size=2)
    out = tmp_path / "acts"
    script = textwrap.dedent(f"""
        import os, signal
        from multihead import cache_corpus
        from multihead.pretrained import load_text_model

        def kill(done, total):
            if done == 2:
                os.kill(os.getpid(), signal.SIGKILL)

        model = load_text_model({str(model_dir)!r})
        cache_corpus(model, {TEXTS!r}, {str(out)!r}, batch_size=2, progress=kill)
    """)
    done = subprocess.run([sys.executable, "-c", script], timeout=300, check=False)
    assert done.returncode == -9
    left = sorted(p.name for p in out.iterdir())
    assert left == ["texts-0000000-0000002.safetensors", "unfinished.json"]
    # another run writing it: its marker locked
    with open(out / "unfinished.json", "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(ValueError, match="another cache_corpus run is writing it"):
            cache_corpus(model, TEXTS, out, batch_size=2)
    # a file the run did not write: refused, nothing removed
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"got a directory that holds files: notes\.txt"):
        cache_corpus(model, TEXTS, out, batch_size=2)
    assert sorted(p.name for p in out.iterdir()) == sorted([*left, "notes.txt"])
    (out / "notes.txt").unlink()
    with pytest.warns(UserWarning, match=r"an unfinished cache_corpus run's 2 files .* replaced"):
        cache_corpus(model, TEXTS, out, batch_size=2)
    _same_files(out, want)
    # a finished run is never replaced
    with pytest.raises(ValueError, match="got a finished cache_corpus run's directory"):
        cache_corpus(model, TEXTS, out, batch_size=2)
