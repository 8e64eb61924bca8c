"""Hugging Face ``MambaForCausalLM`` and ``Mamba2ForCausalLM`` with their scan as one
``zerofx::selective_scan`` op: an opt-in adapter, ``use_zerofx_scan(model)``.

NOTE [Hugging Face Mamba through the scan op]
Without their CUDA kernels, Hugging Face's mixers compute the scan in ways a graph rewrite cannot
own: Mamba-1's reference scan (``mamba_selective_scan``) loops over T in Python (about 8 ops per
position in the captured graph, then a ``stack``), and Mamba-2's (``mamba2_chunk_scan``) is a
fixed chunked SSD subgraph of some forty ops (``segment_sum``, ``cumsum``, ``exp``, einsums) tied to one library version. The
adapter, as kernel libraries do for Hugging Face modules, gives each ``MambaMixer`` and
``Mamba2Mixer`` a forward that computes the same function with the scan as one op
(zerofx/models/scan.py, NOTE [The selective scan op]), which sequence parallelism runs by state
passing (NOTE [Scan by state passing] in passes/sequence/mixer_scan.py):

- Mamba-1: ``in_proj``, the depthwise causal conv (``conv1d(padding=K-1)`` sliced to T, then
  the activation), ``x_proj`` into (dt, B, C), ``delta = softplus(dt_proj(dt))``,
  ``A = -exp(A_log)``, the scan with the D skip, the SiLU gate and ``out_proj``, as
  ``MambaMixer.forward``. A, D and dt_proj's bias are taken in fp32 at least (``.float()``), as
  Hugging Face takes them.
- Mamba-2: ``in_proj`` into (gate, xBC, dt), the conv over xBC, ``delta = clamp(softplus(dt +
  dt_bias), time_step_limit)``. Its SSM is a selective scan over E = H · P channels: head h's
  channels h·P .. h·P + P − 1 share the head's scalar decay A_h, its delta and its D, so
  A (E, N) is A_h broadcast over the head's channels and the N states, delta (B, T, E) and D (E,)
  likewise; B and C are shared by the heads of a group, so each of the G groups is one scan of
  its E / G channels with the group's (B, T, N) slices of B and C (G scans, concatenated along
  the channels). Then the gated RMSNorm and ``out_proj``.
- Precision: the scan computes in fp32 at least, fp64 for an fp64 model. Hugging Face rounds
  the SSM's inputs to fp32 (Mamba-1's ``.float()`` of B and x; Mamba-2's SSD runs in fp32) and
  its logits are fp32, so in fp32 and in fp64 the two agree to fp32 rounding
  (tests/test_hf_mamba.py).
- ``chunk_len`` is the scan's (NOTE [Scan chunk length]), not Mamba-2's ``chunk_size``, and
  does not change the result beyond rounding. The scan stays finite for any delta: a chunk whose
  decay is past fp32's exp range in the cumulative form (a checkpoint trained to steps well past
  its config's ``time_step_max``) takes the segment-sum form, so any ``chunk_len`` runs any
  checkpoint. The cumulative form is L times cheaper in memory and compute; a chunk takes it
  while ``chunk_len · delta · max |A|`` stays within 60, so with Hugging Face's init (delta at
  most ``time_step_max``, 0.1; |A| at most N for Mamba-1, H for Mamba-2) every chunk of the
  default 32 does up to 18 states or heads, and ``chunk_len <= 600 / max |A|`` keeps a wider
  model there.

Only the forward of training and of whole-sequence evaluation changes. A call with a cache
(generation) runs Hugging Face's own forward. The mixer keeps its parameters, their names and
its state dict: the adapter swaps each mixer's class for a subclass that overrides ``forward``,
as ``torch.nn.utils.parametrize`` does. Subclasses of the two mixers, whose forward may differ,
are refused by name (Jamba's ``JambaMambaMixer``, Mamba-1's with RMSNorms of dt, B and C, is
adapted; the mixers of FalconMamba, Bamba and the other hybrids are classes of their own, not
adapted), as are the keywords of packed sequences (``seq_idx``,
``cu_seqlens``, ``cu_seq_lens_q``, ``cu_seq_lens_k``) and a conv other than Hugging Face's;
other keywords (the loss's ``num_items_in_batch``) are ignored, as Hugging Face's mixers ignore
them.
transformers is imported when the adapter runs, not with this module.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from zerofx.common.errors import CaptureError, ZeroFXError
from zerofx.models.scan import selective_scan

Tensor = torch.Tensor
DEFAULT_CHUNK_LEN = 32  # NOTE [Scan chunk length]: Hugging Face's inits keep every chunk of 32 in the cumulative form
# The keywords that pack several sequences into one row: Mamba-2's kernels' and attention's.
PACKED_SEQUENCE_KWARGS = ("seq_idx", "cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k")


def _mask(x: Tensor, attention_mask: Tensor | None) -> Tensor:
    """Hugging Face's ``apply_mask_to_padding_states``: zero the padded positions of x (B, T, C)."""
    return x if attention_mask is None else (x * attention_mask[:, :, None]).to(x.dtype)


def _causal_conv(conv: torch.nn.Conv1d, x: Tensor, act: Callable[[Tensor], Tensor]) -> Tensor:
    """Hugging Face's ``causal_conv1d_fn`` on x (B, T, C) channels-last: ``conv1d(padding=K-1)``
    sliced to the first T outputs, then the activation; (B, T, C)."""
    t = x.shape[1]
    u = x.transpose(1, 2).to(conv.weight.dtype)  # (B, C, T)
    out = F.conv1d(u, conv.weight, conv.bias, padding=conv.kernel_size[0] - 1, groups=x.shape[-1])[..., :t]
    return act(out).to(x.dtype).transpose(1, 2)


def mamba_mixer_scan(mixer: torch.nn.Module, hidden_states: Tensor, attention_mask: Tensor | None, chunk_len: int) -> Tensor:
    """``MambaMixer.forward`` (and ``JambaMambaMixer.forward``, with its norms of dt, B and C)
    without a cache, the scan one op: (B, T, d) -> (B, T, d)."""
    dtype = hidden_states.dtype
    r, n = mixer.time_step_rank, mixer.ssm_state_size
    hidden_states = _mask(hidden_states, attention_mask)
    x, gate = mixer.in_proj(hidden_states).chunk(2, dim=-1)  # (B, T, E) each
    x = _mask(_causal_conv(mixer.conv1d, x, mixer.act), attention_mask)  # (B, T, E)
    dt, b, c = torch.split(mixer.x_proj(x), [r, n, n], dim=-1)  # (B, T, R), (B, T, N), (B, T, N)
    if isinstance(getattr(mixer, "dt_layernorm", None), torch.nn.Module):  # Jamba's RMSNorms of dt, B and C
        dt, b, c = mixer.dt_layernorm(dt), mixer.b_layernorm(b), mixer.c_layernorm(c)
    dt = F.linear(dt, mixer.dt_proj.weight)  # (B, T, E)
    if mixer.dt_proj.bias is not None:
        dt = dt + mixer.dt_proj.bias.float()
    a = -torch.exp(mixer.A_log.float())  # (E, N)
    y = selective_scan(x, F.softplus(dt), a, b, c, mixer.D.float(), chunk_len=chunk_len)  # (B, T, E), with D x
    return mixer.out_proj((y * F.silu(gate)).to(dtype))


def mamba2_mixer_scan(mixer: torch.nn.Module, hidden_states: Tensor, attention_mask: Tensor | None, chunk_len: int) -> Tensor:
    """``Mamba2Mixer.forward`` without a cache, the SSM as one selective scan per group of heads
    (NOTE [Hugging Face Mamba through the scan op]): (B, T, d) -> (B, T, d)."""
    dtype = hidden_states.dtype
    e, h, p, g, n = mixer.intermediate_size, mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.ssm_state_size
    hidden_states = _mask(hidden_states, attention_mask)
    gate, xbc, dt = mixer.in_proj(hidden_states).split([e, mixer.conv_dim, h], dim=-1)  # (B, T, E), (B, T, E + 2GN), (B, T, H)
    xbc = _mask(_causal_conv(mixer.conv1d, xbc, mixer.act), attention_mask)
    x, b, c = torch.split(xbc, [e, g * n, g * n], dim=-1)  # (B, T, E), (B, T, G N), (B, T, G N)
    lo, hi = mixer.time_step_limit
    dt = torch.clamp(F.softplus(dt + mixer.dt_bias.to(dt.dtype)), min=lo, max=hi)  # (B, T, H)
    bsz, t = x.shape[:2]
    delta = dt[..., None].expand(bsz, t, h, p).reshape(bsz, t, e)  # (B, T, E): each head's dt on its P channels
    a = (-torch.exp(mixer.A_log.float()))[:, None, None].expand(h, p, n).reshape(e, n)  # (E, N)
    d = mixer.D[:, None].expand(h, p).reshape(e)  # (E,)
    width = e // g  # the channels of one group's heads
    ys = []
    for k in range(g):
        ch, st = slice(k * width, (k + 1) * width), slice(k * n, (k + 1) * n)
        ys.append(selective_scan(x[..., ch], delta[..., ch], a[ch], b[..., st], c[..., st], d[ch], chunk_len=chunk_len))
    y = ys[0] if g == 1 else torch.cat(ys, dim=-1)  # (B, T, E), with D x
    y = mixer.norm(y.to(torch.promote_types(y.dtype, torch.float32)), gate)
    return mixer.out_proj(y.to(dtype))


def _check_conv(name: str, conv: torch.nn.Conv1d, channels: int) -> None:
    k = conv.kernel_size[0]
    if (conv.stride, conv.dilation, conv.padding, conv.groups, conv.padding_mode) != ((1,), (1,), (k - 1,), channels, "zeros"):
        raise ZeroFXError(f"use_zerofx_scan: {name}.conv1d is not Hugging Face's depthwise causal conv (stride 1, dilation 1, "
                          f"padding {k - 1}, groups {channels}, zeros): stride {conv.stride}, dilation {conv.dilation}, padding "
                          f"{conv.padding}, groups {conv.groups}, {conv.padding_mode}")


def _scan_forward(base: type, scan: Callable[..., Tensor], chunk_len: int, recording: bool) -> Callable[..., Tensor]:
    def forward(self: torch.nn.Module, hidden_states: Tensor, cache: object | None = None, attention_mask: Tensor | None = None,
                **kwargs: object) -> Tensor:
        cache = kwargs.pop("cache_params", None) if cache is None else cache
        if cache is not None and not recording:  # generation: Hugging Face's own path, which reads and updates the cache
            return base.forward(self, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        packed = sorted(k for k in PACKED_SEQUENCE_KWARGS if kwargs.get(k) is not None)
        if packed:
            raise CaptureError(f"{type(self).__name__} (use_zerofx_scan) does not take {', '.join(packed)}: the scan runs every "
                               "sequence of the batch whole from a zero state (packed sequences are not kept apart)")
        return scan(self, hidden_states, attention_mask, chunk_len)  # other keywords (the loss's) are ignored, as Hugging Face's are

    return forward


_SUBCLASSES: dict[tuple[type, int, bool], type] = {}


def _subclass(base: type, scan: Callable[..., Tensor], chunk_len: int, recording: bool = False) -> type:
    """``base`` with the scan's forward; ``recording``: the class a capture records (NOTE [The scan adapter while capturing])."""
    key = (base, chunk_len, recording)
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = type(f"ZeroFXScan{base.__name__}", (base,), {
            "forward": _scan_forward(base, scan, chunk_len, recording), "zerofx_scan_chunk_len": chunk_len, "__module__": __name__,
            "__doc__": f"Hugging Face's {base.__name__} with the scan as one zerofx::selective_scan op (use_zerofx_scan)."})
    return _SUBCLASSES[key]


def is_zerofx_scan_mixer(module: torch.nn.Module) -> bool:
    """Whether ``use_zerofx_scan`` has adapted this module."""
    return type(module) in _SUBCLASSES.values()


def _mixer_classes() -> dict[type, Callable[..., Tensor]]:
    from transformers.models.jamba.modeling_jamba import JambaMambaMixer
    from transformers.models.mamba.modeling_mamba import MambaMixer
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    return {MambaMixer: mamba_mixer_scan, Mamba2Mixer: mamba2_mixer_scan, JambaMambaMixer: mamba_mixer_scan}


def _adaptable(model: torch.nn.Module, scans: dict[type, Callable[..., Tensor]], *,
               strict: bool = True) -> list[tuple[torch.nn.Module, type]]:
    """Each mixer of ``model`` the adapter takes, with its Hugging Face class; for one it cannot
    take, raises (``strict``) or leaves it out."""
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    adapted = {sub: base for (base, *_), sub in _SUBCLASSES.items()}
    found = []
    for name, module in model.named_modules():
        cls = adapted.get(type(module), type(module))
        if cls not in scans:
            other = next((base for base in scans if isinstance(module, base)), None)
            if other is not None and strict:
                raise ZeroFXError(f"use_zerofx_scan: {name} is a {cls.__name__}, a subclass of {other.__name__} whose forward may differ; "
                                  f"only {other.__name__} itself is adapted")
            continue
        channels = module.conv_dim if cls is Mamba2Mixer else module.intermediate_size
        try:
            _check_conv(name, module.conv1d, channels)
            if cls is Mamba2Mixer and module.num_heads % module.n_groups:
                raise ZeroFXError(f"use_zerofx_scan: {name} has {module.num_heads} heads in {module.n_groups} groups, which do not "
                                  "divide them")
        except ZeroFXError:
            if strict:
                raise
            continue
        found.append((module, cls))
    return found


def use_zerofx_scan(model: torch.nn.Module, *, chunk_len: int = DEFAULT_CHUNK_LEN) -> torch.nn.Module:
    """Give every Hugging Face ``MambaMixer``, ``Mamba2Mixer`` and ``JambaMambaMixer`` in ``model``
    a forward with the scan as one ``zerofx::selective_scan`` op, in place, and return ``model``;
    parameters, their names and the state dict are unchanged (NOTE [Hugging Face Mamba through
    the scan op]). Sequence parallelism applies it by itself while it captures (``scan_adapted``);
    run it before ``zerofx.initialize`` or ``zerofx.compile`` for a capture without sequence
    parallelism, or for another ``chunk_len``; a mixer already adapted is adapted again with the new
    ``chunk_len``."""
    if isinstance(chunk_len, bool) or not isinstance(chunk_len, int) or chunk_len < 1:
        raise ZeroFXError(f"use_zerofx_scan: chunk_len must be a positive int, got {chunk_len!r}")
    scans = _mixer_classes()
    found = _adaptable(model, scans)
    if not found:
        raise ZeroFXError(f"use_zerofx_scan: {type(model).__name__} holds no MambaMixer, Mamba2Mixer or JambaMambaMixer "
                          "(transformers' Mamba, Mamba-2 and Jamba)")
    for module, cls in found:
        module.__class__ = _subclass(cls, scans[cls], chunk_len)
    return model


@contextlib.contextmanager
def scan_adapted(model: torch.nn.Module) -> Iterator[None]:
    """NOTE [The scan adapter while capturing]
    Under sequence parallelism the capture records the model with every Hugging Face Mamba,
    Mamba-2 and Jamba mixer given the adapter's forward (``use_zerofx_scan``; the default chunk
    length, or the one the user adapted it with), and gives each its own class back afterwards,
    also when the capture raises: the user's model is the same object of the same classes after
    ``zerofx.compile`` or ``zerofx.initialize``, and only the recorded graph holds the scan op.
    The class recorded runs the scan even when the model passes a cache (Jamba builds one for
    every call with ``use_cache``): the capture records a training step, whose output is the
    loss, and a cache filled during it is read by no one. A model without those mixers is recorded as it is, and so is
    a mixer the adapter would refuse (a subclass, another conv: the sequence-parallel plan then
    refuses its ops by name); transformers is read only when the
    process imported it already (a Hugging Face model did)."""
    if "transformers" not in sys.modules:
        yield
        return
    scans = _mixer_classes()
    found = [(m, cls, type(m)) for m, cls in _adaptable(model, scans, strict=False)]
    for module, cls, own in found:
        module.__class__ = _subclass(cls, scans[cls], getattr(own, "zerofx_scan_chunk_len", DEFAULT_CHUNK_LEN), recording=True)
    try:
        yield
    finally:
        for module, _, own in found:
            module.__class__ = own
