"""Hugging Face Transformers in and out:
`peer export` writes a folder that Transformers loads with the same logits and tokenizer ids,
`peer generate` matches Transformers' greedy generate, `--init-from` reads a Llama with grouped-query
attention and tied embeddings exactly (the swarm started from it equals `peer reference` started from
it), and bad folders are refused naming the problem, with nothing written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from peer.cli import main as peer
from tests.hf.conftest import TEXT, make_llama

SAMPLE = "def add(a, b):\n    return a + b  # héllo ü\n"


@pytest.fixture(autouse=True)
def token_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HIVEPIPE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny preset trained 2 steps by `peer reference`, and its export."""
    d = tmp_path_factory.mktemp("trained")
    assert (
        peer(["reference", "--model", "tiny", "--steps", "2", "--checkpoint-out", str(d / "ck"), "--no-progress"]) == 0
    )
    assert peer(["export", str(d / "ck"), "--hf", str(d / "hf")]) == 0
    return d


def _ours(state, cfg):
    from core.model.transformer import slice_from_state

    return slice_from_state(cfg, 0, cfg.layers, state).eval()


def test_export_gives_the_same_logits_and_token_ids_in_transformers(trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from peer.hf.checkpoints import read_checkpoint

    assert sorted(os.listdir(trained / "hf")) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    ours = read_checkpoint(str(trained / "ck"))
    hf = AutoModelForCausalLM.from_pretrained(trained / "hf").eval()
    tok = AutoTokenizer.from_pretrained(trained / "hf")
    ids = tok(SAMPLE)["input_ids"]
    assert ids == list(SAMPLE.encode()) and tok.decode(ids) == SAMPLE  # hivepipe's byte vocabulary
    x = torch.tensor([ids[:32], ids[-32:]])
    with torch.no_grad():
        diff = (_ours(ours.state, ours.cfg)(x) - hf(x).logits).abs().max().item()
    assert diff < 1e-4, diff


def test_generate_greedy_equals_transformers_and_sampling_is_seeded(trained, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(trained / "hf").eval()
    tok = AutoTokenizer.from_pretrained(trained / "hf")
    prompt = "def f("
    with torch.no_grad():
        expected = tok.decode(
            hf.generate(torch.tensor([tok(prompt)["input_ids"]]), do_sample=False, max_new_tokens=20)[0]
        )
    texts = []
    for source in (trained / "ck", trained / "hf"):
        capsys.readouterr()
        assert peer(["generate", str(source), "--prompt", prompt, "--max-new-tokens", "20", "--greedy"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts == [expected + "\n"] * 2
    sampled = []
    for seed in (1, 1, 2):
        assert (
            peer(
                [
                    "generate",
                    str(trained / "ck"),
                    "--prompt",
                    prompt,
                    "--max-new-tokens",
                    "30",
                    "--temperature",
                    "1.5",
                    "--top-p",
                    "0.95",
                    "--seed",
                    str(seed),
                ]
            )
            == 0
        )
        sampled.append(capsys.readouterr().out)
    assert sampled[0] == sampled[1] != sampled[2] and all(s.startswith(prompt) for s in sampled)


def test_init_from_reads_grouped_query_attention_and_tied_embeddings_exactly(tmp_path):
    from peer.hf.llama import HFModelDir

    model, _ = make_llama(tmp_path / "llama", tied=True, kv_heads=2)
    d = HFModelDir.open(str(tmp_path / "llama"))
    assert (d.cfg.kv_heads, d.cfg.rope_theta, d.cfg.norm_eps, d.tied) == (2, 50000.0, 1e-6, True)
    full = d.read_slice(0, 4)
    halves = d.read_slice(0, 2) | d.read_slice(2, 4)  # what two servers read, each its stage only
    assert full.keys() == halves.keys() and all(torch.equal(full[k], halves[k]) for k in full)
    assert torch.equal(full["lm_head.weight"], full["embed.weight"])
    x = torch.randint(0, d.cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (_ours(full, d.cfg)(x) - model.eval()(x).logits).abs().max().item()
    assert diff < 1e-4, diff


@pytest.mark.swarm
def test_a_swarm_started_from_a_transformers_model_equals_the_reference_and_exports(tmp_path):
    """`peer swarm --init-from` (servers read their stage's tensors, volunteers build their slice from
    the architecture in the run's config record, --data goes through the model's tokenizer) ends
    equal to `peer reference --init-from`; its servers' checkpoint folders export to a folder that
    Transformers loads with the same logits and the model's own tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from peer.hf.checkpoints import read_checkpoint

    make_llama(tmp_path / "llama", tied=False, kv_heads=1)
    (tmp_path / "text.txt").write_text(TEXT)
    common = [
        "--init-from",
        str(tmp_path / "llama"),
        "--data",
        str(tmp_path / "text.txt"),
        "--steps",
        "3",
        "--no-progress",
    ]
    assert peer(["reference", *common, "--checkpoint-out", str(tmp_path / "ref")]) == 0
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "peer.cli",
            "swarm",
            *common,
            "--volunteers",
            "2",
            "--run-id",
            f"hf-{os.getpid()}",
            "--work-dir",
            str(tmp_path / "work"),
            "--checkpoint-out",
            str(tmp_path / "swarm"),
            "--summary-json",
            str(tmp_path / "s.json"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["microbatches_applied"] == summary["microbatches_expected"]
    assert any(summary["volunteers_by_stage"].values()), summary["volunteers_by_stage"]
    ref, swarm = read_checkpoint(str(tmp_path / "ref")), read_checkpoint(str(tmp_path / "swarm"))
    num = sum(float((swarm.state[k] - ref.state[k]).pow(2).sum()) for k in ref.state)
    assert (num / sum(float(v.pow(2).sum()) for v in ref.state.values())) ** 0.5 < 1e-5
    assert swarm.tokenizer == os.path.abspath(tmp_path / "llama")

    ckpt = tmp_path / "work" / "checkpoints"
    assert peer(["export", "--checkpoint-dirs", str(ckpt), "--hf", str(tmp_path / "out")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tok, original = AutoTokenizer.from_pretrained(tmp_path / "out"), AutoTokenizer.from_pretrained(tmp_path / "llama")
    assert tok(SAMPLE)["input_ids"] == original(SAMPLE)["input_ids"]
    x = torch.tensor([tok(TEXT[:200])["input_ids"][:32]])
    with torch.no_grad():
        diff = (_ours(swarm.state, swarm.cfg)(x) - hf(x).logits).abs().max().item()
    assert diff < 1e-4, diff


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def _drop_tensor(path, name):
    from safetensors.torch import load_file, save_file

    state = load_file(path / "model.safetensors")
    del state[name]
    save_file(state, path / "model.safetensors")


def _reshape_tensor(path, name):
    from safetensors.torch import load_file, save_file

    state = load_file(path / "model.safetensors")
    state[name] = torch.zeros(3, 3)
    save_file(state, path / "model.safetensors")


BAD = {
    "not a directory": (lambda p: shutil.rmtree(p), "not a directory"),
    "no config": (lambda p: os.remove(p / "config.json"), "no config.json"),
    "other model type": (lambda p: _edit_config(p, model_type="gpt2"), "'model_type' is 'gpt2'"),
    "biases": (lambda p: _edit_config(p, attention_bias=True), "'attention_bias' is true"),
    "rope scaling": (
        lambda p: _edit_config(p, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
        "rope_type' is 'linear'",
    ),
    "other head size": (lambda p: _edit_config(p, head_dim=16), "'head_dim' is 16"),
    "missing tensor": (
        lambda p: _drop_tensor(p, "model.layers.1.mlp.up_proj.weight"),
        "model.layers.1.mlp.up_proj.weight missing",
    ),
    "wrong shape": (
        lambda p: _reshape_tensor(p, "model.layers.0.self_attn.k_proj.weight"),
        "k_proj.weight has shape [3, 3]",
    ),
    "no weights": (lambda p: os.remove(p / "model.safetensors"), "no model.safetensors"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_folder_that_is_not_a_supported_llama_exits_2_naming_it_and_writes_nothing(tmp_path, capsys, case):
    make_llama(tmp_path / "llama", tied=False)
    spoil, message = BAD[case]
    spoil(tmp_path / "llama")
    code = peer(
        [
            "reference",
            "--init-from",
            str(tmp_path / "llama"),
            "--steps",
            "1",
            "--checkpoint-out",
            str(tmp_path / "out"),
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert not (tmp_path / "out").exists()
    assert peer(["generate", str(tmp_path / "llama"), "--prompt", "x"]) == 2


def test_export_refuses_bad_checkpoints_and_leaves_no_folder(tmp_path, trained, capsys):
    from safetensors.torch import load_file, save_file

    state = load_file(trained / "ck" / "model.safetensors")
    del state["norm.weight"]
    (tmp_path / "bad").mkdir()
    save_file(state, tmp_path / "bad" / "model.safetensors")  # no metadata either
    cases = [
        ([str(tmp_path / "bad"), "--hf", str(tmp_path / "o1")], "give --model PRESET"),
        ([str(tmp_path / "bad"), "--model", "tiny", "--hf", str(tmp_path / "o2")], "norm.weight missing"),
        ([str(tmp_path / "nothing"), "--hf", str(tmp_path / "o3")], "no such checkpoint"),
        ([str(trained / "ck"), "--hf", str(trained / "hf")], "exists and is not an empty folder"),
        (["--checkpoint-dirs", str(tmp_path), "--hf", str(tmp_path / "o4")], "no server checkpoint"),
        (["--hf", str(tmp_path / "o5")], "either CHECKPOINT or --checkpoint-dirs"),
    ]
    for argv, message in cases:
        assert peer(["export", *argv]) == 2
        err = capsys.readouterr().err
        assert message in err, (argv, err)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(("o", ".export"))]
    assert sorted(os.listdir(trained / "hf"))[0] == "config.json"  # the existing export is untouched
