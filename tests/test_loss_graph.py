"""Graph losses (``GraphLoss``): a traced loss computes what the built-in one computes, value
and gradient; its metrics reduce as named; and every graph that reaches past the allowed
operations, or would allocate past its bound, is refused typed before it runs."""

from __future__ import annotations

import dataclasses
import math
import pickle

import pytest
import torch

import plexrl_dask as plexrl
from plexrl_dask.errors import InvalidLoss, MismatchedLengths
from plexrl_dask.shared.checks import checked_loss
from plexrl_dask.shared.loss_graph import GraphLoss, LossNode
from plexrl_dask.shared.types import Datum, PolicyGradient
from plexrl_dask.worker import loss_graph
from plexrl_dask.worker.losses import compute_loss
from plexrl_dask.worker.ops import combine


def clipped(logprobs, old, advantages):
    ratio = torch.exp(logprobs - old)
    low, high = ratio * advantages, ratio.clamp(0.8, 1.2) * advantages
    loss = -torch.minimum(low, high).sum()
    outside = ((ratio > 1.2) | (ratio < 0.8)).float().mean()
    return loss, {"custom/outside:mean": outside, "custom/tokens:sum": logprobs.sum() * 0 + 1}


PPO = plexrl.trace_loss(clipped, {"logprobs": 1, "old": 1, "advantages": 1})


def batch_of(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        old = [0.0] + (-3 * torch.rand(n - 1, generator=gen)).tolist()
        adv = [0.0] + torch.randn(n - 1, generator=gen).tolist()
        inputs = {"old": old, "advantages": adv}
        out.append(Datum(tokens=range(n), old_logprobs=old, advantages=adv, inputs=inputs))
    return tuple(out)


def logp_of(batch, seed=1):
    width = max(len(d.tokens) for d in batch) - 1
    gen = torch.Generator().manual_seed(seed)
    logp = (-3 * torch.rand(len(batch), width, generator=gen)).requires_grad_(True)
    valid = torch.zeros(len(batch), width)
    for i, d in enumerate(batch):
        valid[i, : len(d.tokens) - 1] = 1.0
    return logp, valid


def test_a_traced_ppo_loss_is_the_built_in_one_in_value_and_gradient():
    batch = batch_of((5, 9, 3))
    logp, valid = logp_of(batch)
    value, metrics = compute_loss(PPO, batch, logp, valid)
    (grad,) = torch.autograd.grad(value, logp)
    want, _ = compute_loss(PolicyGradient(normalizer=1.0), batch, logp, valid)
    (want_grad,) = torch.autograd.grad(want, logp)
    assert float(value.detach()) == pytest.approx(float(want.detach()), rel=1e-6)
    assert torch.equal(grad, want_grad)
    # metrics: ":sum" summed over the data, ":mean" averaged over them
    assert metrics["custom/tokens:sum"] == 3.0
    per_datum = []
    for i, d in enumerate(batch):
        r = torch.exp(logp[i, : len(d.tokens) - 1].detach() - torch.tensor(d.old_logprobs[1:]))
        per_datum.append(float(((r > 1.2) | (r < 0.8)).float().mean()))
    assert metrics["custom/outside:mean"] == pytest.approx(sum(per_datum) / 3)
    # a normalizer divides the summed loss
    halved, _ = compute_loss(dataclasses.replace(PPO, normalizer=2.0), batch, logp, valid)
    assert float(halved) == pytest.approx(float(value) / 2)


def test_ranks_combine_a_graph_losss_metrics_as_their_names_say():
    batch = batch_of((5, 9, 3, 4))
    logp, valid = logp_of(batch)
    _, whole = compute_loss(PPO, batch, logp, valid)
    parts = [compute_loss(PPO, batch[i : i + 2], logp[i : i + 2], valid[i : i + 2])[1]
             for i in (0, 2)]  # fmt: skip
    merged = combine("forward_backward", *parts)
    for key in ("loss", "custom/tokens:sum", "custom/outside:mean", "num_tokens"):
        assert merged[key] == pytest.approx(whole[key], rel=1e-6), key


def test_scalar_inputs_and_the_sdks_idioms_run():
    def scaled(logprobs, weights, beta):
        w = torch.where(weights > 0, weights, torch.zeros_like(weights))
        n = logprobs.shape[0]
        total = (
            -(logprobs[1:] * w[1:]).sum() * beta / n
            + torch.nn.functional.softplus(logprobs).sum().to(torch.float64).float() * 0.0
        )
        return total, {}

    loss = plexrl.trace_loss(scaled, {"logprobs": 1, "weights": 1, "beta": 0})
    d = Datum(tokens=range(6), inputs={"weights": [0, 0, 1, 1, 2, 1], "beta": 0.5})
    logp, valid = logp_of((d,))
    value, _ = compute_loss(loss, (d,), logp, valid)
    lp = logp[0].detach()
    want = -(lp[1:] * torch.tensor([1.0, 1, 2, 1])).sum() * 0.5 / 5
    assert float(value) == pytest.approx(float(want), rel=1e-6)


def node(op, name, target, *args, **kwargs):
    return LossNode(op, name, target, args, tuple(kwargs.items()))


def graph(*calls, inputs=(("logprobs", 1),), out="x"):
    places = [node("placeholder", n, n) for n, _ in inputs]
    output = node("output", "output", "output", {"tuple": [{"ref": out}, {"dict": {}}]})
    return GraphLoss("g", inputs, (*places, *calls, output))


LP = {"ref": "logprobs"}


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: graph(node("get_attr", "x", "weight")), "get_attr"),
        (lambda: graph(node("call_module", "x", "linear", LP)), "call_module"),
        (lambda: graph(node("call_function", "x", "builtins.open", "/etc/passwd")), "not allowed"),
        (lambda: graph(node("call_function", "x", "os.system", "true")), "not allowed"),
        (lambda: graph(node("call_function", "x", "torch.zeros", 10**9)), "not allowed"),
        (lambda: graph(node("call_method", "x", "repeat", LP, 10**6)), "not allowed"),
        (lambda: graph(node("call_function", "x", "torch.matmul", LP, LP)), "not allowed"),
        (lambda: graph(node("call_method", "x", "item", LP)), "not allowed"),
        (lambda: graph(node("call_function", "x", "getattr", LP, "grad_fn")), "getattr"),
        (lambda: graph(node("call_function", "x", "torch.exp", {"ref": "y"})), "earlier node"),
        (lambda: graph(node("call_function", "x", "torch.exp", {"code": "1"})), "encoding"),
        (lambda: graph(node("call_function", "x", "torch.exp", LP), out="logprobs2"), "earlier"),
        (lambda: graph(node("call_function", "x", "torch.exp", LP), inputs=(("logprobs", 2),)),
         "rank 1"),
        (lambda: graph(node("call_function", "x", "torch.exp", LP),
                       inputs=(("logprobs", 1), ("target_tokens", 1))), "target_tokens"),
        (lambda: graph(*[node("call_function", f"n{i}", "torch.exp", LP) for i in range(1100)]),
         "nodes"),
    ],
)  # fmt: skip
def test_a_graph_past_the_rules_is_refused_where_it_is_made(make, match):
    with pytest.raises(InvalidLoss, match=match):
        make()


def smuggled(loss: GraphLoss, **changes) -> GraphLoss:
    """``loss`` with ``changes`` made around its constructor, as a client with other code
    (or a pickle) could send it."""
    out = object.__new__(GraphLoss)
    for field in dataclasses.fields(GraphLoss):
        object.__setattr__(out, field.name, changes.get(field.name, getattr(loss, field.name)))
    return pickle.loads(pickle.dumps(out))


def test_the_worker_checks_again_what_was_made_around_the_rules():
    evil = node("call_function", "x", "builtins.eval", "__import__('os').system('true')")
    ok = graph(node("call_function", "x", "torch.exp", LP))
    bad = smuggled(ok, nodes=(*ok.nodes[:1], evil, ok.nodes[-1]))
    with pytest.raises(InvalidLoss, match="not allowed"):
        checked_loss(bad)  # (what ops.forward_backward runs first on the worker)
    with pytest.raises(InvalidLoss, match="not allowed"):
        loss_graph.build(bad)


def test_what_would_allocate_past_the_bound_is_refused_on_shapes_before_it_runs():
    def outer(logprobs):
        square = logprobs.unsqueeze(0) * logprobs.unsqueeze(1)  # [T, T]
        return square.sum(), {}

    loss = plexrl.trace_loss(outer, {"logprobs": 1})
    short = Datum(tokens=range(64))  # 63**2 elements: within the floor of the bound
    logp, valid = logp_of((short,))
    compute_loss(loss, (short,), logp, valid)
    tokens = 2048
    assert tokens**2 > loss_graph.element_budget(tokens)
    long = Datum(tokens=[1] * (tokens + 1))
    logp, valid = logp_of((long,))
    before = torch.ones(1)  # (nothing of [T, T] is allocated: the shapes pass refuses it)
    with pytest.raises(InvalidLoss, match="more than .* elements"):
        compute_loss(loss, (long,), logp, valid)
    assert before.sum() == 1


@pytest.mark.parametrize(
    "body, match",
    [
        (lambda lp: (lp.sum() * 0 + lp.shape[0] ** 100, {}), "2\\*\\*62"),
        (lambda lp: (lp.sum(), {"loss": lp.sum()}), "custom/"),
        (lambda lp: (lp, {}), "scalar"),
        (lambda lp: (lp.sum() + lp[:3], {}), "scalar"),
        (lambda lp: ((lp + lp[:2]).sum(), {}), "node"),
        (lambda lp: (lp.to(torch.int64).sum(), {}), "floating"),
    ],
)
def test_a_graph_that_fails_or_overflows_is_a_typed_error_naming_it(body, match):
    def fn(logprobs):
        return body(logprobs)

    with pytest.raises(InvalidLoss, match=match):
        loss = plexrl.trace_loss(fn, {"logprobs": 1})
        d = Datum(tokens=range(6))
        compute_loss(loss, (d,), *logp_of((d,)))


def test_a_list_times_a_length_is_refused_not_built():
    ok = graph(node("call_function", "x", "torch.exp", LP))
    calls = (
        node("call_function", "n", "getattr", LP, "shape"),
        node("call_function", "m", "operator.getitem", {"ref": "n"}, 0),
        node("call_function", "big", "operator.mul", [1, 2], {"ref": "m"}),
        node("call_function", "x", "torch.exp", LP),
    )
    loss = dataclasses.replace(ok, nodes=(ok.nodes[0], *calls, ok.nodes[-1]))
    d = Datum(tokens=range(6))
    with pytest.raises(InvalidLoss, match="mul of a list"):
        compute_loss(loss, (d,), *logp_of((d,)))


def test_datum_inputs_are_checked_and_what_a_loss_reads_must_be_there():
    with pytest.raises(MismatchedLengths):
        Datum(tokens=range(4), inputs={"old": [0.0, 1.0]})
    with pytest.raises(InvalidLoss, match="NaN"):
        Datum(tokens=range(3), inputs={"beta": math.nan})
    with pytest.raises(InvalidLoss):
        Datum(tokens=range(3), inputs={"beta": "x"})
    d = Datum(tokens=range(4), inputs={"old": [0, 1, 2, 3]})
    with pytest.raises(InvalidLoss, match="no input 'advantages'"):
        compute_loss(PPO, (d,), *logp_of((d,)))
    scalar = Datum(tokens=range(4), inputs={"old": 1.0, "advantages": [0, 1, 2, 3]})
    with pytest.raises(InvalidLoss, match="one value per token"):
        compute_loss(PPO, (scalar,), *logp_of((scalar,)))


@pytest.mark.parametrize(
    "fn, match",
    [
        # an index a tensor or list holds: unseen by the shapes-only pass, fatal on a GPU
        (lambda lp: (lp[torch.full_like(lp, 10**6, dtype=torch.int64)].sum(), {}), "an index"),
        (lambda lp: (lp[[0, 10**6]].sum(), {}), "an index"),
        # more than linear work (an SVD for p="nuc")
        (lambda lp: (torch.norm(lp.reshape(1, -1), p="nuc"), {}), "not allowed"),
        # in place, or into another tensor
        (lambda lp: (torch.exp(lp, out=torch.zeros_like(lp)).sum(), {}), "out"),
        (lambda lp: (torch.clamp(lp, min=-1.0, max=0.0, out=lp).sum(), {}), "out"),
        # a metric that is no real number (the first a complex number at this length)
        (lambda lp: (lp.sum(), {"custom/r:sum": (lp.shape[0] - 5) ** 0.5}), "real number"),
        (lambda lp: (lp.sum(), {"custom/s:sum": lp.shape}), "real number"),
        # a graph whose own backward fails: typed, before the model's backward starts
        (lambda lp: ((lp // 1.0).sum(), {}), "gradient"),
        (lambda lp: ((1.0 % lp).sum(), {}), "gradient"),
        # intermediates together past the datum's budget (each within it)
        (lambda lp: (sum((torch.cat([torch.cat([lp] * 64)] * 64) * k).sum() for k in range(1, 6)),
                     {}), "more than"),
    ],
)  # fmt: skip
def test_what_the_review_found_is_refused_typed(fn, match):
    def loss(logprobs):
        return fn(logprobs)

    d = Datum(tokens=range(4))
    with pytest.raises(InvalidLoss, match=match):
        compute_loss(plexrl.trace_loss(loss, {"logprobs": 1}), (d,), *logp_of((d,)))


def test_malformed_encodings_and_too_many_arguments_are_typed_errors():
    with pytest.raises(InvalidLoss, match="holds a string"):
        graph(node("call_function", "x", "torch.exp", {"ref": []}))
    with pytest.raises(InvalidLoss, match="getattr"):
        graph(node("call_function", "x", "getattr", LP, ["shape"]))
    with pytest.raises(InvalidLoss, match="holds a string"):
        graph(node("call_function", "x", "torch.exp", LP, dtype={"dtype": ["float32"]}))
    wide = [node("call_function", f"n{i}", "torch.stack", [LP] * 64) for i in range(140)]
    with pytest.raises(InvalidLoss, match="at most 8192"):
        graph(*wide, node("call_function", "x", "torch.exp", LP))


def test_a_loss_that_reads_no_log_probability_runs_with_no_gradient():
    loss = plexrl.trace_loss(lambda logprobs: (torch.zeros_like(logprobs).sum() + 2.0, {}),
                             {"logprobs": 1})  # fmt: skip
    batch = batch_of((4, 6))
    logp, valid = logp_of(batch)
    value, _ = compute_loss(loss, batch, logp, valid)
    value.backward()
    assert float(value.detach()) == 4.0 and torch.equal(logp.grad, torch.zeros_like(logp))
