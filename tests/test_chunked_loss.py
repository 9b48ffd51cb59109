"""Chunked linear + cross-entropy == the plain logits path: loss, gradients, compile and memory;
and in torchtitan's own Llama3 of the installed generation, every parameter's gradient."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from harness import rel_err
from torch.profiler import ProfilerActivity, profile

from upipe_dtensor.memory.chunked_loss import chunked_cross_entropy_sum
from upipe_dtensor.models.generation import family_module, generation_module

pytestmark = pytest.mark.unit

FP32_TOL = 1e-5
IGNORE = -100


def plain_loss(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The trainer's loss: full logits, float32 cross-entropy, summed over kept tokens."""
    logits = (h @ weight.t()).float()
    return F.cross_entropy(
        logits.flatten(0, -2), labels.flatten(), ignore_index=IGNORE, reduction="sum"
    )


def make_inputs(
    shape: tuple[int, ...], dim: int, vocab: int, dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h (shape, dim), weight (vocab, dim) at a scale that gives peaked softmaxes, int64 labels."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, dim, generator=gen).to(dtype)
    weight = (torch.randn(vocab, dim, generator=gen) * dim**-0.5 * 3).to(dtype)
    labels = torch.randint(0, vocab, shape, generator=gen)
    return h, weight, labels


def loss_and_grads(
    fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, dh, dweight) of ``fn(h, weight, labels) * scale`` on fresh leaves."""
    h = h.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    loss = fn(h, weight, labels)
    (loss * scale).backward()
    return loss.detach(), h.grad, weight.grad


def chunked(
    chunk_tokens: int,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    return lambda h, w, y: chunked_cross_entropy_sum(h, w, y, chunk_tokens=chunk_tokens)


def ignore_some(labels: torch.Tensor, every: int = 5) -> torch.Tensor:
    labels = labels.clone()
    labels.view(-1)[::every] = IGNORE
    return labels


# (leading shape, dim, vocab, chunk_tokens, label edit)
CASES = {
    "ragged_last_chunk": ((37,), 16, 50, 8, None),
    "single_chunk_larger": ((20,), 16, 50, 64, None),
    "single_chunk_exact": ((24,), 16, 50, 24, None),
    "one_token_chunks": ((9,), 8, 30, 1, "some"),
    "batch": ((3, 24), 16, 50, 10, None),
    "batch_some_ignored": ((2, 33), 32, 70, 7, "some"),
    "chunk_all_ignored": ((2, 20), 16, 50, 8, "chunk"),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_float32_matches_plain(case) -> None:
    shape, dim, vocab, chunk_tokens, edit = case
    h, weight, labels = make_inputs(shape, dim, vocab)
    if edit == "some":
        labels = ignore_some(labels)
    elif edit == "chunk":  # tokens 8..15 (the second chunk) and a few more
        labels.view(-1)[8:16] = IGNORE
        labels.view(-1)[30] = IGNORE
    expected = loss_and_grads(plain_loss, h, weight, labels)
    actual = loss_and_grads(chunked(chunk_tokens), h, weight, labels)
    assert actual[0].dtype == torch.float32 and actual[0].shape == ()
    for name, a, e in zip(("loss", "grad_h", "grad_weight"), actual, expected):
        assert a.shape == e.shape and a.dtype == e.dtype, name
        assert rel_err(a, e) < FP32_TOL, (name, rel_err(a, e))
    if edit == "chunk":  # ignored tokens get exactly zero gradient
        assert torch.all(actual[1].reshape(-1, dim)[8:16] == 0)


def test_all_ignored_gives_zero_loss_and_grads() -> None:
    h, weight, labels = make_inputs((2, 10), 16, 50)
    labels.fill_(IGNORE)
    loss, grad_h, grad_weight = loss_and_grads(chunked(4), h, weight, labels)
    assert loss.item() == 0.0
    assert torch.all(grad_h == 0) and torch.all(grad_weight == 0)


def norm_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||: sensitive to small errors spread over many entries."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("chunk_tokens", [1, 16, 100, 4096])
def test_bfloat16_within_plain_bf16_error(chunk_tokens: int) -> None:
    """Against a float32 reference, the chunked bf16 path errs no more than 2x the plain bf16 path.

    Its grad_weight adds one bf16 product per chunk into a float32 accumulator; with 2048 one-token
    chunks, a bf16 accumulator would fail this."""
    h, weight, labels = make_inputs((2, 1024), 64, 256, dtype=torch.bfloat16)
    labels = ignore_some(labels, every=7)
    reference = loss_and_grads(plain_loss, h.float(), weight.float(), labels)
    plain = loss_and_grads(plain_loss, h, weight, labels)
    actual = loss_and_grads(chunked(chunk_tokens), h, weight, labels)
    assert actual[1].dtype == actual[2].dtype == torch.bfloat16
    for name, a, p, r in zip(("loss", "grad_h", "grad_weight"), actual, plain, reference):
        for metric in (rel_err, norm_err):
            error, plain_error = metric(a, r), metric(p, r)
            assert error <= 2 * plain_error + 1e-4, (name, metric.__name__, error, plain_error)


def test_incoming_gradient_scales_the_gradients() -> None:
    """Gradients are computed in the forward; the backward must still apply d(out)/d(loss)."""
    h, weight, labels = make_inputs((2, 19), 16, 40)
    labels = ignore_some(labels)
    unit = loss_and_grads(chunked(6), h, weight, labels)
    scaled = loss_and_grads(chunked(6), h, weight, labels, scale=3.7)
    plain_scaled = loss_and_grads(plain_loss, h, weight, labels, scale=3.7)
    for u, s, p in zip(unit[1:], scaled[1:], plain_scaled[1:]):
        assert rel_err(s, 3.7 * u) < 1e-6
        assert rel_err(s, p) < FP32_TOL


def test_accumulates_across_calls() -> None:
    """Two micro-batches' losses summed (the trainer's pattern) accumulate gradients like plain."""
    h, weight, labels = make_inputs((2, 16), 16, 40)

    def two_halves(fn):
        def loss(h, w, y):
            return fn(h[:1], w, y[:1]) * 0.5 + fn(h[1:], w, y[1:]) * 2.0

        return loss

    expected = loss_and_grads(two_halves(plain_loss), h, weight, labels)
    actual = loss_and_grads(two_halves(chunked(5)), h, weight, labels)
    for a, e in zip(actual, expected):
        assert rel_err(a, e) < FP32_TOL


def test_llama_every_parameter_gradient_matches() -> None:
    """torchtitan's Llama3 (D 64, 4 heads, 2 layers, vocabulary 128): its logits' loss against
    the chunked loss of its output layer's input and weight (the layer's name differs between
    the generations: ``generation_module().OUTPUT_WEIGHT``)."""
    torch.manual_seed(0)
    model = family_module("llama3").torchtitan_model(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=128, seq_len=32
    )
    output = model.get_submodule(generation_module().OUTPUT_WEIGHT.removesuffix(".weight"))
    tokens = torch.randint(0, 128, (2, 32))
    labels = ignore_some(torch.randint(0, 128, (2, 32)), every=6)

    def grads(loss: torch.Tensor) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = F.cross_entropy(
        model(tokens).flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum"
    )
    plain_grads = grads(plain)

    hidden = []  # the final norm's output, as the output layer receives it
    hook = output.register_forward_hook(lambda module, args, out: hidden.append(args[0]))
    model(tokens)  # its logits are left unused: only the chunked loss is differentiated
    hook.remove()
    loss = chunked_cross_entropy_sum(hidden[0], output.weight, labels, chunk_tokens=13)
    chunked_grads = grads(loss)

    assert rel_err(loss.detach(), plain.detach()) < FP32_TOL
    assert chunked_grads.keys() == plain_grads.keys() and len(plain_grads) > 10
    for name, expected in plain_grads.items():
        assert expected.abs().max() > 0, name
        error = rel_err(chunked_grads[name], expected)
        assert error < FP32_TOL, (name, error)


def test_compile_fullgraph_matches_eager() -> None:
    h, weight, labels = make_inputs((2, 23), 16, 50)
    labels = ignore_some(labels)

    def fn(h, w, y):
        return chunked_cross_entropy_sum(torch.tanh(h), w, y, chunk_tokens=7) / 11.0

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    expected = loss_and_grads(fn, h, weight, labels)
    actual = loss_and_grads(compiled, h, weight, labels)
    for a, e in zip(actual, expected):
        assert rel_err(a, e) < 1e-6

    # The loss is one opaque node: no full (tokens, vocab) matmul appears in the traced graph.
    graphs = []

    def record(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, fullgraph=True, backend=record)(h, weight, labels)
    targets = [node.target for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert torch.ops.upipe.chunked_ce_fwd.default in targets
    assert not any("matmul" in str(t) or "linear" in str(t) for t in targets), targets
    torch._dynamo.reset()


def test_opcheck_fake_schema_and_autograd() -> None:
    """torch.library's own checks of the op: fake shapes/strides (also for a non-contiguous h),
    schema, autograd registration and AOT dispatch."""
    h, weight, labels = make_inputs((3, 10), 8, 20)
    op = torch.ops.upipe.chunked_ce_fwd.default
    transposed = h.transpose(0, 1).requires_grad_()
    for args in (
        (h.requires_grad_(), weight.requires_grad_(), labels, 4, IGNORE),
        (transposed, weight, labels.t().contiguous(), 3, IGNORE),
        (h.detach().bfloat16(), weight.detach().bfloat16(), ignore_some(labels), 7, IGNORE),
    ):
        torch.library.opcheck(op, args)


def peak_allocated_bytes(fn) -> int:
    """Peak of CPU bytes allocated (net of frees) while ``fn`` runs, from the profiler's
    allocator events: every allocation and free made by the run, in order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    )
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def test_memory_peak_below_plain_logits() -> None:
    """tokens 4096 x vocab 2048: the plain path's float32 logits alone are 32 MiB and it holds
    several such; the chunked path (256-token chunks, 2 MiB of logits) must stay far below."""
    h, weight, labels = make_inputs((4096,), 64, 2048)
    h.requires_grad_()
    weight.requires_grad_()
    logits_bytes = 4096 * 2048 * 4

    def run(fn):
        def step():
            fn(h, weight, labels).backward()
            h.grad = weight.grad = None

        return step

    plain_peak = peak_allocated_bytes(run(plain_loss))
    chunked_peak = peak_allocated_bytes(run(chunked(256)))
    print(
        f"peak extra memory: plain {plain_peak / 2**20:.1f} MiB, chunked "
        f"{chunked_peak / 2**20:.1f} MiB"
    )
    assert plain_peak >= 2 * logits_bytes  # the measurement sees the plain path's logits
    assert chunked_peak < logits_bytes / 4  # less than a quarter of one full logits tensor
    assert chunked_peak * 8 < plain_peak


@pytest.mark.parametrize("chunk_tokens", [0, -3])
def test_rejects_non_positive_chunk(chunk_tokens: int) -> None:
    h, weight, labels = make_inputs((8,), 8, 16)
    with pytest.raises(ValueError, match=rf"chunk_tokens must be >= 1, got {chunk_tokens}"):
        chunked_cross_entropy_sum(h, weight, labels, chunk_tokens=chunk_tokens)


def test_rejects_mismatched_labels() -> None:
    h, weight, labels = make_inputs((2, 8), 8, 16)
    with pytest.raises(ValueError, match="labels shape"):
        chunked_cross_entropy_sum(h, weight, labels.flatten(), chunk_tokens=4)
