"""Models that keep state on their modules during ``forward`` (a rotary table cached as a plain
attribute on the first call, a list appended to) capture, with and without sequence
parallelism, and what they keep never holds a tensor of the trace (NOTE [Module state across a
trace] in zerofx/compiler/capture.py). Their parity in gloo is a case of
tests/test_sp_recognition.py's launch."""

from __future__ import annotations

import pytest
import torch

import zerofx
from tests.support import sp_recognition_workers as workers
from zerofx.common.errors import CaptureError


def _compile(net: torch.nn.Module, size: int) -> zerofx.Program:
    ids, labels = workers.batches(1)
    section = {"plan_cache": False, **({"sequence_parallel": {"size": size}} if size > 1 else {})}
    program = zerofx.compile(net, world_size=2, stage=3, config={"zerofx": section}, example_inputs=(ids[0],),
                             example_kwargs={"labels": labels[0]})
    program.graph_modules(rank=0)
    return program


@pytest.mark.parametrize("size", [1, 2])
def test_a_cache_built_while_tracing_is_not_kept(size: int) -> None:
    """A model never called before: after the capture its cache is unset and its list empty, as
    the user left them, and its own call afterwards runs and matches a fresh copy's."""
    net = workers.model("cached_rotary")
    _compile(net, size)
    assert net.cos_cached is None and not hasattr(net, "sin_cached") and net.lengths == []
    ids, labels = workers.batches(1)
    assert torch.equal(net(ids[0], labels[0]), workers.model("cached_rotary")(ids[0], labels[0]))


def test_a_cache_the_user_built_is_kept_as_it_was() -> None:
    """Called once before: the same tensor objects and the same list after the capture, nothing added."""
    net = workers.model("cached_rotary")
    ids, labels = workers.batches(1)
    net(ids[0], labels[0])
    cos, lengths = net.cos_cached, net.lengths
    _compile(net, 2)
    assert net.cos_cached is cos and net.lengths is lengths and lengths == [workers.SEQ]
    assert not isinstance(cos, torch._subclasses.FakeTensor)


class FailingLM(workers.CachedRotaryLM):
    """Fails after its cache is built: the capture raises, and the cache is still not kept."""

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.rotary(ids.shape[1])
        raise RuntimeError("a failure after the cache")


def test_a_capture_that_fails_keeps_nothing() -> None:
    net = FailingLM()
    with pytest.raises(CaptureError, match="a failure after the cache"):
        _compile(net, 1)
    assert net.cos_cached is None and net.lengths == []
