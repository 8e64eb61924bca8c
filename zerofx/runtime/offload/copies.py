"""Host <-> device copies of the offloaded update on a CUDA side stream: ``HostCopies`` moves the
gradients (and fp32 parameters) of the records stepped on the host to pinned memory, and each
new parameter back, overlapped with the host's update (NOTE [Host copies on a side stream]).
Unused off CUDA.
"""

from __future__ import annotations

import torch


class HostCopies:
    """NOTE [Host copies on a side stream]
    On CUDA, the records stepped on the host need each gradient (and, in fp32 training where the
    record holds no master, the parameter) on the host, and send the new parameter back. These
    copies run on a side stream (``torch.cuda.Stream``, public API), not on the compute stream:
    - every device-to-host copy of the step is issued at once, in update order, into one pinned
      staging flat kept between steps (4 bytes per host-stepped element, 8 in fp32 without
      master), behind an event recorded on the compute stream when the step began; each copy
      records its own event, and the host waits for that one event only, right before it steps
      the record. So record k+1's gradient arrives while the CPU steps record k;
    - each new parameter goes back as soon as its record is stepped, on the same stream, so the
      copy runs while the CPU steps the next record. Its source stays valid: a record's own
      master until the next step (ordered behind this copy on the stream), an NVMe window buffer
      until its write-back, which waits for the copy's event first (``OffloadStore.release``),
      the staging flat until the next step's copies into it (same stream);
    - the gradients read on the side stream are ``record_stream``-ed to it, so the caching
      allocator does not hand their memory to the compute stream before the copies read them;
    - the compute stream waits for the last copy's event (``stream.wait_event``), without
      blocking the host: right after the step, or with the delayed update when ``finish()``
      applies it, so the next forward reads the new parameters. The delayed update's thread
      never synchronizes the compute stream, so the forward running meanwhile is not stalled.
    Off CUDA (or when nothing crosses devices) there is nothing to copy and this is unused."""

    def __init__(self, device: torch.device) -> None:
        assert device.type == "cuda", device
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._staging: torch.Tensor | None = None

    def staging_bytes(self) -> int:
        return self._staging.untyped_storage().nbytes() if self._staging is not None else 0

    def to_host(self, begin: torch.cuda.Event, tensors: list[tuple[str, torch.Tensor, torch.Tensor | None]],
                pin: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor | None, torch.cuda.Event]]:
        """Issue the device-to-host copies of ``(fqn, grad, device parameter or None)``: fqn -> (host grad,
        host parameter or None, event after both)."""
        need = sum(g.numel() * (2 if param is not None else 1) for _, g, param in tensors)
        if self._staging is None or self._staging.numel() < need:
            self._staging = torch.empty(need, dtype=torch.float32, pin_memory=pin)
        out: dict[str, tuple[torch.Tensor, torch.Tensor | None, torch.cuda.Event]] = {}
        at = 0
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(begin)
            for fqn, grad, param in tensors:
                grad.record_stream(self.stream)
                host_grad = self._staging[at : at + grad.numel()].view(grad.shape)
                at += grad.numel()
                host_grad.copy_(grad, non_blocking=True)
                host_param = None
                if param is not None:
                    param.record_stream(self.stream)
                    host_param = self._staging[at : at + param.numel()].view(param.shape)
                    at += param.numel()
                    host_param.copy_(param, non_blocking=True)
                out[fqn] = (host_grad, host_param, self.stream.record_event())
        return out

    def to_device(self, target: torch.Tensor, source: torch.Tensor) -> torch.cuda.Event:
        """Copy ``source`` (host) into ``target`` (device) on the side stream; its event."""
        with torch.cuda.stream(self.stream):
            target.copy_(source, non_blocking=True)
            return self.stream.record_event()

