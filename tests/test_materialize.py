"""Models built on the meta device and materialized shard by shard (``jobs/models/materialize.py``).

Under each layout every rank builds its ``Workload`` (the model on meta, its share cut, then
materialized), and each tensor it holds must equal, bit for bit, its slice of the single-device
model that ``jobs.models.protocol.build_model`` builds whole on the host with the same seed (buffers,
rotary ``inv_freq`` included), every tensor of that model must be held by some rank, and the global
generator must end where the host build leaves it (dropout draws on from there). Then the point of
it: a rank's peak host memory while building is its share plus about one tensor, not the whole model.
"""

from __future__ import annotations

import gc
import itertools
import math
from pathlib import Path

import pytest
import torch

from hpc.config import spec_from_dict
from hpc.runtime.mesh import MeshShape, build_mesh
from tests.ranks import run_ranks

TINY_GPT = {"kind": "gpt", "n_layers": 4, "n_heads": 2, "d_model": 32, "seq_len": 16}
TINY_LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 32, "tie_word_embeddings": False}
MODELS = {
    "gpt": ({**TINY_GPT, "dropout": 0.1}, "licenses"),
    "gpt-moe": ({**TINY_GPT, "moe_experts": 4, "moe_every": 2}, "licenses"),
    "mlp": ({"kind": "mlp", "hidden_sizes": [128, 64]}, "digits"),
    "llama": ({"entry": "jobs.models.hf:causal_lm", "args": TINY_LLAMA, "seq_len": 16}, "licenses"),
    "llama-tied": ({"entry": "jobs.models.hf:causal_lm", "args": {**TINY_LLAMA, "tie_word_embeddings": True},
                    "seq_len": 16}, "licenses"),
}
MLP_TP_PLAN = {"0": "colwise", "2": "rowwise"}  # the MLP has no plan of its own: the spec gives one


def _spec(model: str, layout: tuple[int, int, int], ep: int = 1, seed: int = 5, run_dir: str = "unused"):
    dp, tp, pp = layout
    model_table, data = MODELS[model]
    if model == "mlp":
        model_table = {**model_table, "tp_plan": MLP_TP_PLAN}
    return spec_from_dict({
        "job": {"run_dir": run_dir, "name": model, "seed": seed},
        "model": model_table,
        "data": {"name": data, "batch_size": 8},
        "parallel": {"dp": dp, "tp": tp, "pp": pp, "ep": ep, "microbatches": 2 if pp > 1 else 1},
    })


def _materialized_vs_host(world, cases, device: str = "cpu"):
    """Each case's share, materialized on ``device`` (``cuda``: the rank's GPU), against the host build's slices;
    returns (where it was built, names)."""
    from jobs.models.materialize import named_tensors
    from jobs.models.protocol import build_model
    from jobs.train.workloads import Workload
    from parallel.tensor_parallel import tp_split_dims

    results = []
    for model, layout, ep in cases:
        spec = _spec(model, layout, ep)
        mesh = build_mesh(MeshShape(*layout), world.rank, world.device if device == "cuda" else "cpu")
        workload = Workload(spec, mesh)
        after_materializing = torch.get_rng_state()
        whole = build_model(spec)
        assert torch.equal(after_materializing, torch.get_rng_state()), f"{model}: the global generator moved"
        expected, share = named_tensors(whole), named_tensors(workload.model)  # a tied weight under both names
        dims, tp_rank = tp_split_dims(workload.model), mesh.index("tp")
        for name, tensor in share.items():
            want = expected[name]
            if name in dims:
                size = tensor.shape[dims[name]]
                want = want.narrow(dims[name], tp_rank * size, size)
            assert tensor.device == mesh.device and torch.equal(tensor.cpu(), want), f"{model} {layout}: {name}"
        results.append((workload.built_on, sorted(share)))
    return results


ONE_RANK = [("gpt", (1, 1, 1), 1), ("gpt-moe", (1, 1, 1), 1), ("mlp", (1, 1, 1), 1), ("llama", (1, 1, 1), 1),
            ("llama-tied", (1, 1, 1), 1)]
TWO_RANKS = [("gpt", (1, 2, 1), 1), ("gpt", (1, 1, 2), 1), ("gpt-moe", (2, 1, 1), 2), ("gpt-moe", (1, 1, 2), 1),
             ("mlp", (1, 2, 1), 1), ("llama", (1, 2, 1), 1), ("llama", (1, 1, 2), 1), ("llama-tied", (1, 2, 1), 1)]
FOUR_RANKS = [("gpt", (1, 2, 2), 1), ("gpt-moe", (2, 1, 2), 2), ("mlp", (2, 2, 1), 1), ("llama", (1, 2, 2), 1)]


@pytest.mark.parametrize("cases", [ONE_RANK, TWO_RANKS, FOUR_RANKS], ids=["1-rank", "2-ranks", "4-ranks"])
def test_every_share_is_the_host_builds_slice(cases) -> None:
    from jobs.models.materialize import named_tensors
    from jobs.models.protocol import build_model

    world_size = math.prod(cases[0][1])
    per_rank = run_ranks(world_size, _materialized_vs_host, cases, timeout=300)
    for number, (model, layout, ep) in enumerate(cases):
        built = {built_on for results in per_rank for built_on, _ in [results[number]]}
        assert built == {"meta"}, f"{model} {layout}: built on {built}"
        held = {name for results in per_rank for name in results[number][1]}
        with torch.device("meta"):
            whole = build_model(_spec(model, layout, ep))
        assert held == set(named_tensors(whole)), f"{model} {layout}: not all held"


@pytest.mark.cuda
def test_every_share_materialized_on_the_gpu_is_the_host_builds_slice() -> None:
    """The values are made on the host and each shard copied to the device: bit for bit the host build's."""
    per_rank = run_ranks(2, _materialized_vs_host, TWO_RANKS, "cuda", timeout=300, device="cuda")
    assert {built_on for results in per_rank for built_on, _ in results} == {"meta"}


BIG_GPT = {"kind": "gpt", "n_layers": 16, "n_heads": 8, "d_model": 512, "seq_len": 16}  # 50M parameters: 201 MB
WARM_GPT = {**BIG_GPT, "n_layers": 4, "d_model": 32}  # the same code paths first: their first run's pages aside
MARGIN = 8 << 20  # the allocator's and the interpreter's own while building


def _status(field: str) -> int:
    """A /proc/self/status size (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _peak_while(build):
    """(what ``build()`` returns, the most resident memory it added at any time): the high-water mark reset
    to the resident size first."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status("VmRSS")
    built = build()
    return built, _status("VmHWM") - before


def _build_peaks(world, layout):
    """(where the Workload built, this rank's peak host memory while it builds, its share's bytes, the largest
    tensor's, the whole model's); rank 0 adds the peak of the whole model built on the host as before."""
    from jobs.models.materialize import named_tensors
    from jobs.models.protocol import build_model
    from jobs.train.workloads import Workload

    def spec(model):
        return spec_from_dict({"job": {"seed": 1}, "model": model, "data": {"name": "licenses", "batch_size": 8},
                               "parallel": {"tp": layout[1], "pp": layout[2], "microbatches": 2}})

    mesh = build_mesh(MeshShape(*layout), world.rank)
    Workload(spec(WARM_GPT), mesh)
    workload, peak = _peak_while(lambda: Workload(spec(BIG_GPT), mesh))
    held = {id(t): t for t in named_tensors(workload.model).values()}  # a tied weight once
    share = sum(t.numel() * t.element_size() for t in held.values())
    with torch.device("meta"):
        sizes = [t.numel() * t.element_size() for t in named_tensors(build_model(spec(BIG_GPT))).values()]
    built_on = workload.built_on
    del workload
    if world.rank == 0:
        build_model(spec(WARM_GPT))
    old = _peak_while(lambda: build_model(spec(BIG_GPT)))[1] if world.rank == 0 else None
    return built_on, peak, share, max(sizes), sum(sizes), old


@pytest.mark.parametrize("layout", [(1, 1, 4), (1, 4, 1)], ids=["pp4", "tp4"])
def test_a_ranks_peak_host_memory_while_building_is_its_share_plus_one_tensor(layout) -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as exc:
        pytest.skip(f"the peak resident size cannot be reset here ({exc})")
    per_rank = run_ranks(4, _build_peaks, layout, timeout=300)
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    for rank, (built_on, peak, share, largest, whole, old) in enumerate(per_rank):
        print(f"rank {rank}: peak {mib(peak)}, share {mib(share)}, largest tensor {mib(largest)}, model {mib(whole)}"
              + (f", old whole build's peak {mib(old)}" if old is not None else ""))
        assert built_on == "meta"
        assert whole > 3.5 * share  # the model is about 4 shares
        assert peak <= share + largest + MARGIN, f"rank {rank}"
    old = per_rank[0][-1]
    assert old >= 0.9 * per_rank[0][4] > per_rank[0][2] + per_rank[0][3] + MARGIN  # what the old build needed


USER_MODULE = '''
import torch
import torch.nn.functional as F
from torch import nn

from jobs.models.materialize import run_init


class Net(nn.Sequential):
    def __init__(self, defer):
        super().__init__(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        if defer == "weights only":  # the biases keep their construction's values: not replayable
            run_init((layer, lambda m: m.weight.normal_()) for layer in self if isinstance(layer, nn.Linear))
        elif defer == "reaching into a child":  # the last init writes a tensor of another module
            linears = [(layer, nn.Linear.reset_parameters) for layer in self if isinstance(layer, nn.Linear)]
            run_init([*linears, (self, lambda m: m[0].weight.mul_(2))])

    def loss(self, output, targets):
        return F.cross_entropy(output, targets)


def build(defer="nothing"):
    return Net(defer)
'''

_MODULE_NUMBERS = itertools.count()


@pytest.fixture
def user_entry(tmp_path, monkeypatch):
    name = f"materialize_user_{next(_MODULE_NUMBERS)}"  # a new module each time: imports are cached by name
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{name}:build"


def _user_spec(entry: str, defer: str):
    return spec_from_dict({"job": {"seed": 3}, "model": {"entry": entry, "args": {"defer": defer}},
                           "data": {"name": "digits"}})


def test_a_model_that_does_not_defer_its_init_is_built_whole_on_the_host(user_entry) -> None:
    from jobs.models.materialize import build_on_meta

    model, replay = build_on_meta(_user_spec(user_entry, "nothing"))
    assert replay is None and not any(p.is_meta for p in model.parameters())


@pytest.mark.parametrize(("defer", "message"), [
    ("weights only", r"^0\.bias: no deferred init set all of it"),
    ("reaching into a child", r"^the init of Net uses a tensor it did not hold"),
])
def test_what_the_record_cannot_reproduce_is_refused_for_the_host_build(user_entry, defer, message) -> None:
    from jobs.models.materialize import NotReplayable, build_on_meta

    model, replay = build_on_meta(_user_spec(user_entry, defer))
    with pytest.raises(NotReplayable, match=message):
        replay.materialize(model, torch.device("cpu"))


def test_a_meta_built_transformers_model_still_has_its_forward_checked() -> None:
    from hpc.errors import ConfigError
    from jobs.models.hf import causal_lm
    from jobs.models.materialize import _recorded

    args = {**TINY_LLAMA, "model_type": "granite", "embedding_multiplier": 2.0}
    with pytest.raises(ConfigError, match="GraniteForCausalLM's forward is not embed_tokens"):
        with _recorded(), torch.device("meta"):
            causal_lm(**args)
    with torch.device("meta"):  # the launcher's layout check builds on meta unrecorded: no check, as before
        causal_lm(**args)


def _fallback(world, directory: str, entry: str):
    import os

    from jobs.models.materialize import named_tensors
    from jobs.models.protocol import build_model
    from jobs.train.workloads import Workload

    os.chdir(directory)  # where the entry's module is, as for a job
    spec = _user_spec(entry, "weights only")
    workload = Workload(spec, build_mesh(MeshShape(1, 1, 1), world.rank))
    share, whole = named_tensors(workload.model), named_tensors(build_model(spec))
    return workload.built_on, share.keys() == whole.keys() and all(torch.equal(share[k], whole[k]) for k in whole)


def test_a_workload_whose_replay_is_refused_builds_on_the_host_with_the_same_values(user_entry, tmp_path) -> None:
    ((built_on, equal),) = run_ranks(1, _fallback, str(tmp_path), user_entry, timeout=120)
    assert built_on.startswith("host: 0.bias: no deferred init set all of it") and equal
