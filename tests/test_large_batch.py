"""LARS and LAMB against the papers' update rules, and under tensor parallelism through the real trainer.

The references below are written from You et al. 2017 (LARS, Algorithm 1) and You et al.
2019 (LAMB, Algorithm 2) in plain Python loops over floats, sharing nothing with
``parallel/large_batch.py``. Under tp=2 each layer's trust ratio needs the whole layer's
norms: were the shards' norms used, the ratios of split layers would be off by about
sqrt(2) and the run would leave the single-process one at the first step.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from hpc.config import spec_from_dict, spec_to_dict
from hpc.runtime.mesh import MeshShape, build_mesh
from tests.conftest import BOTH_BACKENDS
from tests.ranks import run_ranks
from tests.test_3d import _initial_weights, _metrics, assemble, gpt_spec, pieces_as_numpy

STEPS = 20
SHAPES = [(3, 4), (4,), (5,)]  # the last starts at zero: the trust ratio is 1 by convention
LARS_OPTIONS = {"lr": 1.0, "momentum": 0.9, "weight_decay": 0.01, "eta": 0.02}
LAMB_OPTIONS = {"lr": 0.05, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.01}


def _problem():
    """Per layer: initial weights, targets and curvatures of the loss sum_i c_i (w_i - t_i)^2 / 2, as float lists."""
    rng = np.random.default_rng(0)
    layers = []
    for number, shape in enumerate(SHAPES):
        n = math.prod(shape)
        w = [0.0] * n if number == 2 else rng.normal(size=n).tolist()
        layers.append((w, rng.normal(size=n).tolist(), rng.uniform(0.5, 3.0, size=n).tolist()))
    return layers


def _grad(w, t, c):
    return [ci * (wi - ti) for wi, ti, ci in zip(w, t, c, strict=True)]


def _norm(xs):
    return math.sqrt(sum(x * x for x in xs))


def reference_lars(layers, lr, momentum, weight_decay, eta):
    result = []
    for w, t, c in layers:
        w, v = list(w), [0.0] * len(w)
        for _ in range(STEPS):
            g = _grad(w, t, c)
            w_norm, g_norm = _norm(w), _norm(g)
            local_lr = eta * w_norm / (g_norm + weight_decay * w_norm) if w_norm > 0 and g_norm > 0 else 1.0
            v = [momentum * vi + lr * local_lr * (gi + weight_decay * wi) for vi, gi, wi in zip(v, g, w, strict=True)]
            w = [wi - vi for wi, vi in zip(w, v, strict=True)]
        result.append(w)
    return result


def reference_lamb(layers, lr, betas, eps, weight_decay):
    beta1, beta2 = betas
    result = []
    for w, t, c in layers:
        w, m, v = list(w), [0.0] * len(w), [0.0] * len(w)
        for step in range(1, STEPS + 1):
            g = _grad(w, t, c)
            m = [beta1 * mi + (1 - beta1) * gi for mi, gi in zip(m, g, strict=True)]
            v = [beta2 * vi + (1 - beta2) * gi * gi for vi, gi in zip(v, g, strict=True)]
            r = [(mi / (1 - beta1**step)) / (math.sqrt(vi / (1 - beta2**step)) + eps) + weight_decay * wi
                 for mi, vi, wi in zip(m, v, w, strict=True)]
            w_norm, r_norm = _norm(w), _norm(r)
            trust = w_norm / r_norm if w_norm > 0 and r_norm > 0 else 1.0
            w = [wi - lr * trust * ri for wi, ri in zip(w, r, strict=True)]
        result.append(w)
    return result


def _run_torch(optimizer_class, options, dtype):
    import torch

    layers = _problem()
    params = [torch.nn.Parameter(torch.tensor(w, dtype=dtype).reshape(shape))
              for (w, _, _), shape in zip(layers, SHAPES, strict=True)]
    targets = [(torch.tensor(t, dtype=dtype).reshape(s), torch.tensor(c, dtype=dtype).reshape(s))
               for (_, t, c), s in zip(layers, SHAPES, strict=True)]
    optimizer = optimizer_class(params, **options)
    for _ in range(STEPS):
        optimizer.zero_grad()
        sum((c * (p - t) ** 2 / 2).sum() for p, (t, c) in zip(params, targets, strict=True)).backward()
        optimizer.step()
    return [p.detach().reshape(-1).double().numpy() for p in params], optimizer


@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_each_matches_the_papers_update_rule_over_20_steps(name) -> None:
    import torch

    from parallel.large_batch import LAMB, LARS

    cls, options, reference = {"lars": (LARS, LARS_OPTIONS, reference_lars),
                               "lamb": (LAMB, LAMB_OPTIONS, reference_lamb)}[name]
    expected = reference(_problem(), **options)
    for dtype, atol in ((torch.float64, 1e-6), (torch.float32, 1e-5)):
        got, optimizer = _run_torch(cls, options, dtype)
        for number, (g, e) in enumerate(zip(got, expected, strict=True)):
            np.testing.assert_allclose(g, e, rtol=0, atol=atol, err_msg=f"{name} {dtype} layer {number}")
    initial = [w for w, _, _ in _problem()]
    assert all(_norm([a - b for a, b in zip(e, w, strict=True)]) > 0.05 for e, w in zip(expected, initial,
                                                                                          strict=True))
    if name == "lamb":  # the trust ratio matters: plain Adam with the same moments ends elsewhere
        adam, _ = _run_torch(torch.optim.Adam, {"lr": 0.05, "eps": 1e-6}, torch.float64)
        assert max(np.abs(a - e).max() for a, e in zip(adam, expected, strict=True)) > 1e-2
    state = optimizer.state_dict()["state"][0]
    assert all(isinstance(v, torch.Tensor) for v in state.values())


def _sharded_steps(world, cases):
    """Each (name, zero) case on (dp=2, tp=2): layer 0 split by columns and layer 1 by halves over TP, layer 2
    replicated; DP rank d sees curvatures scaled by 0.5 + d (the mean over DP is the problem's); 20 float64 steps
    through the ZeRO optimizer. Returns per case this rank's TP coordinate and its final local layers."""
    import torch

    from parallel.large_batch import LAMB, LARS
    from parallel.optimizer import distributed_optimizer
    from parallel.transport import TorchTransport

    mesh = build_mesh(MeshShape(2, 2, 1), world.rank)
    tp, scale = mesh.index("tp"), 0.5 + mesh.index("dp")
    cuts = [lambda x: x.reshape(3, 4)[:, 2 * tp:2 * tp + 2], lambda x: x[2 * tp:2 * tp + 2], lambda x: x]

    class Quadratic(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            local = [[cut(torch.tensor(values, dtype=torch.float64)).clone() for values in layer]
                     for cut, layer in zip(cuts, _problem(), strict=True)]
            self.layers = torch.nn.ParameterList([torch.nn.Parameter(w) for w, _, _ in local])
            self.targets = [(t, c * scale) for _, t, c in local]

        def forward(self) -> torch.Tensor:
            return sum((c * (w - t) ** 2 / 2).sum() for w, (t, c) in zip(self.layers, self.targets, strict=True))

    results = []
    for name, zero in cases:
        model = Quadratic()
        cls, options = {"lars": (LARS, LARS_OPTIONS), "lamb": (LAMB, LAMB_OPTIONS)}[name]
        inner = cls(model.parameters(), **options, group=mesh.group("tp"), split=list(model.layers)[:2])
        optimizer = distributed_optimizer(inner, TorchTransport(mesh.group("dp")), zero=zero, module=model,
                                          bucket_bytes=64)
        for _ in range(STEPS):
            optimizer.zero_grad()
            model().backward()
            optimizer.step()
        optimizer.unshard()
        optimizer.close()
        results.append((tp, [w.detach().numpy().copy() for w in model.layers]))
    return results


@BOTH_BACKENDS
def test_sharded_by_zero_and_tp_each_matches_the_papers_update_rule_over_20_steps(backend) -> None:
    """LAMB and LARS at zero 2 and 3 over dp=2, with layers split over tp=2: the references' weights within 1e-6.
    Under NCCL's rules too: their norms add collectives of their own to each step."""
    cases = [("lamb", 2), ("lars", 2), ("lamb", 3), ("lars", 3)]
    per_rank = run_ranks(4, _sharded_steps, cases, timeout=120, backend=backend)
    for number, (name, zero) in enumerate(cases):
        options = {"lars": LARS_OPTIONS, "lamb": LAMB_OPTIONS}[name]
        expected = (reference_lars if name == "lars" else reference_lamb)(_problem(), **options)
        for tp, layers in (r[number] for r in per_rank):
            got = [layers[0].reshape(-1), layers[1], layers[2]]
            want = [np.asarray(expected[0]).reshape(3, 4)[:, 2 * tp:2 * tp + 2].reshape(-1),
                    np.asarray(expected[1])[2 * tp:2 * tp + 2], np.asarray(expected[2])]
            for layer, (g, e) in enumerate(zip(got, want, strict=True)):
                np.testing.assert_allclose(g, e, rtol=0, atol=1e-6, err_msg=f"{name} zero={zero} tp={tp} {layer}")


GPT_OPTIONS = {
    "lamb": {"optimizer": "lamb", "lr": 3e-2, "weight_decay": 0.01},
    "lars": {"optimizer": "lars", "lr": 2.0, "momentum": 0.9, "trust_coefficient": 0.02, "weight_decay": 0.001},
}


def _spec(run_dir: str, name: str, layout, resume: str = "never"):
    raw = spec_to_dict(gpt_spec(run_dir, name, layout, **GPT_OPTIONS[name.split("-")[0]]))
    raw["checkpoint"] = {"every_steps": 5, "resume": resume, "keep": 3}
    raw["parallel"]["zero"] = int(name.rsplit("-zero", 1)[1]) if "-zero" in name else 0
    return spec_from_dict(raw)


def _train(world, run_dir: str, names, layout, resume: str = "never"):
    from jobs.train.loop import train

    results = []
    for name in names:
        mesh = build_mesh(MeshShape(*layout), world.rank)
        _, model = train(_spec(run_dir, name, layout, resume.format(name=name)), world, mesh)
        results.append(pieces_as_numpy(model, mesh))
    return results


def test_under_tp2_the_trainer_equals_one_process_and_a_tp2_checkpoint_resumes_on_one(tmp_path) -> None:
    names = ["lamb", "lars"]
    single = run_ranks(1, _train, str(tmp_path / "one"), names, (1, 1, 1), timeout=240)[0]
    split = run_ranks(2, _train, str(tmp_path / "tp2"), names, (1, 2, 1), timeout=240)
    initial = _initial_weights()
    for number, name in enumerate(names):
        losses, norms = _metrics(tmp_path / "one", name)
        assert losses[-1] < losses[0] - 0.3, (name, losses)  # it learns
        tp_losses, tp_norms = _metrics(tmp_path / "tp2", name)
        assert tp_losses == pytest.approx(losses, rel=1e-5) and tp_norms == pytest.approx(norms, rel=1e-5), name
        expected, got = assemble([single[number]]), assemble([r[number] for r in split])
        for key, value in expected.items():
            np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-5, err_msg=f"{name}: {key}")
            assert not np.array_equal(value, initial[key]), f"{name}: {key} did not train"
    # with ZeRO over dp=2 as well (lamb at stage 1, lars at stage 2): TP peers own the same layers, so their
    # norm all-reduces pair up
    stages = {"lamb": "lamb-zero1", "lars": "lars-zero2"}
    sharded = run_ranks(4, _train, str(tmp_path / "zero"), list(stages.values()), (2, 2, 1), timeout=240)
    for number, name in enumerate(names):
        losses, _ = _metrics(tmp_path / "one", name)
        assert _metrics(tmp_path / "zero", stages[name])[0] == pytest.approx(losses, rel=1e-5), name
        got = assemble([r[number] for r in sharded])
        for key, value in assemble([single[number]]).items():
            np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-5, err_msg=f"{stages[name]}: {key}")
    step5 = str(tmp_path / "tp2" / "{name}" / "checkpoints" / "step-00000005")
    resumed = run_ranks(1, _train, str(tmp_path / "resumed"), names, (1, 1, 1), step5, timeout=120)[0]
    for number, name in enumerate(names):  # the tp=2 state, placed like the parameters, continues on one process
        records = [json.loads(line) for line in (tmp_path / "resumed" / name / "metrics.jsonl").open()]
        assert [r["step"] for r in records] == list(range(6, 11)), name
        assert [r["loss"] for r in records] == pytest.approx(_metrics(tmp_path / "one", name)[0][5:], rel=1e-5), name
        for key, value in assemble([single[number]]).items():
            np.testing.assert_allclose(assemble([resumed[number]])[key], value, rtol=1e-5, atol=1e-5,
                                       err_msg=f"{name} resumed: {key}")
