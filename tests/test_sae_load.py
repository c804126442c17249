"""multihead.sae.load: SAELens directories and Gemma Scope files, against SAELens's own numbers.

tests/data/sae/<name>/ are SAEs SAELens itself wrote (``save_model``; sae-lens 6.54.12, and
5.11.0 for the ``v5_`` configs from before 6.0: tests/data/sae/make_fixtures.py says how), each
with ``expected.safetensors``: inputs and what SAELens's ``encode``, ``decode`` and forward
computed from them. Gemma Scope's files are written here by their documented layout, their
expected outputs by SAELens's JumpReLU formula written out (sae_lens/saes/jumprelu_sae.py
``JumpReLUSAE.encode``; sae_lens/saes/transcoder.py ``SkipTranscoder.forward``).
"""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("safetensors.torch")
from safetensors.torch import load_file, save_file  # noqa: E402

import multihead.sae  # noqa: E402
from multihead.sae import SAE, load  # noqa: E402

DATA = Path(__file__).parent / "data" / "sae"
WRITTEN = sorted(p.name for p in DATA.iterdir() if (p / "cfg.json").is_file())
TOL = 1e-6


def test_every_architecture_was_written_by_sae_lens() -> None:
    archs = {json.loads((DATA / n / "cfg.json").read_text()).get("architecture") for n in WRITTEN}
    assert set(multihead.sae.sae_config.ARCHITECTURES) <= archs
    assert sum(n.startswith("v5_") for n in WRITTEN) == 6


@pytest.mark.parametrize("name", WRITTEN)
def test_encode_decode_equal_sae_lens(name: str) -> None:
    sae = load(DATA / name)
    expected = load_file(DATA / name / "expected.safetensors")
    x = expected["x"]
    features = sae.encode(x)
    assert features.shape == expected["features"].shape
    torch.testing.assert_close(features, expected["features"], atol=TOL, rtol=0)
    decoded = sae.decode(expected["features"], input=x)
    assert decoded.shape == expected["decoded"].shape
    torch.testing.assert_close(decoded, expected["decoded"], atol=TOL, rtol=0)
    torch.testing.assert_close(sae(x), expected["output"], atol=TOL, rtol=0)
    # the fixtures are not degenerate: some features fire, some do not
    assert 0 < int((features != 0).sum()) < features.numel()


@pytest.mark.parametrize(
    ("name", "architecture", "site", "site_out"),
    [
        ("standard", "standard", ("resid_pre", 2), None),
        ("standard_hook_z", "standard", ("z", 1), None),
        ("topk_rescaled", "topk", ("resid_mid", 0), None),
        ("gated", "gated", ("resid_pre", 1), None),
        ("skip_transcoder", "skip_transcoder", ("resid_mid", 2), ("mlp_out", 2)),
        ("v5_topk", "topk", ("resid_post", 1), None),
        ("v5_hook_z", "standard", ("z", 1), None),
    ],
)
def test_the_site_it_reads(
    name: str, architecture: str, site: tuple[str, int], site_out: tuple[str, int] | None
) -> None:
    sae = load(DATA / name)
    assert (sae.architecture, sae.site, sae.site_out) == (architecture, site, site_out)
    assert sae.require_site() == site


def test_a_hook_multihead_has_no_site_for_keeps_its_name(tmp_path: Path) -> None:
    sae = load(DATA / "transcoder")  # TransformerLens's hook_mlp_in: its copy of resid_mid
    assert (sae.hook_name, sae.site) == ("blocks.1.hook_mlp_in", ("resid_mid", 1))
    assert sae.site_out == ("mlp_out", 1)
    folder = _copy("transcoder", tmp_path)
    cfg = json.loads((folder / "cfg.json").read_text())
    cfg["metadata"]["hook_name"] = "blocks.1.ln2.hook_normalized"
    (folder / "cfg.json").write_text(json.dumps(cfg))
    other = load(folder)
    assert (other.hook_name, other.site) == ("blocks.1.ln2.hook_normalized", None)
    with pytest.raises(
        ValueError, match=r"'blocks\.1\.ln2\.hook_normalized', a hook multihead has"
    ):
        other.require_site()


def test_the_config_is_honoured() -> None:
    sae = load(DATA / "v5_topk")  # pre-6.0: activation_fn "topk" -> architecture topk
    assert (sae.k, sae.apply_b_dec_to_input, sae.reshape_activations) == (4, True, "none")
    z = load(DATA / "v5_hook_z")  # pre-6.0: hook_z in the name -> reshaped
    assert z.reshape_activations == "hook_z"
    assert load(DATA / "standard_layer_norm").normalize_activations == "layer_norm"
    assert load(DATA / "jumprelu").apply_b_dec_to_input is False
    tc = load(DATA / "jumprelu_skip_transcoder")
    assert (tc.d_in, tc.d_sae, tc.d_out, tc.W_skip.shape) == (12, 24, 10, (10, 12))
    with pytest.raises(AttributeError, match="d_sae is the config's"):
        tc.d_sae = 3  # type: ignore[misc]


def test_either_file_of_the_directory_and_a_dtype() -> None:
    expected = load_file(DATA / "gated" / "expected.safetensors")
    for path in (DATA / "gated" / "cfg.json", DATA / "gated" / "sae_weights.safetensors"):
        torch.testing.assert_close(load(path).encode(expected["x"]), expected["features"])
    wide = load(DATA / "gated", dtype=torch.float64)
    assert (wide.dtype, wide.device.type) == (torch.float64, "cpu")
    features = wide.encode(expected["x"])
    assert features.dtype == torch.float64
    torch.testing.assert_close(features.float(), expected["features"], atol=TOL, rtol=0)
    assert load(DATA / "gated").to(torch.float16).dtype == torch.float16


def test_importing_it_imports_neither_sae_lens_nor_transformer_lens() -> None:
    code = (
        "import sys, multihead.sae; multihead.sae.load(sys.argv[1]); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('sae_lens', 'transformer_lens', 'transformers')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(DATA / "standard")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "[]"


# -- Gemma Scope, written by the documented layout ----------------------------------------------


def _jumprelu(p: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SAELens's JumpReLU (apply_b_dec_to_input false, as for Gemma Scope): features, decoded."""
    h = x @ p["W_enc"] + p["b_enc"]
    f = torch.relu(h) * (h > p["threshold"]).float()
    return f, f @ p["W_dec"] + p["b_dec"]


def _params(d_in: int, d_sae: int, d_out: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = {
        "W_enc": torch.randn(d_in, d_sae, generator=g) * 0.3,
        "W_dec": torch.randn(d_sae, d_out, generator=g) * 0.3,
        "b_enc": torch.randn(d_sae, generator=g) * 0.3,
        "b_dec": torch.randn(d_out, generator=g) * 0.3,
        "threshold": torch.rand(d_sae, generator=g) * 0.2,
    }
    return p


def test_gemma_scope_2_sizes_from_the_header(tmp_path: Path) -> None:
    p = _params(10, 20, 10, seed=1)
    file = tmp_path / "resid_post" / "layer_3_width_16k_l0_small" / "params.safetensors"
    file.parent.mkdir(parents=True)
    save_file({k.lower(): v for k, v in p.items()}, file)
    sae = load(file)
    assert (sae.architecture, sae.d_in, sae.d_sae, sae.apply_b_dec_to_input) == (
        "jumprelu", 10, 20, False
    )  # fmt: skip
    assert (sae.hook_name, sae.site) == ("blocks.3.hook_resid_post", ("resid_post", 3))
    x = torch.randn(4, 10)
    features, decoded = _jumprelu(p, x)
    torch.testing.assert_close(sae.encode(x), features, atol=TOL, rtol=0)
    torch.testing.assert_close(sae.decode(features), decoded, atol=TOL, rtol=0)
    assert load(file.parent).d_sae == 20  # its folder too


def test_gemma_scope_2_skip_transcoder(tmp_path: Path) -> None:
    p = _params(10, 20, 6, seed=2)
    affine = torch.randn(10, 6) * 0.3  # stored (d_in, d_out)
    file = tmp_path / "transcoder" / "layer_2_width_16k_affine" / "params.safetensors"
    file.parent.mkdir(parents=True)
    save_file({**{k.lower(): v for k, v in p.items()}, "affine_skip_connection": affine}, file)
    sae = load(file)
    assert (sae.architecture, sae.d_out) == ("jumprelu_skip_transcoder", 6)
    # hook_mlp_in: TransformerLens's copy of resid_mid
    assert (sae.site, sae.site_out) == (("resid_mid", 2), ("mlp_out", 2))
    x = torch.randn(3, 10)
    _, decoded = _jumprelu(p, x)
    torch.testing.assert_close(sae(x), decoded + x @ affine, atol=TOL, rtol=0)


def test_gemma_scope_1_npz(tmp_path: Path) -> None:
    p = _params(8, 16, 8, seed=3)
    file = tmp_path / "gemma-scope-2b-pt-res" / "layer_5" / "width_16k" / "average_l0_9"
    file.mkdir(parents=True)
    np.savez(file / "params.npz", **{k: v.numpy() for k, v in p.items()})
    sae = load(file / "params.npz")
    assert (sae.architecture, sae.d_in, sae.d_sae, sae.site) == (
        "jumprelu",
        8,
        16,
        ("resid_post", 5),
    )
    x = torch.randn(2, 3, 8)
    features, decoded = _jumprelu(p, x)
    torch.testing.assert_close(sae.encode(x), features, atol=TOL, rtol=0)
    torch.testing.assert_close(sae(x), decoded, atol=TOL, rtol=0)


def test_gemma_scope_1_attention_and_embedding(tmp_path: Path) -> None:
    p = _params(12, 16, 12, seed=4)
    att = tmp_path / "gemma-scope-2b-pt-att" / "layer_2" / "width_16k" / "average_l0_5"
    emb = tmp_path / "gemma-scope-2b-pt-res" / "embedding" / "width_4k" / "average_l0_6"
    for folder in (att, emb):
        folder.mkdir(parents=True)
        np.savez(folder / "params.npz", **{k: v.numpy() for k, v in p.items()})
    z = load(att)  # hook_z: (..., H, D) flattened on encode, restored on decode
    assert (z.hook_name, z.site, z.reshape_activations) == (
        "blocks.2.attn.hook_z",
        ("z", 2),
        "hook_z",
    )
    x = torch.randn(2, 5, 3, 4)
    features, decoded = _jumprelu(p, x.flatten(-2))
    torch.testing.assert_close(z.encode(x), features, atol=TOL, rtol=0)
    torch.testing.assert_close(z(x), decoded.unflatten(-1, (3, 4)), atol=TOL, rtol=0)
    # an embedding SAE: W_enc / sqrt(d_in), W_dec * sqrt(d_in) (gemma_2_sae_huggingface_loader)
    e = load(emb)
    assert (e.hook_name, e.site) == ("hook_embed", ("embed", 0))
    root = 12**0.5
    scaled = {**p, "W_enc": p["W_enc"] / root, "W_dec": p["W_dec"] * root}
    x = torch.randn(4, 12)
    torch.testing.assert_close(e(x), _jumprelu(scaled, x)[1], atol=1e-5, rtol=1e-6)
    # a folder that is not Gemma Scope's says nothing of the hook
    elsewhere = tmp_path / "my-mlp-runs" / "layer_1"
    elsewhere.mkdir(parents=True)
    np.savez(elsewhere / "params.npz", **{k: v.numpy() for k, v in p.items()})
    assert (load(elsewhere).hook_name, load(elsewhere).site) == (None, None)
    with pytest.raises(ValueError, match="name no hook it reads"):
        load(elsewhere).require_site()


def test_a_safetensors_header_length_is_not_taken_for_a_pickle(tmp_path: Path) -> None:
    p = {k.lower(): v for k, v in _params(4, 8, 4, seed=5).items()}
    entries, offset = {}, 0
    for name, t in p.items():
        entries[name] = {
            "dtype": "F32",
            "shape": list(t.shape),
            "data_offsets": [offset, offset + 4 * t.numel()],
        }
        offset += 4 * t.numel()
    header = json.dumps(entries).encode().ljust(0x0280)  # its length's bytes: 0x80 0x02 ...
    file = tmp_path / "params.safetensors"
    file.write_bytes(
        len(header).to_bytes(8, "little")
        + header
        + b"".join(t.numpy().tobytes() for t in p.values())
    )
    assert file.read_bytes()[:2] == b"\x80\x02"  # what a pickle of protocol 2 starts with
    assert load(file).d_sae == 8


# -- bad inputs: one line each, before anything is read ----------------------------------------


def _copy(name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(DATA / name, tmp_path / name))


def _edit_cfg(folder: Path, **changes: object) -> None:
    cfg = json.loads((folder / "cfg.json").read_text())
    cfg.update(changes)
    (folder / "cfg.json").write_text(json.dumps(cfg))


def _one_line(e: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(e.value)
    assert "\n" not in text
    return text


def test_a_pickle_is_refused_unopened(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("a pickle was opened")

    monkeypatch.setattr(torch, "load", never)
    monkeypatch.setattr(pickle, "load", never)
    (tmp_path / "sae.pt").write_bytes(b"\x80\x04 anything")
    (tmp_path / "params.npz").write_bytes(pickle.dumps({"W_enc": 1}))  # a pickle by its bytes
    folder = tmp_path / "old"
    folder.mkdir()
    (folder / "cfg.json").write_text(json.dumps({"d_in": 4, "d_sae": 8, "hook_point": "x"}))
    (folder / "sae_weights.pt").write_bytes(b"\x80\x04")
    for path in (tmp_path / "sae.pt", tmp_path / "params.npz", folder):
        with pytest.raises(ValueError, match="is a pickle .* never opens") as e:
            load(path)
        _one_line(e)


def test_an_npz_object_array_or_a_huge_claim_is_refused(tmp_path: Path) -> None:
    np.savez(tmp_path / "objects.npz", W_enc=np.array([{"a": 1}], dtype=object))
    with pytest.raises(ValueError, match="dtype object .objects are pickles, never read") as e:
        load(tmp_path / "objects.npz")
    _one_line(e)
    # an .npy header promising 10^12 floats over 16 bytes of data: refused from its header
    header = {"descr": "<f4", "fortran_order": False, "shape": (10**6, 10**6)}
    npy = tmp_path / "W_enc.npy"
    with open(npy, "wb") as f:
        np.lib.format.write_array_header_1_0(f, header)
        f.write(b"\0" * 16)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(np, "load", lambda *a, **k: pytest.fail("np.load before the shapes"))
        import zipfile

        with zipfile.ZipFile(tmp_path / "params.npz", "w") as z:
            z.write(npy, "W_enc.npy")
        with pytest.raises(ValueError, match=r"needs 4000000000000 bytes, the member holds 16"):
            load(tmp_path / "params.npz")


def test_cfg_sizes_that_disagree_are_refused_before_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import multihead.sae.loading as loading

    monkeypatch.setattr(loading, "read_tensors", lambda *a, **k: pytest.fail("read tensors"))
    folder = _copy("standard", tmp_path)
    _edit_cfg(folder, d_sae=10**12)
    with pytest.raises(
        ValueError,
        match=r"not hold the standard SAE of cfg.json \(d_in=12, d_sae=1000000000000\): "
        r".*W_enc has shape \(12, 24\), not \(12, 1000000000000\)",
    ) as e:
        load(folder)
    _one_line(e)
    folder = _copy("jumprelu", tmp_path / "b")
    _edit_cfg(folder, architecture="standard")  # jumprelu's threshold is then unexpected
    with pytest.raises(ValueError, match="unexpected threshold"):
        load(folder)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"architecture": "temporal"}, r"architecture must be one of standard, topk, .*'temporal'"),
        ({"d_in": "12"}, r"d_in must be a positive int, got '12'"),
        ({"normalize_activations": "whiten"}, r"normalize_activations must be one of"),
        ({"reshape_activations": "hook_q"}, r"reshape_activations must be one of 'none', 'hook_z'"),
        ({"dtype": "int8"}, r"dtype must be one of float32"),
        ({"apply_b_dec_to_input": "yes"}, r"apply_b_dec_to_input must be true or false"),
    ],
)
def test_a_bad_config_is_one_line(tmp_path: Path, changes: dict[str, object], message: str) -> None:
    folder = _copy("standard", tmp_path)
    _edit_cfg(folder, **changes)
    with pytest.raises(ValueError, match=message) as e:
        load(folder)
    assert "cfg.json" in _one_line(e)


def test_configs_sae_lens_refuses_are_refused(tmp_path: Path) -> None:
    folder = _copy("transcoder", tmp_path)
    _edit_cfg(folder, d_out=None)
    with pytest.raises(ValueError, match="d_out must be a positive int, got None"):
        load(folder)
    _edit_cfg(folder, d_out=10, apply_b_dec_to_input=True)
    with pytest.raises(ValueError, match="apply_b_dec_to_input must be false for a transcoder"):
        load(folder)
    old = _copy("v5_standard", tmp_path / "old")
    _edit_cfg(old, activation_fn_str="tanh-relu")
    with pytest.raises(ValueError, match=r"activation_fn must be 'relu'.*'tanh-relu'"):
        load(old)
    topk = _copy("topk", tmp_path / "topk")
    _edit_cfg(topk, k=25)
    with pytest.raises(ValueError, match=r"k must be an int in \[1, d_sae = 24\]"):
        load(topk)
    scaled = _copy("v5_standard_scaled", tmp_path / "scaled")
    _edit_cfg(scaled, finetuning_scaling_factor=False)
    with pytest.raises(ValueError, match="finetuning_scaling_factor is not true"):
        load(scaled)


def test_neither_format_or_nothing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="is missing"):
        load(tmp_path / "nothing")
    (tmp_path / "notes.txt").write_text("hello")
    for path in (tmp_path, tmp_path / "notes.txt"):
        with pytest.raises(ValueError, match="is neither a SAELens directory") as e:
            load(path)
        _one_line(e)
    folder = _copy("standard", tmp_path / "w")
    (folder / "sae_weights.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="sae_weights.safetensors' is missing"):
        load(folder)
    with pytest.raises(ValueError, match="dtype must be None, a floating torch.dtype"):
        load(DATA / "standard", dtype=torch.int8)


def test_bad_calls_name_the_argument() -> None:
    sae: SAE = load(DATA / "standard_layer_norm")
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., 12\) \(d_in\), got"):
        sae.encode(torch.randn(3, 11))
    with pytest.raises(ValueError, match=r"features must have shape \(\.\.\., 24\) \(d_sae\)"):
        sae.decode(torch.randn(3, 12))
    with pytest.raises(ValueError, match="needs input=, the activations the features were"):
        sae.decode(torch.randn(3, 24))
    z = load(DATA / "standard_hook_z")
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., H, D\) with H·D = 12"):
        z.encode(torch.randn(2, 12, 1, 1))
    with pytest.raises(ValueError, match="decode of a hook_z SAE needs input="):
        z.decode(torch.randn(2, 24))


def test_a_compressed_npz_with_constant_arrays_loads(tmp_path: Path) -> None:
    """np.savez_compressed of zero biases compresses one member hundreds of times: the archive
    is bounded as a whole, so such a file loads, its arrays as written."""
    g = np.random.default_rng(0)
    arrays = {
        "W_enc": g.standard_normal((16, 64)).astype(np.float32),
        "W_dec": g.standard_normal((64, 16)).astype(np.float32),
        "b_enc": np.zeros(64, np.float32),
        "b_dec": np.zeros(16, np.float32),
        "threshold": np.zeros(64, np.float32),
    }
    np.savez_compressed(tmp_path / "params.npz", **arrays)
    sae = multihead.sae.load(tmp_path / "params.npz")
    assert (sae.d_in, sae.d_sae, sae.architecture) == (16, 64, "jumprelu")
    assert np.array_equal(sae.W_enc.detach().numpy(), arrays["W_enc"])


@pytest.mark.parametrize(
    ("where", "scope", "hook"),
    [
        # the folders below the repository's say the kind and layer; one above it does not
        ("embedding_experiments/gemma-scope-2b-pt-res/layer_5/width_16k/l0_71", 1,
         "blocks.5.hook_resid_post"),
        ("hub/models--google--gemma-scope-2b-pt-res/snapshots/ab12/embedding/width_4k", 1,
         "hook_embed"),
        ("clt_notes/gemma-scope-2-270m-pt/layer_3_width_16k", 2, None),
        ("gemma-scope-2-270m-pt/attn_out/layer_3_width_16k_l0_small", 2, "blocks.3.attn.hook_z"),
        ("elsewhere/resid_post/layer_7_width_16k", 2, "blocks.7.hook_resid_post"),
    ],
)  # fmt: skip
def test_gemma_scopes_hook_is_read_from_its_own_folders(
    tmp_path: Path, where: str, scope: int, hook: str | None
) -> None:
    from multihead._files import TensorInfo
    from multihead.sae.gemma_scope import gemma_scope_config

    folder = tmp_path / where
    folder.mkdir(parents=True)
    shapes = {
        "W_enc": TensorInfo((8, 16), "float32"), "W_dec": TensorInfo((16, 8), "float32"),
        "b_enc": TensorInfo((16,), "float32"), "b_dec": TensorInfo((8,), "float32"),
        "threshold": TensorInfo((16,), "float32"),
    }  # fmt: skip
    name = "params.npz" if scope == 1 else "params.safetensors"
    config = gemma_scope_config(folder / name, shapes, scope)
    assert config.hook_name == hook
    assert config.architecture == "jumprelu"  # none of these is a transcoder
