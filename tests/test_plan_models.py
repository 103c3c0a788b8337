"""``hpc plan`` of models other than the built-in GPT (issue 30): transformers causal LMs from their config
(jobs/models/shape.py), grouped-query attention, gated MLPs, tied heads and sliding windows in parallel/plan.py's
arithmetic, ``model.entry`` models counted on the meta device, and ``--model``'s new keys. Every parameter count the
planner derives is checked against ``sum(p.numel())`` of the real model built on the meta device."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from hpc.cli.main import main
from hpc.config import load_spec
from parallel.cluster import load_cluster
from parallel.plan import MIXED_ADAM, Layout, Transformer, memory_bytes, microbatch_parts

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from jobs.models.hf_config import hf_config  # noqa: E402  (needs torch)
from jobs.models.shape import spec_model  # noqa: E402  (needs torch)

REPO = Path(__file__).resolve().parents[1]
LLAMA = REPO / "jobs" / "examples" / "llama.toml"
BENCH = REPO / "jobs" / "bench" / "llama_bench.toml"
H100 = ["--cluster", "h100-dgx"]


def real_params(args: dict) -> int:
    """The transformers model of ``args``, built on the meta device: its parameters, each once."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(args))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("overrides", [
    [],
    ["model.args.model_type=qwen2", "model.args.tie_word_embeddings=true"],
    ["model.args.model_type=qwen2", "model.args.use_sliding_window=true", "model.args.sliding_window=16",
     "model.args.max_window_layers=2"],
    ["model.args.model_type=mistral", "model.args.sliding_window=32", "model.args.head_dim=64"],
    ["model.args.model_type=qwen3"],
    ["model.args.attention_bias=true", "model.args.mlp_bias=true"],
], ids=["llama", "qwen2-tied", "qwen2-window", "mistral", "qwen3", "llama-biases"])
def test_a_transformers_configs_parameters_are_counted_exactly(overrides: list[str]) -> None:
    spec = load_spec(LLAMA, overrides)
    model = spec_model(spec)
    assert model.params == real_params(spec.model.args)
    assert (model.layers, model.hidden, model.heads, model.kv, model.vocab) == (4, 256, 8, 2, 256)


def test_sliding_windows_are_read_from_the_config_layer_by_layer() -> None:
    qwen2 = spec_model(load_spec(LLAMA, ["model.args.model_type=qwen2", "model.args.use_sliding_window=true",
                                         "model.args.sliding_window=16", "model.args.max_window_layers=2"]))
    assert (qwen2.window, qwen2.window_layers, qwen2.attended) == (16, 2, (2 * 16 + 2 * 64) / 4)
    mistral = spec_model(load_spec(LLAMA, ["model.args.model_type=mistral", "model.args.sliding_window=32"]))
    assert (mistral.window, mistral.window_layers, mistral.attended) == (32, 4, 32)
    assert spec_model(load_spec(LLAMA)).attended == 64  # Llama: no window


def test_the_bench_llama_counts_its_measured_parameters_and_6n_plus_12lsh_flops() -> None:
    """jobs/bench/llama_bench.toml: 722,536,448 parameters (measured, docs/BENCHMARKS.md). The planner's model
    FLOPs per token are 6 N + 12 L s h less 6 x the parameters without FLOPs (the embedding, the norms)."""
    spec = load_spec(BENCH)
    model = spec_model(spec)
    assert model.params == 722_536_448 == real_params(spec.model.args)
    per_token = 3 * (model.layers * model.layer_flops(1) + model.logit_flops(1))
    L, s, h, V = 16, 1024, 2048, 256
    no_flops = V * h + (2 * L + 1) * h  # the embedding's lookup, the RMSNorm weights
    assert per_token == 6 * (model.params - no_flops) + 12 * L * s * h
    assert per_token / (6 * model.params + 12 * L * s * h) == pytest.approx(1, abs=1e-3)


def test_grouped_query_attention_shrinks_k_and_v_but_not_the_tp_traffic() -> None:
    full = Transformer(8, 1024, 16, 1024, 32000, ffn=2816, gated=True, tied=False, family="llama")
    gqa = replace(full, kv_heads=4)
    d = 1024 // 16
    assert full.params - gqa.params == 8 * 2 * 1024 * (16 - 4) * d  # K and V: h x k d each, per layer
    assert gqa.layer_flops(2048) < full.layer_flops(2048)
    cluster, train = load_cluster("h100-dgx"), replace(MIXED_ADAM, batch=64)
    for lay in (Layout(2, 4, 1, 4), Layout(1, 2, 4, 8, checkpointing="full")):
        assert memory_bytes(gqa, train, cluster, lay) < memory_bytes(full, train, cluster, lay)
        assert microbatch_parts(gqa, train, cluster, lay)[1] == microbatch_parts(full, train, cluster, lay)[1]


def test_gated_mlps_tied_heads_and_windows_in_the_arithmetic() -> None:
    gpt = Transformer(4, 256, 8, 512, 1000)
    assert gpt.layer_params == 12 * 256**2 + 13 * 256 and gpt.params == 4 * gpt.layer_params + (1000 + 512) * 256
    gated = replace(gpt, ffn=683, gated=True)
    assert gated.layer_matrices == 4 * 256**2 + 3 * 256 * 683
    untied = replace(gpt, tied=False)
    assert untied.params - gpt.params == 1000 * 256 and untied.logit_flops(64) == gpt.logit_flops(64)
    windowed = replace(gpt, window=128)
    scores = 4.0 * 64 * 256  # per key attended, 64 tokens, a d = h
    assert gpt.layer_flops(64) - windowed.layer_flops(64) == pytest.approx(scores * (512 - 128))


def test_hpc_plan_of_the_llama_example_prints_a_table(capsys) -> None:
    assert main(["plan", str(LLAMA), *H100, "--gpus", "8", "--top", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("2.36M-parameter llama (4 layers, hidden 256, 8 heads and 2 KV heads, gated MLP 512, "
                               "seq 64, untied head) on 8 x DGX H100: ")
    assert lines[1].split()[:3] == ["layout", "step", "tokens/s"] and lines[-3].startswith("recommended: dp=")
    assert lines[-2].startswith("compression: none pays here")  # one node: nothing slow to cross
    assert lines[-1].startswith("the spec's layout, dp=2 tp=2 pp=2 m=4 1f1b: number ")
    assert main(["plan", str(LLAMA), *H100, "--gpus", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["params"] == 2_361_600 and data["model"]["kv_heads"] == 2
    assert not any(row["layout"]["tp"] == 4 for row in data["layouts"])  # 4 does not divide the 2 KV heads


def test_hpc_plan_reads_the_configs_keys_and_refuses_a_tp_the_kv_heads_do_not_take(capsys) -> None:
    deeper = ["--set", "model.args.num_hidden_layers=8", "--json"]
    assert main(["plan", str(LLAMA), *H100, "--gpus", "8", *deeper]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["layers"] == 8
    assert main(["plan", str(LLAMA), *H100, "--layout", "dp=2,tp=4,pp=1"]) == 2
    err = capsys.readouterr().err
    assert "tp=4 does not divide the model's 2 KV heads" in err and err.count("\n") == 1


def test_pretrained_configs_are_read_with_the_args_over_them(tmp_path: Path) -> None:
    stored = hf_config({"model_type": "qwen2", "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 3,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512})
    stored.architectures = ["Qwen2ForCausalLM"]
    stored.save_pretrained(tmp_path)
    args = {"pretrained": str(tmp_path), "num_hidden_layers": 2}
    config = hf_config(args)
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("qwen2", 128, 2)
    job = tmp_path / "job.toml"
    job.write_text(f'[model]\nentry = "jobs.models.hf:causal_lm"\n[model.args]\npretrained = "{tmp_path}"\n'
                   'num_hidden_layers = 2\n')
    model = spec_model(load_spec(job))
    assert (model.name, model.layers, model.hidden) == ("qwen2", 2, 128) and model.params == real_params(args)
    with pytest.raises(Exception, match=r"model.args.pretrained='.*missing': cannot read"):
        hf_config({"pretrained": str(tmp_path / "missing")})


def test_an_entry_is_counted_on_the_meta_device(capsys, tmp_path: Path) -> None:
    from jobs.models.protocol import build_model

    job = tmp_path / "job.toml"
    job.write_text('[model]\nentry = "jobs.models.gpt:gpt"\n[model.args]\nvocab_size = 256\nseq_len = 64\n'
                   'd_model = 128\nn_heads = 4\nn_layers = 4\n')
    spec = load_spec(job)
    model = spec_model(spec)
    assert model.params == sum(p.numel() for p in build_model(spec).parameters())
    assert (model.layers, model.hidden, model.heads, model.vocab) == (4, 128, 4, 256)
    assert main(["plan", str(job), *H100, "--gpus", "4"]) == 0
    out = capsys.readouterr().out
    assert "parameter jobs.models.gpt:gpt (4 layers, hidden 128, 4 heads, counted on the meta device" in out


HEADLESS = '''
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    def pipeline_parts(self):
        return self.embed, list(self.blocks), self.head

    def loss(self, output, targets):
        return output.sum()


def model():
    return Model()
'''


def test_a_model_the_planner_cannot_count_is_one_line_with_model_as_the_way_out(capsys, tmp_path: Path,
                                                                                monkeypatch) -> None:
    (tmp_path / "headless.py").write_text(HEADLESS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = tmp_path / "job.toml"
    spec.write_text('[model]\nentry = "headless:model"\n')
    assert main(["plan", str(spec), *H100, "--gpus", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "hpc plan cannot count model.entry='headless:model': its pipeline_parts() show " \
        "no attention heads; give --model layers=,hidden=,heads=,seq=,vocab=" in err, err
    spec.write_text('[model]\nkind = "mlp"\n')
    assert main(["plan", str(spec), *H100, "--gpus", "2"]) == 2
    assert "cannot count model.entry='jobs.models.mlp:mlp': it has no pipeline_parts()" in capsys.readouterr().err


def test_model_takes_kv_heads_ffn_gated_and_tied(capsys) -> None:
    llama70 = "layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672,gated=1,tied=0,seq=4096,vocab=128256"
    assert main(["plan", "--model", llama70, "--batch", "1024", *H100, "--gpus", "64", "--json"]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert (model["kv_heads"], model["ffn"], model["gated"], model["tied"]) == (8, 28672, True, False)
    assert model["params"] == pytest.approx(70.55e9, rel=0.002)  # Llama 3 70B; the GPT's biases and positions
    for bad, message in (("gated=2", "--model gated must be 0 or 1, got 2"),
                         ("kv_heads=3", "--model kv_heads must divide heads=8, got 3")):
        assert main(["plan", "--model", f"layers=2,hidden=64,heads=8,seq=16,vocab=32,{bad}", "--batch", "8", *H100,
                     "--gpus", "2"]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
