"""The packed weight-transfer format over a real two-rank gloo group (two threads, one process): what the
receiving side hands to its consumer stays right for as long as the consumer keeps it.

vLLM's layerwise reload (the engines' `load_weights` during a weight update) keeps each tensor until every weight
of its layer has arrived, possibly chunks later. Receiving into two reused buffers overwrote those tensors with
later chunks, and an engine served weights that were neither version (found 2026-11-26: SmolLM2-135M after a
transfer push served log-probs up to 12 nats away from the trainer's policy, every push whose chunks split a
layer; the tiny test models fit in one chunk)."""
import threading

import torch

from rollout_client.launcher import free_port
from rollout_client.transfer import gloo_group, metas_of, receive, send


def pair(tensors, buffer_bytes, consume, buffers):
    """Rank 0 sends `tensors`, rank 1 receives them (consume, buffers as given); returns the bytes received."""
    port, out, errors = free_port(), {}, []

    def rank(r):
        try:
            pg, store = gloo_group("127.0.0.1", port, r, 2, timeout_s=30)
            if r == 0:
                out["sent"] = send(pg, [t for _, t in tensors], 0, buffer_bytes, [])
            else:
                out["got"] = receive(pg, metas_of(tensors), 0, buffer_bytes, consume, buffers)
            out[f"keep{r}"] = (pg, store)
        except BaseException as e:          # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert out["sent"] == out["got"]
    return out["got"]


def layer_like_tensors(n=14, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(f"layers.{i // 2}.w{i % 2}", torch.randn(int(torch.randint(50, 400, (1,), generator=g)), generator=g))
            for i in range(n)]


def test_views_kept_past_their_chunk_stay_intact():
    """A consumer that keeps every view (as the layerwise reload does) reads the sent values after the last chunk:
    chunks of about three tensors, so a layer's two tensors are often split across chunks."""
    tensors = layer_like_tensors()
    kept = []
    got = pair(tensors, 3000, kept.extend, None)
    assert got == sum(t.numel() * 4 for _, t in tensors) and len(kept) == len(tensors)
    for (name, sent), (kname, view) in zip(tensors, kept):
        assert kname == name and torch.equal(view, sent), name


def test_reused_buffers_serve_a_consumer_that_copies():
    """The trainer side's mode (buffers kept between pushes): right while each view is used within its call."""
    tensors = layer_like_tensors(seed=1)
    pool, copies = [], []
    for _ in range(2):                                     # twice: the second push reuses the first's buffers
        copies.clear()
        pair(tensors, 3000, lambda items: copies.extend((n, t.clone()) for n, t in items), pool)
        assert all(torch.equal(c, t) for (_, c), (_, t) in zip(copies, tensors))
    assert len(pool) == 2
